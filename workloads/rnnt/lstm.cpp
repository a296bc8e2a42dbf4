// lstm.cpp: LstmDesc, LstmPlan and the weight-space helpers over cuDNN's RNN API (cudnn_adv.h; the
// legacy API, not the frontend: cuDNN has no RNN node in its graph API).
#include "workloads/rnnt/lstm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "common/check.h"
#include "common/kernels/init.h"

namespace replay::rnnt {
namespace {

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::kFP16:
      return CUDNN_DATA_HALF;
    case DType::kBF16:
      return CUDNN_DATA_BFLOAT16;
    default:
      return CUDNN_DATA_FLOAT;
  }
}

cudnnRNNDataLayout_t cudnn_layout(LstmLayout l) {
  return l == LstmLayout::kSeqMajor ? CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED
                                    : CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED;
}

const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH:
      return "CUDNN_DEFAULT_MATH";
    case CUDNN_TENSOR_OP_MATH:
      return "CUDNN_TENSOR_OP_MATH";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION";
    case CUDNN_FMA_MATH:
      return "CUDNN_FMA_MATH";
  }
  return "?";
}

// Points the cuDNN handle at `stream` for one call and back afterwards (as cudnn_fe's
// HandleOnStream, without the frontend's headers). Host-only, safe during capture.
class HandleOnStream {
 public:
  HandleOnStream(cudnnHandle_t handle, cudaStream_t stream) : handle_(handle) {
    REPLAY_CUDNN_CHECK(cudnnGetStream(handle_, &previous_));
    changed_ = previous_ != stream;
    if (changed_) REPLAY_CUDNN_CHECK(cudnnSetStream(handle_, stream));
  }
  ~HandleOnStream() {
    if (changed_) cudnnSetStream(handle_, previous_);
  }
  HandleOnStream(const HandleOnStream&) = delete;
  HandleOnStream& operator=(const HandleOnStream&) = delete;

 private:
  cudnnHandle_t handle_;
  cudaStream_t previous_ = nullptr;
  bool changed_ = false;
};

// cudnnGetRNNWeightParams only adds offsets to the address it is given; at set-up, before the arena
// exists, the plan reads the layout against this stand-in (256-byte aligned like arena buffers,
// never dereferenced), and check_weight_layout compares with a real buffer.
const void* const kStandInBase = reinterpret_cast<const void*>(uintptr_t{1} << 40);

std::string status_text(cudnnStatus_t s) {
  return std::string(cudnnGetErrorString(s)) + " (" + std::to_string(static_cast<int>(s)) + ")";
}

[[noreturn]] void fail(const std::string& what, cudnnStatus_t s, const LstmDesc& d) {
  throw Error("cuDNN", cudnnGetErrorString(s),
              what + " failed with " + status_text(s) + " for " + d.describe());
}

void require_pointer(const void* p, const char* call, const char* name, const LstmDesc& d) {
  REPLAY_REQUIRE(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 std::string("LSTM ") + call + ": " + name +
                     " must be non-null and 16-byte aligned (" + d.describe() + ")");
}

void require_aligned(const void* p, const char* call, const char* name, const LstmDesc& d) {
  REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0, std::string("LSTM ") + call + ": " +
                                                               name + " must be 16-byte aligned (" +
                                                               d.describe() + ")");
}

const char* param_prefix(LstmParam p) {
  switch (p) {
    case LstmParam::kWeightIH:
      return "weight_ih_l";
    case LstmParam::kWeightHH:
      return "weight_hh_l";
    case LstmParam::kBiasIH:
      return "bias_ih_l";
    case LstmParam::kBiasHH:
      return "bias_hh_l";
  }
  return "?";
}

}  // namespace

const char* lstm_layout_name(LstmLayout layout) {
  return layout == LstmLayout::kSeqMajor ? "seq-major" : "batch-major";
}

// -------------------------------------------------------------------------------------------------
// LstmDesc

double LstmDesc::flops() const {
  double per_step = 0.0;
  for (int64_t l = 0; l < layers; ++l)
    per_step += 2.0 * 4.0 * static_cast<double>(hidden_size) *
                static_cast<double>(layer_input(l) + hidden_size);
  return per_step * static_cast<double>(batch) * static_cast<double>(max_seq);
}

void LstmDesc::validate() const {
  const std::string at = " (" + describe() + ")";
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  REPLAY_REQUIRE(input_size >= 1 && input_size <= kMax,
                 "LSTM input_size must be in [1, 2^31)" + at);
  REPLAY_REQUIRE(hidden_size >= 1 && hidden_size <= kMax,
                 "LSTM hidden_size must be in [1, 2^31)" + at);
  REPLAY_REQUIRE(layers >= 1 && layers <= 64, "LSTM layers must be in [1, 64]" + at);
  REPLAY_REQUIRE(batch >= 1 && batch <= kMax, "LSTM batch must be in [1, 2^31)" + at);
  REPLAY_REQUIRE(max_seq >= 1 && max_seq <= kMax, "LSTM max_seq must be in [1, 2^31)" + at);
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16 || dtype == DType::kFP32,
                 "LSTM storage must be fp16, bf16 or fp32" + at);
  REPLAY_REQUIRE(dropout >= 0.0f && dropout < 1.0f, "LSTM dropout must be in [0, 1)" + at);
  REPLAY_REQUIRE(std::isfinite(padding_fill), "LSTM padding_fill must be finite" + at);
}

std::string LstmDesc::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "lstm I=%lld H=%lld L=%lld B=%lld T=%lld %s %s%s fill %g",
                static_cast<long long>(input_size), static_cast<long long>(hidden_size),
                static_cast<long long>(layers), static_cast<long long>(batch),
                static_cast<long long>(max_seq), dtype_name(dtype), lstm_layout_name(layout),
                bias ? "" : " no-bias", static_cast<double>(padding_fill));
  std::string out = buf;
  if (dropout > 0.0f) {
    std::snprintf(buf, sizeof(buf), " dropout %g", static_cast<double>(dropout));
    out += buf;
  }
  return out;
}

// -------------------------------------------------------------------------------------------------
// LstmWeightLayout

const LstmWeightTensor& LstmWeightLayout::find(const std::string& name) const {
  std::string names;
  for (const LstmWeightTensor& t : tensors) {
    if (t.name == name) return t;
    names += (names.empty() ? "" : ", ") + t.name;
  }
  throw Error("replay", "invalid argument",
              "LSTM weight space has no tensor '" + name + "' (it has " + names + ")");
}

TensorView LstmWeightLayout::view(void* space, const LstmWeightTensor& t) const {
  REPLAY_REQUIRE(space != nullptr, "LSTM weight view of a null weight space");
  char* p = static_cast<char*>(space) + static_cast<size_t>(t.offset) * dtype_size(dtype);
  if (t.cols == 1) return TensorView(p, dtype, {t.rows});
  return TensorView(p, dtype, {t.rows, t.cols});
}

void lstm_init_weights(const LstmWeightLayout& layout, void* weight_space, uint64_t seed,
                       uint64_t stream_base, const LstmInit& init, cudaStream_t stream) {
  REPLAY_REQUIRE(weight_space != nullptr, "lstm_init_weights: null weight space");
  REPLAY_REQUIRE(layout.hidden >= 1, "lstm_init_weights: empty layout");
  REPLAY_CUDA_CHECK(cudaMemsetAsync(weight_space, 0, layout.bytes, stream));
  const float bound = init.weights_init_scale / std::sqrt(static_cast<float>(layout.hidden));
  const int64_t H = layout.hidden;
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    const LstmWeightTensor& t = layout.tensors[k];
    TensorView v = layout.view(weight_space, t);
    init_uniform(v, seed, stream_base + k, -bound, bound, stream);
    if (t.param != LstmParam::kBiasIH && t.param != LstmParam::kBiasHH) continue;
    char* forget = static_cast<char*>(weight_space) +
                   static_cast<size_t>(t.gate_offset(1)) * dtype_size(layout.dtype);
    TensorView fv(forget, layout.dtype, {H});
    if (t.param == LstmParam::kBiasIH) {
      init_constant(fv, init.forget_gate_bias * init.weights_init_scale, stream);
    } else if (init.hidden_hidden_bias_scale == 0.0f) {
      init_constant(fv, 0.0f, stream);
    } else {
      const float b = bound * init.hidden_hidden_bias_scale;
      init_uniform(fv, seed, stream_base + 1000 + k, -std::fabs(b), std::fabs(b), stream);
    }
  }
}

// -------------------------------------------------------------------------------------------------
// LstmPlan

struct LstmPlan::Impl {
  cudnnHandle_t handle = nullptr;  // the set-up handle (the Context's), for host-only queries
  cudnnRNNDescriptor_t rnn = nullptr;
  cudnnDropoutDescriptor_t dropout = nullptr;
  cudnnRNNDataDescriptor_t x = nullptr, y = nullptr;
  cudnnTensorDescriptor_t h = nullptr;  // [L, B, H], for h and c alike
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t weight = 0, train_ws = 0, infer_ws = 0, reserve = 0, dropout_states = 0;
  bool dropout_bound = false;
  std::vector<int32_t> lengths;
  int64_t max_seq = 0;
  alignas(8) unsigned char fill[8] = {};  // padding_fill in the storage type (cuDNN reads it so)
  LstmWeightLayout layout;
  std::string layout_note;

  ~Impl() {
    if (x) cudnnDestroyRNNDataDescriptor(x);
    if (y) cudnnDestroyRNNDataDescriptor(y);
    if (h) cudnnDestroyTensorDescriptor(h);
    if (rnn) cudnnDestroyRNNDescriptor(rnn);
    if (dropout) cudnnDestroyDropoutDescriptor(dropout);
  }

  cudnnStatus_t set_rnn(const LstmDesc& d, cudnnMathType_t m) {
    return cudnnSetRNNDescriptor_v8(
        rnn, CUDNN_RNN_ALGO_STANDARD, CUDNN_LSTM,
        d.bias ? CUDNN_RNN_DOUBLE_BIAS : CUDNN_RNN_NO_BIAS, CUDNN_UNIDIRECTIONAL,
        CUDNN_LINEAR_INPUT, cudnn_type(d.dtype), CUDNN_DATA_FLOAT, m,
        static_cast<int32_t>(d.input_size), static_cast<int32_t>(d.hidden_size),
        static_cast<int32_t>(d.hidden_size), static_cast<int32_t>(d.layers),
        d.dropout > 0.0f ? dropout : nullptr, CUDNN_RNN_PADDED_IO_ENABLED);
  }

  cudnnStatus_t set_data(const LstmDesc& d, const int32_t* lens, int64_t T) {
    cudnnStatus_t s = cudnnSetRNNDataDescriptor(x, cudnn_type(d.dtype), cudnn_layout(d.layout),
                                                static_cast<int>(T), static_cast<int>(d.batch),
                                                static_cast<int>(d.input_size), lens, fill);
    if (s != CUDNN_STATUS_SUCCESS) return s;
    return cudnnSetRNNDataDescriptor(y, cudnn_type(d.dtype), cudnn_layout(d.layout),
                                     static_cast<int>(T), static_cast<int>(d.batch),
                                     static_cast<int>(d.hidden_size), lens, fill);
  }

  // Reads the named tensors from cudnnGetRNNWeightParams against `base`.
  LstmWeightLayout read_layout(const LstmDesc& d, cudnnHandle_t handle, const void* base) const;
};

LstmWeightLayout LstmPlan::Impl::read_layout(const LstmDesc& d, cudnnHandle_t handle,
                                             const void* base) const {
  const size_t es = dtype_size(d.dtype);
  const int64_t H = d.hidden_size;
  LstmWeightLayout out;
  out.dtype = d.dtype;
  out.bytes = weight;
  out.hidden = H;
  cudnnTensorDescriptor_t md = nullptr, bd = nullptr;
  REPLAY_CUDNN_CHECK(cudnnCreateTensorDescriptor(&md));
  REPLAY_CUDNN_CHECK(cudnnCreateTensorDescriptor(&bd));
  struct Guard {
    cudnnTensorDescriptor_t a, b;
    ~Guard() {
      cudnnDestroyTensorDescriptor(a);
      cudnnDestroyTensorDescriptor(b);
    }
  } guard{md, bd};

  // Offset (elements) of one matrix or bias, with its [rows, cols] checked row-major.
  auto offset_of = [&](void* addr, cudnnTensorDescriptor_t desc, int64_t rows, int64_t cols,
                       const std::string& what) {
    REPLAY_REQUIRE(addr != nullptr,
                   "cuDNN gave no address for " + what + " (" + d.describe() + ")");
    cudnnDataType_t dt;
    int nb = 0, dims[8] = {}, strides[8] = {};
    REPLAY_CUDNN_CHECK(cudnnGetTensorNdDescriptor(desc, 8, &dt, &nb, dims, strides));
    const bool shape_ok = nb == 3 && dims[0] == 1 && dims[1] == rows && dims[2] == cols &&
                          strides[2] == 1 && (rows == 1 || strides[1] == cols);
    REPLAY_REQUIRE(shape_ok, "cuDNN's " + what + " is not a row-major [" + std::to_string(rows) +
                                 ", " + std::to_string(cols) + "] matrix (dims " +
                                 std::to_string(dims[1]) + " x " + std::to_string(dims[2]) +
                                 ", strides " + std::to_string(strides[1]) + ", " +
                                 std::to_string(strides[2]) + "; " + d.describe() + ")");
    const ptrdiff_t bytes = static_cast<const char*>(addr) - static_cast<const char*>(base);
    REPLAY_REQUIRE(bytes >= 0 && bytes % static_cast<ptrdiff_t>(es) == 0 &&
                       static_cast<size_t>(bytes) + rows * cols * es <= weight,
                   "cuDNN placed " + what + " outside the weight space (" + d.describe() + ")");
    return static_cast<int64_t>(bytes / static_cast<ptrdiff_t>(es));
  };

  for (int64_t l = 0; l < d.layers; ++l) {
    const int64_t In = d.layer_input(l);
    int64_t m_off[8], b_off[8];
    for (int id = 0; id < 8; ++id) {
      void* m = nullptr;
      void* b = nullptr;
      const cudnnStatus_t s = cudnnGetRNNWeightParams(handle, rnn, static_cast<int32_t>(l), weight,
                                                      base, id, md, &m, bd, &b);
      if (s != CUDNN_STATUS_SUCCESS)
        fail("cudnnGetRNNWeightParams(layer " + std::to_string(l) + ", id " + std::to_string(id) +
                 ")",
             s, d);
      const std::string what = "layer " + std::to_string(l) + " linLayerID " + std::to_string(id);
      m_off[id] = offset_of(m, md, H, id < 4 ? In : H, what + " matrix");
      b_off[id] = d.bias ? offset_of(b, bd, H, 1, what + " bias") : -1;
    }
    // PyTorch's tensors are the four gate blocks of one kind, back to back in gate order.
    auto add = [&](LstmParam p, const int64_t* offs, int64_t cols) {
      for (int k = 1; k < 4; ++k)
        REPLAY_REQUIRE(offs[k] == offs[0] + k * H * cols,
                       std::string("cuDNN's gate blocks of ") + param_prefix(p) +
                           std::to_string(l) + " are not contiguous in the order i, f, g, o (" +
                           d.describe() + ")");
      LstmWeightTensor t;
      t.name = param_prefix(p) + std::to_string(l);
      t.layer = l;
      t.param = p;
      t.offset = offs[0];
      t.rows = 4 * H;
      t.cols = cols;
      out.tensors.push_back(t);
    };
    add(LstmParam::kWeightIH, m_off, In);
    add(LstmParam::kWeightHH, m_off + 4, H);
    if (d.bias) {
      add(LstmParam::kBiasIH, b_off, 1);
      add(LstmParam::kBiasHH, b_off + 4, 1);
    }
  }
  // No two tensors overlap.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const LstmWeightTensor& t : out.tensors)
    spans.emplace_back(t.offset, t.offset + t.elements());
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    REPLAY_REQUIRE(spans[i].first >= spans[i - 1].second,
                   "cuDNN's weight tensors overlap (" + d.describe() + ")");
  return out;
}

LstmPlan::LstmPlan(const Context& ctx, const LstmDesc& desc)
    : desc_(desc), impl_(std::make_unique<Impl>()) {
  desc_.validate();
  const LstmDesc& d = desc_;
  Impl& im = *impl_;
  im.handle = ctx.cudnn();
  REPLAY_CUDNN_CHECK(cudnnCreateRNNDescriptor(&im.rnn));
  REPLAY_CUDNN_CHECK(cudnnCreateRNNDataDescriptor(&im.x));
  REPLAY_CUDNN_CHECK(cudnnCreateRNNDataDescriptor(&im.y));
  REPLAY_CUDNN_CHECK(cudnnCreateTensorDescriptor(&im.h));
  const int dims[3] = {static_cast<int>(d.layers), static_cast<int>(d.batch),
                       static_cast<int>(d.hidden_size)};
  const int strides[3] = {static_cast<int>(d.batch * d.hidden_size),
                          static_cast<int>(d.hidden_size), 1};
  REPLAY_CUDNN_CHECK(cudnnSetTensorNdDescriptor(im.h, cudnn_type(d.dtype), 3, dims, strides));

  if (d.dropout > 0.0f) {
    REPLAY_CUDNN_CHECK(cudnnCreateDropoutDescriptor(&im.dropout));
    REPLAY_CUDNN_CHECK(cudnnDropoutGetStatesSize(im.handle, &im.dropout_states));
    // No state yet (bind_dropout gives it): cuDNN records the probability and initialises nothing.
    REPLAY_CUDNN_CHECK(
        cudnnSetDropoutDescriptor(im.dropout, im.handle, d.dropout, nullptr, 0, d.dropout_seed));
  }

  // The fill in the storage type.
  if (d.dtype == DType::kFP16) {
    const __half v = __float2half_rn(d.padding_fill);
    std::memcpy(im.fill, &v, sizeof(v));
  } else if (d.dtype == DType::kBF16) {
    const __nv_bfloat16 v = __float2bfloat16_rn(d.padding_fill);
    std::memcpy(im.fill, &v, sizeof(v));
  } else {
    std::memcpy(im.fill, &d.padding_fill, sizeof(float));
  }

  im.max_seq = d.max_seq;
  im.lengths.assign(static_cast<size_t>(d.batch), static_cast<int32_t>(d.max_seq));
  cudnnStatus_t s = im.set_data(d, im.lengths.data(), d.max_seq);
  if (s != CUDNN_STATUS_SUCCESS) fail("cudnnSetRNNDataDescriptor", s, d);

  // fp16 and bf16 on tensor cores; fp32 with FMA only (no TF32). bf16 falls back to the default
  // math where a cuDNN build has no tensor-op bf16 RNN.
  std::vector<cudnnMathType_t> maths;
  if (d.dtype == DType::kFP32)
    maths = {CUDNN_FMA_MATH};
  else
    maths = {CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH};
  std::string tried;
  bool ok = false;
  for (cudnnMathType_t m : maths) {
    s = im.set_rnn(d, m);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnGetRNNWeightSpaceSize(im.handle, im.rnn, &im.weight);
    if (s == CUDNN_STATUS_SUCCESS)
      s = cudnnGetRNNTempSpaceSizes(im.handle, im.rnn, CUDNN_FWD_MODE_TRAINING, im.x, &im.train_ws,
                                    &im.reserve);
    if (s == CUDNN_STATUS_SUCCESS) {
      size_t unused = 0;
      s = cudnnGetRNNTempSpaceSizes(im.handle, im.rnn, CUDNN_FWD_MODE_INFERENCE, im.x, &im.infer_ws,
                                    &unused);
    }
    if (s == CUDNN_STATUS_SUCCESS) {
      im.math = m;
      ok = true;
      break;
    }
    tried += std::string(tried.empty() ? "" : "; ") + math_name(m) + ": " + status_text(s);
  }
  if (!ok)
    throw Error("cuDNN", "not supported",
                "cuDNN cannot run the LSTM " + d.describe() + " (" + tried + ")");
  try {
    im.layout = im.read_layout(d, ctx.cudnn(), kStandInBase);
    im.layout_note = "read against a stand-in address";
  } catch (const Error& e) {
    // A cuDNN that checks the address: read the layout from a temporary buffer (set-up only).
    void* tmp = nullptr;
    REPLAY_CUDA_CHECK(cudaMalloc(&tmp, im.weight));
    try {
      im.layout = im.read_layout(d, ctx.cudnn(), tmp);
    } catch (...) {
      cudaFree(tmp);
      throw;
    }
    cudaFree(tmp);
    im.layout_note = std::string("read from a temporary buffer; the stand-in failed: ") + e.what();
  }
}

LstmPlan::~LstmPlan() = default;

size_t LstmPlan::weight_bytes() const {
  return impl_->weight;
}
size_t LstmPlan::training_workspace_bytes() const {
  return impl_->train_ws;
}
size_t LstmPlan::inference_workspace_bytes() const {
  return impl_->infer_ws;
}
size_t LstmPlan::workspace_bytes() const {
  return std::max(impl_->train_ws, impl_->infer_ws);
}
size_t LstmPlan::reserve_bytes() const {
  return impl_->reserve;
}
size_t LstmPlan::dropout_state_bytes() const {
  return impl_->dropout_states;
}
const LstmWeightLayout& LstmPlan::weights() const {
  return impl_->layout;
}
const std::string& LstmPlan::layout_note() const {
  return impl_->layout_note;
}
const char* LstmPlan::math() const {
  return math_name(impl_->math);
}
const std::vector<int32_t>& LstmPlan::lengths() const {
  return impl_->lengths;
}
int64_t LstmPlan::current_max_seq() const {
  return impl_->max_seq;
}

void LstmPlan::check_weight_layout(const Context& ctx, const void* weight_space) const {
  REPLAY_REQUIRE(weight_space != nullptr, "LSTM check_weight_layout: null weight space");
  const LstmWeightLayout real = impl_->read_layout(desc_, ctx.cudnn(), weight_space);
  const LstmWeightLayout& mine = impl_->layout;
  REPLAY_REQUIRE(real.tensors.size() == mine.tensors.size(),
                 "LSTM weight layout: tensor count differs with the real weight space");
  for (size_t i = 0; i < mine.tensors.size(); ++i) {
    const LstmWeightTensor &a = mine.tensors[i], &b = real.tensors[i];
    REPLAY_REQUIRE(a.name == b.name && a.offset == b.offset && a.rows == b.rows && a.cols == b.cols,
                   "LSTM weight layout: " + a.name + " at element " + std::to_string(a.offset) +
                       " at set-up, " + std::to_string(b.offset) + " with the real weight space (" +
                       desc_.describe() + ")");
  }
}

void LstmPlan::set_lengths(const int32_t* host_lengths, int64_t max_seq) {
  const LstmDesc& d = desc_;
  Impl& im = *impl_;
  REPLAY_REQUIRE(host_lengths != nullptr, "LSTM set_lengths: null lengths");
  const int64_t T = max_seq == 0 ? d.max_seq : max_seq;
  REPLAY_REQUIRE(T >= 1 && T <= d.max_seq, "LSTM set_lengths: max_seq " + std::to_string(T) +
                                               " outside [1, " + std::to_string(d.max_seq) + "] (" +
                                               d.describe() + ")");
  for (int64_t b = 0; b < d.batch; ++b)
    REPLAY_REQUIRE(host_lengths[b] >= 0 && host_lengths[b] <= T,
                   "LSTM set_lengths: sample " + std::to_string(b) + "'s length " +
                       std::to_string(host_lengths[b]) + " outside [0, " + std::to_string(T) +
                       "] (" + d.describe() + ")");
  std::vector<int32_t> lens(host_lengths, host_lengths + d.batch);
  cudnnStatus_t s = im.set_data(d, lens.data(), T);
  if (s != CUDNN_STATUS_SUCCESS) {
    // Leave the descriptors as they were, so that the plan stays usable.
    im.set_data(d, im.lengths.data(), im.max_seq);
    fail("cudnnSetRNNDataDescriptor (set_lengths)", s, d);
  }
  size_t ws = 0, rs = 0, iws = 0, unused = 0;
  s = cudnnGetRNNTempSpaceSizes(im.handle, im.rnn, CUDNN_FWD_MODE_TRAINING, im.x, &ws, &rs);
  if (s == CUDNN_STATUS_SUCCESS)
    s = cudnnGetRNNTempSpaceSizes(im.handle, im.rnn, CUDNN_FWD_MODE_INFERENCE, im.x, &iws, &unused);
  if (s != CUDNN_STATUS_SUCCESS || ws > im.train_ws || iws > im.infer_ws || rs > im.reserve) {
    im.set_data(d, im.lengths.data(), im.max_seq);
    if (s != CUDNN_STATUS_SUCCESS) fail("cudnnGetRNNTempSpaceSizes (set_lengths)", s, d);
    throw Error("replay", "invalid argument",
                "LSTM set_lengths: these lengths need workspace " + std::to_string(ws) + " / " +
                    std::to_string(iws) + " and reserve " + std::to_string(rs) +
                    " bytes, more than the plan's " + std::to_string(im.train_ws) + " / " +
                    std::to_string(im.infer_ws) + " and " + std::to_string(im.reserve) + " (" +
                    d.describe() + ")");
  }
  im.lengths = std::move(lens);
  im.max_seq = T;
}

void LstmPlan::bind_dropout(const Context& ctx, void* states, size_t bytes, cudaStream_t stream) {
  const LstmDesc& d = desc_;
  Impl& im = *impl_;
  REPLAY_REQUIRE(d.dropout > 0.0f,
                 "LSTM bind_dropout: the plan has no dropout (" + d.describe() + ")");
  require_pointer(states, "bind_dropout", "states", d);
  REPLAY_REQUIRE(bytes >= im.dropout_states,
                 "LSTM bind_dropout: " + std::to_string(bytes) + " bytes of state, " +
                     std::to_string(im.dropout_states) + " needed (" + d.describe() + ")");
  HandleOnStream on_stream(ctx.cudnn(), stream);
  cudnnStatus_t s =
      cudnnSetDropoutDescriptor(im.dropout, ctx.cudnn(), d.dropout, states, bytes, d.dropout_seed);
  if (s != CUDNN_STATUS_SUCCESS) fail("cudnnSetDropoutDescriptor", s, d);
  // The RNN descriptor is set again with the now complete dropout descriptor (host-only; the sizes
  // do not change).
  s = im.set_rnn(d, im.math);
  if (s != CUDNN_STATUS_SUCCESS) fail("cudnnSetRNNDescriptor_v8 (bind_dropout)", s, d);
  im.dropout_bound = true;
}

void LstmPlan::forward(const Context& ctx, cudaStream_t stream, LstmMode mode,
                       const LstmForwardArgs& a, void* workspace, size_t workspace_bytes,
                       void* reserve, size_t reserve_bytes) const {
  const LstmDesc& d = desc_;
  const Impl& im = *impl_;
  const bool training = mode == LstmMode::kTraining;
  const char* call = training ? "forward (training)" : "forward (inference)";
  require_pointer(a.lengths, call, "lengths", d);
  require_pointer(a.x, call, "x", d);
  require_pointer(a.y, call, "y", d);
  require_pointer(a.weights, call, "weights", d);
  require_aligned(a.hx, call, "hx", d);
  require_aligned(a.cx, call, "cx", d);
  require_aligned(a.hy, call, "hy", d);
  require_aligned(a.cy, call, "cy", d);
  const size_t ws_needed = training ? im.train_ws : im.infer_ws;
  REPLAY_REQUIRE(workspace_bytes >= ws_needed,
                 std::string("LSTM ") + call + ": workspace of " + std::to_string(workspace_bytes) +
                     " bytes, " + std::to_string(ws_needed) + " needed (" + d.describe() + ")");
  if (ws_needed > 0) require_pointer(workspace, call, "workspace", d);
  if (training) {
    REPLAY_REQUIRE(reserve_bytes >= im.reserve,
                   std::string("LSTM ") + call + ": reserve of " + std::to_string(reserve_bytes) +
                       " bytes, " + std::to_string(im.reserve) + " needed (" + d.describe() + ")");
    require_pointer(reserve, call, "reserve", d);
    REPLAY_REQUIRE(d.dropout == 0.0f || im.dropout_bound,
                   "LSTM training forward with dropout before bind_dropout (" + d.describe() + ")");
  }
  HandleOnStream on_stream(ctx.cudnn(), stream);
  REPLAY_CUDNN_CHECK(cudnnRNNForward(
      ctx.cudnn(), im.rnn, training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE, a.lengths,
      im.x, a.x, im.y, a.y, im.h, a.hx, a.hy, im.h, a.cx, a.cy, im.weight, a.weights,
      workspace_bytes, workspace, training ? reserve_bytes : 0, training ? reserve : nullptr));
  detail::host_launch_delay();
}

void LstmPlan::backward_data(const Context& ctx, cudaStream_t stream, const LstmBackwardDataArgs& a,
                             void* workspace, size_t workspace_bytes, void* reserve,
                             size_t reserve_bytes) const {
  const LstmDesc& d = desc_;
  const Impl& im = *impl_;
  const char* call = "backward data";
  require_pointer(a.lengths, call, "lengths", d);
  require_pointer(a.y, call, "y", d);
  require_pointer(a.dy, call, "dy", d);
  require_pointer(a.dx, call, "dx", d);
  require_pointer(a.weights, call, "weights", d);
  require_aligned(a.dhy, call, "dhy", d);
  require_aligned(a.dcy, call, "dcy", d);
  require_aligned(a.hx, call, "hx", d);
  require_aligned(a.cx, call, "cx", d);
  require_aligned(a.dhx, call, "dhx", d);
  require_aligned(a.dcx, call, "dcx", d);
  REPLAY_REQUIRE(workspace_bytes >= im.train_ws && reserve_bytes >= im.reserve,
                 "LSTM backward data: workspace " + std::to_string(workspace_bytes) +
                     " and reserve " + std::to_string(reserve_bytes) + " bytes, " +
                     std::to_string(im.train_ws) + " and " + std::to_string(im.reserve) +
                     " needed (" + d.describe() + ")");
  if (im.train_ws > 0) require_pointer(workspace, call, "workspace", d);
  require_pointer(reserve, call, "reserve", d);
  HandleOnStream on_stream(ctx.cudnn(), stream);
  REPLAY_CUDNN_CHECK(cudnnRNNBackwardData_v8(ctx.cudnn(), im.rnn, a.lengths, im.y, a.y, a.dy, im.x,
                                             a.dx, im.h, a.hx, a.dhy, a.dhx, im.h, a.cx, a.dcy,
                                             a.dcx, im.weight, a.weights, workspace_bytes,
                                             workspace, reserve_bytes, reserve));
  detail::host_launch_delay();
}

void LstmPlan::backward_weights(const Context& ctx, cudaStream_t stream,
                                const LstmBackwardWeightsArgs& a, void* workspace,
                                size_t workspace_bytes, void* reserve, size_t reserve_bytes) const {
  const LstmDesc& d = desc_;
  const Impl& im = *impl_;
  const char* call = "backward weights";
  require_pointer(a.lengths, call, "lengths", d);
  require_pointer(a.x, call, "x", d);
  require_pointer(a.y, call, "y", d);
  require_pointer(a.dweights, call, "dweights", d);
  require_aligned(a.hx, call, "hx", d);
  REPLAY_REQUIRE(workspace_bytes >= im.train_ws && reserve_bytes >= im.reserve,
                 "LSTM backward weights: workspace " + std::to_string(workspace_bytes) +
                     " and reserve " + std::to_string(reserve_bytes) + " bytes, " +
                     std::to_string(im.train_ws) + " and " + std::to_string(im.reserve) +
                     " needed (" + d.describe() + ")");
  if (im.train_ws > 0) require_pointer(workspace, call, "workspace", d);
  require_pointer(reserve, call, "reserve", d);
  HandleOnStream on_stream(ctx.cudnn(), stream);
  REPLAY_CUDNN_CHECK(cudnnRNNBackwardWeights_v8(
      ctx.cudnn(), im.rnn, CUDNN_WGRAD_MODE_ADD, a.lengths, im.x, a.x, im.h, a.hx, im.y, a.y,
      im.weight, a.dweights, workspace_bytes, workspace, reserve_bytes, reserve));
  detail::host_launch_delay();
}

void LstmPlan::zero_weight_grad(void* dweights, cudaStream_t stream) const {
  require_pointer(dweights, "zero_weight_grad", "dweights", desc_);
  REPLAY_CUDA_CHECK(cudaMemsetAsync(dweights, 0, impl_->weight, stream));
}

}  // namespace replay::rnnt
