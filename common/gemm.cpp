// gemm.cpp: GemmDesc validation, GemmPlan (cuBLASLt descriptors, heuristic, launch, autotune) and
// GemmCache. See gemm.h for the row-major mapping and the determinism argument.
#include "common/gemm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "common/check.h"
#include "common/context.h"

namespace replay {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kFP16:
      return CUDA_R_16F;
    case DType::kFP32:
      return CUDA_R_32F;
    case DType::kFP8E4M3:
      return CUDA_R_8F_E4M3;
    default:
      break;
  }
  throw Error("replay", "unsupported type",
              std::string("GEMM operands cannot be ") + dtype_name(t));
}

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kNone:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kGelu:
      return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::kGeluAux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kBiasGelu:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
    case Epilogue::kBiasGeluAux:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kDGeluBGrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    // Our A is cuBLASLt's B and our B its A (gemm.h), so the bias-gradient sides swap.
    case Epilogue::kBGradA:
      return CUBLASLT_EPILOGUE_BGRADB;
    case Epilogue::kBGradB:
      return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool is_16bit_float(DType t) {
  return t == DType::kBF16 || t == DType::kFP16;
}

// Plan-time errors name the problem so that a workload author sees which GEMM to change.
[[noreturn]] void plan_error(const char* library, const std::string& status, const GemmDesc& desc,
                             const std::string& why, int line) {
  throw_error(library, status, "GemmPlan", __FILE__, line, describe(desc) + ": " + why);
}

template <typename T>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  REPLAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

template <typename T>
void set_attr(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const T& value) {
  REPLAY_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, attr, &value, sizeof(value)));
}

template <typename T>
void set_attr(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value) {
  REPLAY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

template <typename T>
T algo_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  REPLAY_CUBLAS_CHECK(
      cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written));
  return value;
}

}  // namespace

std::string describe(const GemmDesc& desc) {
  const GemmDesc p = desc.normalized();
  std::ostringstream os;
  os << "gemm " << desc.m << "x" << desc.n << "x" << desc.k << " " << (desc.trans_a ? 'T' : 'N')
     << (desc.trans_b ? 'T' : 'N') << " " << dtype_name(desc.a_type) << "*"
     << dtype_name(desc.b_type) << "->" << dtype_name(desc.d_type)
     << " epilogue=" << epilogue_name(desc.epilogue);
  if (epilogue_reads_bias(desc.epilogue) || epilogue_writes_bias_grad(desc.epilogue))
    os << " bias=" << dtype_name(desc.bias_type);
  if (desc.batch != 1)
    os << " batch=" << desc.batch << " strides=" << p.stride_a << "," << p.stride_b << ","
       << p.stride_d;
  if (p.lda != desc.a_cols() || p.ldb != desc.b_cols() || p.ldd != desc.n)
    os << " ld=" << p.lda << "," << p.ldb << "," << p.ldd;
  if (desc.alpha != 1.0f) os << " alpha=" << desc.alpha;
  if (desc.beta != 0.0f) os << " beta=" << desc.beta;
  if (desc.alignment != 256) os << " alignment=" << desc.alignment;
  return os.str();
}

void validate(const GemmDesc& desc) {
  const GemmDesc d = desc.normalized();
  auto require = [&](bool ok, const std::string& why) {
    if (!ok) plan_error("replay", "unsupported GEMM", d, why, __LINE__);
  };
  require(d.m > 0 && d.n > 0 && d.k > 0, "m, n and k must be positive");
  require(d.batch >= 1 && d.batch <= std::numeric_limits<int32_t>::max(),
          "batch must be between 1 and 2^31-1");

  // Types: what cuBLASLt offers with fp32 compute on Hopper.
  const bool fp8 = d.a_type == DType::kFP8E4M3;
  require(is_16bit_float(d.a_type) || fp8, "A and B must be bf16, fp16 or fp8e4m3");
  require(d.b_type == d.a_type, "A and B must have the same type");
  require(d.d_type == DType::kFP32 || d.d_type == d.a_type || (fp8 && is_16bit_float(d.d_type)),
          "D must be fp32 or the input type (bf16 or fp16 for fp8 inputs)");
  require(!fp8 || (!d.trans_a && d.trans_b),
          "fp8 GEMMs need A stored [m,k] and B stored [n,k] (trans_b): cuBLASLt runs fp8 only in "
          "that layout (its TN)");
  if (epilogue_reads_bias(d.epilogue) || epilogue_writes_bias_grad(d.epilogue))
    require(is_16bit_float(d.bias_type) || d.bias_type == DType::kFP32,
            "the bias must be bf16, fp16 or fp32");

  // Layout: leading dimensions cover a row, and every row and batch matrix starts 16-byte aligned
  // (the tensor-core kernels load 16-byte vectors: m, n, k multiples of 8 for 16-bit types).
  require(d.lda >= d.a_cols() && d.ldb >= d.b_cols() && d.ldd >= d.n,
          "a leading dimension is smaller than its matrix's row");
  const int64_t ab = static_cast<int64_t>(dtype_size(d.a_type));
  const int64_t db = static_cast<int64_t>(dtype_size(d.d_type));
  require(d.lda * ab % 16 == 0 && d.ldb * ab % 16 == 0 && d.ldd * db % 16 == 0,
          "row strides (leading dimensions) must be multiples of 16 bytes");
  if (d.batch > 1) {
    require(d.stride_a * ab % 16 == 0 && d.stride_b * ab % 16 == 0 && d.stride_d * db % 16 == 0,
            "batch strides must be multiples of 16 bytes");
    require(d.stride_a >= 0 && d.stride_b >= 0 && d.stride_d >= d.m * d.ldd,
            "the output matrices of a batch must not overlap");
  }
  require(d.alignment >= 16 && d.alignment <= 256 && (d.alignment & (d.alignment - 1)) == 0,
          "alignment must be a power of two between 16 and 256 bytes");

  // Scalars and epilogues.
  require(std::isfinite(d.alpha), "alpha must be finite");
  require(d.beta == 0.0f || d.beta == 1.0f, "beta must be 0 or 1");
  const bool plain = d.epilogue == Epilogue::kNone || d.epilogue == Epilogue::kBias ||
                     d.epilogue == Epilogue::kBGradA || d.epilogue == Epilogue::kBGradB;
  require(d.beta == 0.0f || plain,
          "beta 1 (accumulation) is supported with the none, bias and bias-gradient (bgrad_a, "
          "bgrad_b) epilogues only");
  if (epilogue_writes_bias_grad(d.epilogue)) {
    require(d.batch == 1, "bias-gradient epilogues need batch 1 (one gradient vector per GEMM)");
    require(d.alpha == 1.0f,
            "bias-gradient epilogues need alpha 1 (cuBLASLt does not document their scaling)");
  }
  if (epilogue_writes_aux(d.epilogue) || epilogue_reads_aux(d.epilogue))
    require(d.n % 8 == 0, "GeLU aux epilogues need n a multiple of 8 (the aux leading dimension)");
}

std::string GemmAlgoInfo::to_string() const {
  std::ostringstream os;
  os << "algo " << id << " tile " << tile << " stages " << stages << " cluster " << cluster
     << " splitk " << splitk << " reduction " << reduction_scheme << " swizzle " << swizzle
     << " custom " << custom << " workspace " << workspace_bytes << " B waves " << waves;
  return os.str();
}

GemmPlan::GemmPlan(cublasLtHandle_t handle, const GemmDesc& desc, const GemmOptions& options)
    : handle_(handle), desc_(desc.normalized()), options_(options) {
  REPLAY_REQUIRE(handle != nullptr, "GemmPlan needs the context's cuBLASLt handle");
  REPLAY_REQUIRE(options.autotune_candidates >= 1, "autotune_candidates must be at least 1");
  validate(desc_);
  const GemmDesc& d = desc_;

  // Column-major view of the row-major problem: D^T[n,m] = op(B)^T op(A)^T (gemm.h).
  cublasLtMatrixLayout_t layout = nullptr;
  REPLAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(
      &layout, cuda_type(d.b_type), d.trans_b ? d.k : d.n, d.trans_b ? d.n : d.k, d.ldb));
  a_layout_.reset(layout);
  REPLAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(
      &layout, cuda_type(d.a_type), d.trans_a ? d.m : d.k, d.trans_a ? d.k : d.m, d.lda));
  b_layout_.reset(layout);
  REPLAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, cuda_type(d.d_type), d.n, d.m, d.ldd));
  d_layout_.reset(layout);
  if (d.batch > 1) {
    const auto batch = static_cast<int32_t>(d.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {{a_layout_.get(), d.stride_b},
                                                                  {b_layout_.get(), d.stride_a},
                                                                  {d_layout_.get(), d.stride_d}};
    for (const auto& [l, stride] : strided) {
      set_attr(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, batch);
      set_attr(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
  }

  cublasLtMatmulDesc_t md = nullptr;
  REPLAY_CUBLAS_CHECK(cublasLtMatmulDescCreate(&md, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  matmul_.reset(md);
  set_attr(md, CUBLASLT_MATMUL_DESC_TRANSA, d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(md, CUBLASLT_MATMUL_DESC_TRANSB, d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(md, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(d.epilogue));
  // The heuristic does not dereference the bias and aux pointers but infers their alignment from
  // their values: show it an address with exactly the alignment run() will check.
  const void* aligned_address = reinterpret_cast<const void*>(uintptr_t{d.alignment});
  if (epilogue_reads_bias(d.epilogue) || epilogue_writes_bias_grad(d.epilogue)) {
    set_attr(md, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(cuda_type(d.bias_type)));
    set_attr(md, CUBLASLT_MATMUL_DESC_BIAS_POINTER, aligned_address);
  }
  if (epilogue_writes_aux(d.epilogue) || epilogue_reads_aux(d.epilogue)) {
    // aux is packed [batch][m][n]: column-major n x m with leading dimension n.
    set_attr(md, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aligned_address);
    set_attr(md, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{d.n});
    if (d.batch > 1)
      set_attr(md, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, int64_t{d.m * d.n});
  }

  cublasLtMatmulPreference_t pref_raw = nullptr;
  REPLAY_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref_raw));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref(pref_raw, cublasLtMatmulPreferenceDestroy);
  set_attr(pref_raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{options.workspace_limit});
  // Fixed-order, fp32-accurate reductions only (gemm.h, "Determinism").
  uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (d.d_type == DType::kFP32) schemes |= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  set_attr(pref_raw, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes);
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    set_attr(pref_raw, attr, d.alignment);

  const int requested =
      options.selection == GemmAlgoSelection::kAutotune ? options.autotune_candidates : 1;
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(requested));
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle_, md, a_layout_.get(), b_layout_.get(), d_layout_.get(), d_layout_.get(), pref_raw,
      requested, results.data(), &returned);
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED)
    plan_error("cuBLASLt", cublasLtGetStatusName(status), d,
               "cublasLtMatmulAlgoGetHeuristic failed", __LINE__);
  for (int i = 0; status == CUBLAS_STATUS_SUCCESS && i < returned; ++i)
    if (results[static_cast<size_t>(i)].state == CUBLAS_STATUS_SUCCESS)
      candidates_.push_back(results[static_cast<size_t>(i)]);
  if (candidates_.empty()) {
    plan_error(
        "cuBLASLt", "no algorithm", d,
        "cuBLASLt has no algorithm for this combination of layout, types and epilogue on this "
        "GPU (workspace limit " +
            std::to_string(options.workspace_limit) + " bytes)",
        __LINE__);
  }
  chosen_ = candidates_.front();
  for (const auto& c : candidates_) workspace_bytes_ = std::max(workspace_bytes_, c.workspaceSize);
}

void GemmPlan::check_args(const GemmArgs& args) const {
  const Epilogue e = desc_.epilogue;
  auto where = [&] { return " (" + describe(desc_) + ")"; };
  REPLAY_REQUIRE(args.a && args.b && args.d, "GEMM needs A, B and D" + where());
  REPLAY_REQUIRE(!args.c || desc_.beta == 1.0f, "C is only read with beta 1" + where());
  REPLAY_REQUIRE(!args.bias == !epilogue_reads_bias(e),
                 std::string("bias must be given exactly for the bias epilogues") + where());
  REPLAY_REQUIRE(
      !args.bias_grad == !epilogue_writes_bias_grad(e),
      std::string("bias_grad must be given exactly for the bias-gradient epilogues") + where());
  REPLAY_REQUIRE(
      !args.aux == !(epilogue_writes_aux(e) || epilogue_reads_aux(e)),
      std::string("aux must be given exactly for the GeLU aux and dGeLU epilogues") + where());
  const std::pair<const char*, const void*> pointers[] = {
      {"A", args.a},    {"B", args.b},       {"D", args.d},
      {"C", args.c},    {"bias", args.bias}, {"bias_grad", args.bias_grad},
      {"aux", args.aux}};
  for (const auto& [name, p] : pointers) {
    REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(p) % desc_.alignment == 0,
                   std::string(name) + " is not " + std::to_string(desc_.alignment) +
                       "-byte aligned as the plan assumes (GemmDesc::alignment)" + where());
  }
  REPLAY_REQUIRE(args.workspace_bytes >= workspace_bytes_,
                 "the workspace has " + std::to_string(args.workspace_bytes) +
                     " bytes, the plan needs " + std::to_string(workspace_bytes_) + where());
  REPLAY_REQUIRE(workspace_bytes_ == 0 ||
                     (args.workspace && reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0),
                 "the workspace must be a 256-byte aligned device pointer" + where());
}

cublasStatus_t GemmPlan::enqueue(cudaStream_t stream, const GemmArgs& args,
                                 const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulDesc_t md = matmul_.get();
  if (epilogue_reads_bias(desc_.epilogue))
    set_attr(md, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
  if (epilogue_writes_bias_grad(desc_.epilogue))
    set_attr(md, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(args.bias_grad));
  if (args.aux) set_attr(md, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, args.aux);
  // With beta 0 cuBLASLt does not read C; with beta 1 and no C, D accumulates in place. The
  // workspace size passed is the plan's, so every call presents the same configuration.
  const void* c = args.c ? args.c : args.d;
  return cublasLtMatmul(handle_, md, &desc_.alpha, args.b, a_layout_.get(), args.a, b_layout_.get(),
                        &desc_.beta, c, d_layout_.get(), args.d, d_layout_.get(), &algo,
                        args.workspace, workspace_bytes_, stream);
}

void GemmPlan::run(cudaStream_t stream, const GemmArgs& args) {
  check_args(args);
  const cublasStatus_t status = enqueue(stream, args, chosen_.algo);
  if (status != CUBLAS_STATUS_SUCCESS)
    throw_error("cuBLASLt", cublasLtGetStatusName(status), "cublasLtMatmul", __FILE__, __LINE__,
                describe(desc_));
  detail::host_launch_delay();
}

void GemmPlan::autotune(cudaStream_t stream, const GemmArgs& args, int repetitions) {
  REPLAY_REQUIRE(options_.selection == GemmAlgoSelection::kAutotune,
                 "autotune() needs GemmOptions::selection = kAutotune (" + describe(desc_) + ")");
  REPLAY_REQUIRE(repetitions >= 1, "autotune() needs at least one repetition");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  REPLAY_REQUIRE(capture == cudaStreamCaptureStatusNone,
                 "autotune() times kernels at set-up; it cannot run while the stream is captured");
  check_args(args);

  using EventPtr = std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)>;
  cudaEvent_t raw = nullptr;
  REPLAY_CUDA_CHECK(cudaEventCreate(&raw));
  EventPtr start(raw, cudaEventDestroy);
  REPLAY_CUDA_CHECK(cudaEventCreate(&raw));
  EventPtr stop(raw, cudaEventDestroy);

  float best_ms = std::numeric_limits<float>::infinity();
  for (const auto& candidate : candidates_) {
    // Warm-up; a candidate that cuBLASLt refuses for these pointers is skipped.
    if (enqueue(stream, args, candidate.algo) != CUBLAS_STATUS_SUCCESS) continue;
    REPLAY_CUDA_CHECK(cudaEventRecord(start.get(), stream));
    for (int r = 0; r < repetitions; ++r)
      REPLAY_CUBLAS_CHECK(enqueue(stream, args, candidate.algo));
    REPLAY_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0.0f;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    if (ms < best_ms) {
      best_ms = ms;
      chosen_ = candidate;
    }
  }
  REPLAY_REQUIRE(best_ms < std::numeric_limits<float>::infinity(),
                 "no autotune candidate ran (" + describe(desc_) + ")");
}

GemmAlgoInfo GemmPlan::algo_info() const {
  const cublasLtMatmulAlgo_t& a = chosen_.algo;
  GemmAlgoInfo info;
  info.id = algo_attr<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID);
  info.tile = static_cast<int>(algo_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID));
  info.stages = static_cast<int>(algo_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID));
  info.splitk = algo_attr<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  info.reduction_scheme = algo_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  info.swizzle = static_cast<int>(algo_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  info.custom = static_cast<int>(algo_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
  info.cluster = algo_attr<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  info.workspace_bytes = chosen_.workspaceSize;
  info.waves = chosen_.wavesCount;
  return info;
}

GemmCache::GemmCache(const Context& ctx, GemmOptions options)
    : handle_(ctx.cublaslt()), options_(options) {}

GemmPlan& GemmCache::get(const GemmDesc& desc) {
  const GemmDesc key = desc.normalized();
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  REPLAY_REQUIRE(!sealed_, "a GEMM plan was requested after set-up (the cache is sealed): " +
                               describe(key) + "; request every GEMM at set-up, before capture");
  auto plan = std::make_unique<GemmPlan>(handle_, key, options_);
  return *plans_.emplace(key, std::move(plan)).first->second;
}

size_t GemmCache::max_workspace_bytes() const {
  size_t bytes = 0;
  for (const auto& [desc, plan] : plans_) bytes = std::max(bytes, plan->workspace_bytes());
  return bytes;
}

}  // namespace replay
