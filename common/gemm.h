// gemm.h: replay's GEMM layer on cuBLASLt: GemmDesc (one row-major problem: shape, transposes,
// types, leading dimensions, strided batch, beta, fused epilogue), GemmPlan (layouts, heuristic and
// algorithm chosen once at set-up; run() only launches), GemmCache (plans keyed by the full desc)
// and the three GEMMs of a linear layer.
//
// Row-major convention. Every operand is a row-major matrix, as our tensors are:
//   D[m,n] = epilogue(alpha * op(A) op(B) + beta * C),  op(A) is [m,k], op(B) is [k,n];
//   A is stored [m,k], or [k,m] with trans_a; B is stored [k,n], or [n,k] with trans_b.
// cuBLASLt is column-major, and a row-major [r,c] matrix is the column-major [c,r] matrix with the
// same leading dimension. So the plan asks cuBLASLt for D^T = op(B)^T op(A)^T: cuBLASLt's "A" is
// our B (transa = trans_b), its "B" is our A (transb = trans_a), its m is our n and its n is our m.
// Nothing is copied or transposed in memory. The linear layer, with W stored [out,in] as nn.Linear
// does:
//   forward  Y[T,out]  = X[T,in] W^T      m=T,   n=out, k=in   trans_b
//   dgrad    dX[T,in]  = dY[T,out] W      m=T,   n=in,  k=out  (no transpose)
//   wgrad    dW[out,in] = dY^T X          m=out, n=in,  k=T    trans_a, fp32 D, beta 1 accumulates
//
// Determinism. The algorithm is chosen at plan time and stored in the plan, so every call (eager,
// or captured in any graph mode) runs the same kernel configuration. cuBLAS documents bit-wise
// identical results run to run for the same toolkit version on GPUs of the same architecture and SM
// count; for cuBLASLt that holds once the algorithm is fixed, which is what the plan does. The
// heuristic is also restricted to split-K reduction schemes that are fixed-order and fp32-accurate:
// none, or partials reduced by a separate kernel from the workspace, in fp32 (the output-type
// scheme only when D is fp32; with a 16-bit D it would round partial sums). The in-place scheme,
// whose order of accumulation is not documented, is never used. The heuristic answer is a pure
// function of the desc, the options, the GPU and the library version, so two runs on the same kind
// of GPU pick the same algorithm and produce the same bits. With GemmAlgoSelection::kAutotune the
// choice depends on measured times, so it (and the bits) may differ between runs; within one run it
// is made once at set-up and never differs between modes. A workspace serves one stream at a time:
// calls that may overlap on different streams need their own.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/tensor.h"

namespace replay {

class Context;

// Fused epilogues. Z = alpha * op(A) op(B) + beta * C; bias has n elements and is broadcast over
// rows (and over the batch); aux is the GeLU pre-activation, packed [batch][m][n] in D's type. GeLU
// is the tanh approximation. Bias gradients are written (never accumulated), in bias_type.
enum class Epilogue : uint8_t {
  kNone,      // D = Z
  kBias,      // D = Z + bias
  kGelu,      // D = gelu(Z)
  kGeluAux,   // D = gelu(Z), aux = Z                       (forward that keeps the pre-activation)
  kBiasGelu,  // D = gelu(Z + bias)
  kBiasGeluAux,  // D = gelu(Z + bias), aux = Z + bias
  kDGelu,        // D = Z * gelu'(aux)                         (dgrad through the GeLU)
  kDGeluBGrad,   // D = Z * gelu'(aux), bias_grad[n] = sum over rows of D   (and the GeLU layer's
                 // bias)
  kBGradA,       // D = Z, bias_grad[m] = sum over k of op(A)  (wgrad: db = column sums of dY)
  kBGradB,       // D = Z, bias_grad[n] = sum over k of op(B)
};

constexpr const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::kNone:
      return "none";
    case Epilogue::kBias:
      return "bias";
    case Epilogue::kGelu:
      return "gelu";
    case Epilogue::kGeluAux:
      return "gelu_aux";
    case Epilogue::kBiasGelu:
      return "bias_gelu";
    case Epilogue::kBiasGeluAux:
      return "bias_gelu_aux";
    case Epilogue::kDGelu:
      return "dgelu";
    case Epilogue::kDGeluBGrad:
      return "dgelu_bgrad";
    case Epilogue::kBGradA:
      return "bgrad_a";
    case Epilogue::kBGradB:
      return "bgrad_b";
  }
  return "?";
}
constexpr bool epilogue_reads_bias(Epilogue e) {
  return e == Epilogue::kBias || e == Epilogue::kBiasGelu || e == Epilogue::kBiasGeluAux;
}
constexpr bool epilogue_writes_bias_grad(Epilogue e) {
  return e == Epilogue::kDGeluBGrad || e == Epilogue::kBGradA || e == Epilogue::kBGradB;
}
constexpr bool epilogue_writes_aux(Epilogue e) {
  return e == Epilogue::kGeluAux || e == Epilogue::kBiasGeluAux;
}
constexpr bool epilogue_reads_aux(Epilogue e) {
  return e == Epilogue::kDGelu || e == Epilogue::kDGeluBGrad;
}
// Length of the bias (or bias-gradient) vector for an m x n output.
constexpr int64_t epilogue_bias_length(Epilogue e, int64_t m, int64_t n) {
  return e == Epilogue::kBGradA ? m : n;
}

// One GEMM problem. Leading dimensions are row strides in elements; batch strides are in elements
// between consecutive matrices. Zero means packed (see normalized()). C, when beta is 1, has D's
// layout.
struct GemmDesc {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false;         // A stored [k,m]
  bool trans_b = false;         // B stored [n,k]
  DType a_type = DType::kBF16;  // A and B: bf16, fp16, or fp8 e4m3 (both the same)
  DType b_type = DType::kBF16;
  DType d_type = DType::kBF16;     // bf16, fp16 or fp32 (C has the same type)
  DType bias_type = DType::kBF16;  // the bias read, or the bias gradient written
  int64_t lda = 0, ldb = 0, ldd = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0, or 1 to add C (by default D itself: accumulation in place)
  Epilogue epilogue = Epilogue::kNone;
  // Byte alignment that every pointer passed to run() is guaranteed to have (a power of two, 16 to
  // 256). The heuristic may pick kernels that rely on it; run() checks it. Arena buffers are
  // 256-byte aligned.
  uint32_t alignment = 256;

  // Stored shapes of A and B (rows x columns of the row-major matrices in memory).
  int64_t a_rows() const { return trans_a ? k : m; }
  int64_t a_cols() const { return trans_a ? m : k; }
  int64_t b_rows() const { return trans_b ? n : k; }
  int64_t b_cols() const { return trans_b ? k : n; }

  // Zero leading dimensions and batch strides replaced by packed values; strides are 0 when batch
  // is 1, and bias_type is bf16 when the epilogue has no bias, so that equal problems compare
  // equal.
  GemmDesc normalized() const {
    GemmDesc r = *this;
    if (r.lda == 0) r.lda = a_cols();
    if (r.ldb == 0) r.ldb = b_cols();
    if (r.ldd == 0) r.ldd = n;
    if (r.batch == 1) {
      r.stride_a = r.stride_b = r.stride_d = 0;
    } else {
      if (r.stride_a == 0) r.stride_a = a_rows() * r.lda;
      if (r.stride_b == 0) r.stride_b = b_rows() * r.ldb;
      if (r.stride_d == 0) r.stride_d = m * r.ldd;
    }
    if (!epilogue_reads_bias(epilogue) && !epilogue_writes_bias_grad(epilogue))
      r.bias_type = DType::kBF16;
    return r;
  }

  auto tie() const {
    return std::tie(m, n, k, trans_a, trans_b, a_type, b_type, d_type, bias_type, lda, ldb, ldd,
                    batch, stride_a, stride_b, stride_d, alpha, beta, epilogue, alignment);
  }
  bool operator==(const GemmDesc& o) const { return tie() == o.tie(); }
  bool operator<(const GemmDesc& o) const { return tie() < o.tie(); }
};

// One line naming the problem, e.g. "gemm 2048x9216x12288 NT bf16*bf16->bf16 epilogue=bias".
std::string describe(const GemmDesc& desc);

// The three GEMMs of a linear layer Y = X W^T (+ b) over `tokens` rows, W stored [out,in] (see the
// header comment). forward: epilogue kBias when `bias`; dgrad: none; wgrad: fp32 dW, accumulated
// (beta 1) when `accumulate_wgrad`, with the bias gradient db[out] (fp32, written) when `bias`. For
// a GeLU MLP, set fc1.forward to kBiasGeluAux, fc2.dgrad to kDGeluBGrad (which yields fc1's db) and
// fc1.wgrad to kNone.
struct LinearGemms {
  GemmDesc forward, dgrad, wgrad;
};
inline LinearGemms linear_gemms(int64_t tokens, int64_t in, int64_t out, bool bias,
                                bool accumulate_wgrad) {
  LinearGemms g;
  g.forward.m = tokens, g.forward.n = out, g.forward.k = in, g.forward.trans_b = true;
  g.forward.epilogue = bias ? Epilogue::kBias : Epilogue::kNone;
  g.dgrad.m = tokens, g.dgrad.n = in, g.dgrad.k = out;
  g.wgrad.m = out, g.wgrad.n = in, g.wgrad.k = tokens, g.wgrad.trans_a = true;
  g.wgrad.d_type = DType::kFP32;
  g.wgrad.beta = accumulate_wgrad ? 1.0f : 0.0f;
  g.wgrad.epilogue = bias ? Epilogue::kBGradA : Epilogue::kNone;
  g.wgrad.bias_type = DType::kFP32;
  return g;
}

// Throws Error naming the desc when it is not a problem replay's GEMM layer accepts (shapes, types,
// alignment of leading dimensions, epilogue and beta combinations). GemmPlan calls it first.
void validate(const GemmDesc& desc);

enum class GemmAlgoSelection : uint8_t {
  kHeuristic,  // cuBLASLt's top heuristic answer: reproducible across runs (the default)
  kAutotune,   // keep the top candidates; GemmPlan::autotune() times them and keeps the fastest
};

struct GemmOptions {
  size_t workspace_limit = size_t{32} << 20;  // what PyTorch gives cuBLASLt on Hopper
  GemmAlgoSelection selection = GemmAlgoSelection::kHeuristic;
  int autotune_candidates = 8;
};

// Device pointers for one call. Unused ones must stay null (a stray pointer is a wiring mistake).
struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* c = nullptr;     // beta 1 only; null adds D itself (in-place accumulation)
  const void* bias = nullptr;  // kBias, kBiasGelu, kBiasGeluAux
  void* bias_grad = nullptr;   // kDGeluBGrad, kBGradA, kBGradB
  void* aux = nullptr;         // written by kGeluAux/kBiasGeluAux, read by kDGelu/kDGeluBGrad
  void* workspace = nullptr;   // 256-byte aligned, at least GemmPlan::workspace_bytes()
  size_t workspace_bytes = 0;
};

// The configuration cuBLASLt chose (for logs and for the determinism tests).
struct GemmAlgoInfo {
  int id = 0, tile = 0, stages = 0, splitk = 1, swizzle = 0, custom = 0, cluster = 0;
  uint32_t reduction_scheme = 0;  // cublasLtReductionScheme_t
  size_t workspace_bytes = 0;
  float waves = 0.0f;
  std::string to_string() const;
};

class GemmPlan {
 public:
  // Validates the desc, builds layouts and the matmul descriptor, queries the heuristic and keeps
  // its best algorithm (or, with kAutotune, the top candidates). Throws Error, naming the desc,
  // when cuBLASLt has no algorithm for it.
  GemmPlan(cublasLtHandle_t handle, const GemmDesc& desc, const GemmOptions& options = {});

  // Enqueues the GEMM on `stream`. Checks the pointers on the host (presence, alignment, workspace
  // size); never allocates, synchronizes or reads device memory. Capturable. Not const: it points
  // the plan's descriptor at this call's bias and aux (host-side state, so one host thread per
  // plan).
  void run(cudaStream_t stream, const GemmArgs& args);

  // kAutotune only, at set-up and outside capture: runs each candidate on `args` (D, aux and
  // bias_grad are overwritten; with beta 1 and C null, D is accumulated into) and keeps the
  // fastest.
  void autotune(cudaStream_t stream, const GemmArgs& args, int repetitions = 10);

  const GemmDesc& desc() const { return desc_; }
  // Workspace every call needs: the chosen algorithm's, or with kAutotune the largest candidate's.
  size_t workspace_bytes() const { return workspace_bytes_; }
  int candidate_count() const { return static_cast<int>(candidates_.size()); }
  GemmAlgoInfo algo_info() const;

 private:
  cublasStatus_t enqueue(cudaStream_t stream, const GemmArgs& args,
                         const cublasLtMatmulAlgo_t& algo);
  void check_args(const GemmArgs& args) const;

  struct LtDeleter {
    void operator()(cublasLtMatmulDesc_t p) const { cublasLtMatmulDescDestroy(p); }
    void operator()(cublasLtMatrixLayout_t p) const { cublasLtMatrixLayoutDestroy(p); }
  };
  using MatmulDescPtr = std::unique_ptr<cublasLtMatmulDescOpaque_t, LtDeleter>;
  using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LtDeleter>;

  cublasLtHandle_t handle_ = nullptr;
  GemmDesc desc_;
  GemmOptions options_;
  MatmulDescPtr matmul_;
  LayoutPtr a_layout_;  // cuBLASLt's A: our B
  LayoutPtr b_layout_;  // cuBLASLt's B: our A
  LayoutPtr d_layout_;  // C and D
  std::vector<cublasLtMatmulHeuristicResult_t> candidates_;
  cublasLtMatmulHeuristicResult_t chosen_{};
  size_t workspace_bytes_ = 0;
};

// Plans keyed by the normalized desc. get() builds on first use, at set-up; seal() marks the end of
// set-up, after which a get() that would need a new plan throws (plans are never built during
// capture).
class GemmCache {
 public:
  explicit GemmCache(const Context& ctx, GemmOptions options = {});

  GemmPlan& get(const GemmDesc& desc);
  void seal() { sealed_ = true; }
  size_t size() const { return plans_.size(); }
  // The workspace to reserve in the arena: the largest requirement over all plans built so far.
  size_t max_workspace_bytes() const;
  const GemmOptions& options() const { return options_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
  GemmOptions options_;
  std::map<GemmDesc, std::unique_ptr<GemmPlan>> plans_;
  bool sealed_ = false;
};

}  // namespace replay
