// adamw.cu: multi-tensor AdamW: one block per chunk, 16-byte accesses, scalars read on the device.
#include "common/optim/adamw.h"

#include <cmath>

#include <cuda_fp16.h>

#include "common/check.h"
#include "common/device_utils.cuh"  // PackF32

namespace replay {
namespace {

constexpr int kThreads = 256;  // a 16384-element chunk is 16 vectors of 4 per thread

// Per-launch constants, the same in every thread.
struct StepConstants {
  float beta1, beta2, eps;
  float step_size;  // lr / (1 - beta1^t)
  float sqrt_bc2;   // sqrt(1 - beta2^t)
  float grad_scale;
};

// The order of operations follows torch.optim.AdamW (single-tensor path).
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float decay,
                                              const StepConstants& c) {
  g *= c.grad_scale;
  p *= decay;
  m = c.beta1 * m + (1.0f - c.beta1) * g;
  v = c.beta2 * v + (1.0f - c.beta2) * g * g;
  const float denom = sqrtf(v) / c.sqrt_bc2 + c.eps;
  p -= c.step_size * (m / denom);
}

// The model copy of four updated weights at element i (aligned to four elements).
__device__ __forceinline__ void store_model4(const AdamWTensor& t, int64_t i, const PackF32& p) {
  if (t.model_dtype == static_cast<int32_t>(DType::kBF16)) {
    alignas(8) __nv_bfloat16 w[4];
    for (int k = 0; k < 4; ++k) w[k] = __float2bfloat16_rn(p.v[k]);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(t.model) + i) =
        *reinterpret_cast<const uint2*>(w);
  } else if (t.model_dtype == static_cast<int32_t>(DType::kFP16)) {
    alignas(8) __half w[4];
    for (int k = 0; k < 4; ++k) w[k] = __float2half_rn(p.v[k]);
    *reinterpret_cast<uint2*>(static_cast<__half*>(t.model) + i) =
        *reinterpret_cast<const uint2*>(w);
  } else {
    p.store(static_cast<float*>(t.model) + i);
  }
}

__device__ __forceinline__ void store_model1(const AdamWTensor& t, int64_t j, float p) {
  if (t.model_dtype == static_cast<int32_t>(DType::kBF16))
    static_cast<__nv_bfloat16*>(t.model)[j] = __float2bfloat16_rn(p);
  else if (t.model_dtype == static_cast<int32_t>(DType::kFP16))
    static_cast<__half*>(t.model)[j] = __float2half_rn(p);
  else
    static_cast<float*>(t.model)[j] = p;
}

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(AdamWTable table, AdamWHyper hyper, const float* __restrict__ lr,
                 const int64_t* __restrict__ step, const float* __restrict__ grad_scale,
                 const int32_t* __restrict__ noop) {
  if (noop != nullptr && *noop != 0) return;  // skipped step (overflow): touch nothing
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const AdamWTensor t = table.tensors[chunk.tensor];

  StepConstants c;
  c.beta1 = hyper.beta1;
  c.beta2 = hyper.beta2;
  c.eps = hyper.eps;
  const float rate = *lr;
  const double steps = static_cast<double>(*step);
  c.step_size = static_cast<float>(rate / (1.0 - pow(static_cast<double>(hyper.beta1), steps)));
  c.sqrt_bc2 = static_cast<float>(sqrt(1.0 - pow(static_cast<double>(hyper.beta2), steps)));
  c.grad_scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  const float decay = t.weight_decay ? 1.0f - rate * hyper.weight_decay : 1.0f;

  const int64_t end = chunk.start + chunk.length;
  for (int64_t i = chunk.start + 4 * threadIdx.x; i < end; i += 4 * kThreads) {
    if (i + 4 <= end) {
      PackF32 p = PackF32::load(t.master + i);
      const PackF32 g = PackF32::load_cs(t.grad + i);
      PackF32 m = PackF32::load(t.exp_avg + i);
      PackF32 v = PackF32::load(t.exp_avg_sq + i);
      for (int k = 0; k < 4; ++k) adamw_element(p.v[k], m.v[k], v.v[k], g.v[k], decay, c);
      p.store(t.master + i);
      m.store(t.exp_avg + i);
      v.store(t.exp_avg_sq + i);
      if (t.model != nullptr) store_model4(t, i, p);
    } else {  // the last few elements of a tensor whose size is not a multiple of 4
      for (int64_t j = i; j < end; ++j) {
        float p = t.master[j], m = t.exp_avg[j], v = t.exp_avg_sq[j];
        adamw_element(p, m, v, t.grad[j], decay, c);
        t.master[j] = p;
        t.exp_avg[j] = m;
        t.exp_avg_sq[j] = v;
        if (t.model != nullptr) store_model1(t, j, p);
      }
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace

void AdamWTableBuilder::add(float* master, const TensorView& model, const float* grad,
                            float* exp_avg, float* exp_avg_sq, int64_t numel, bool weight_decay) {
  REPLAY_REQUIRE(
      master != nullptr && grad != nullptr && exp_avg != nullptr && exp_avg_sq != nullptr,
      "AdamW tensor with a null fp32 pointer");
  REPLAY_REQUIRE(
      model.dtype == DType::kBF16 || model.dtype == DType::kFP16 || model.dtype == DType::kFP32,
      std::string("AdamW's model copy must be bf16, fp16 or fp32, got ") + dtype_name(model.dtype));
  REPLAY_REQUIRE(aligned(master, 16) && aligned(grad, 16) && aligned(exp_avg, 16) &&
                     aligned(exp_avg_sq, 16) && aligned(model.data, 4 * dtype_size(model.dtype)),
                 "AdamW tensors must be 16-byte aligned (the model copy to four of its elements)");
  builder_.add(AdamWTensor{master, model.data, grad, exp_avg, exp_avg_sq, numel,
                           weight_decay ? 1 : 0, static_cast<int32_t>(model.dtype)});
}

void AdamWTableBuilder::add(float* master, __nv_bfloat16* model, const float* grad, float* exp_avg,
                            float* exp_avg_sq, int64_t numel, bool weight_decay) {
  add(master, TensorView(model, DType::kBF16, {numel}), grad, exp_avg, exp_avg_sq, numel,
      weight_decay);
}

void adamw_step(const AdamWTable& table, const AdamWHyper& hyper, const float* lr,
                const int64_t* step, const float* grad_scale, const int32_t* noop,
                cudaStream_t stream) {
  REPLAY_REQUIRE(table.tensors != nullptr && table.num_chunks > 0, "AdamW table not built");
  REPLAY_REQUIRE(lr != nullptr && step != nullptr, "AdamW needs device lr and step");
  REPLAY_REQUIRE(hyper.beta1 >= 0.0f && hyper.beta1 < 1.0f && hyper.beta2 >= 0.0f &&
                     hyper.beta2 < 1.0f && hyper.eps > 0.0f,
                 "AdamW betas must lie in [0, 1) and eps be positive");
  adamw_kernel<<<static_cast<unsigned>(table.num_chunks), kThreads, 0, stream>>>(
      table, hyper, lr, step, grad_scale, noop);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
