// lamb.cu: multi-tensor LAMB (lamb.h): one block per chunk for the moments and the update, one
// thread per tensor for the trust ratios; every sum in a fixed order.
#include "common/optim/lamb.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "common/check.h"

namespace replay {
namespace {

constexpr int kThreads = 256;

struct LambConstants {
  float beta1, beta2, eps, bc1, bc2, grad_scale;
};

__device__ __forceinline__ LambConstants constants(const LambHyper& h, const int64_t* step,
                                                   const float* grad_scale) {
  LambConstants c;
  c.beta1 = h.beta1, c.beta2 = h.beta2, c.eps = h.eps;
  const double t = static_cast<double>(*step);
  c.bc1 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), t));
  c.bc2 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), t));
  c.grad_scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  return c;
}

// The update direction of one element from its (already updated) moments.
__device__ __forceinline__ float direction(float m, float v, float w, float wd,
                                           const LambConstants& c) {
  return (m / c.bc1) / (sqrtf(v / c.bc2) + c.eps) + wd * w;
}

// Block-wide sum in a fixed order (shared-memory tree).
__device__ __forceinline__ float block_sum(float x, float* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const float r = shared[0];
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(kThreads)
    lamb_moments_kernel(AdamWTable table, LambHyper hyper, const int64_t* step,
                        const float* grad_scale, const int32_t* noop, float* partials) {
  if (noop != nullptr && *noop != 0) return;
  __shared__ float shared[kThreads];
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const AdamWTensor t = table.tensors[chunk.tensor];
  const LambConstants c = constants(hyper, step, grad_scale);
  const float wd = t.weight_decay ? hyper.weight_decay : 0.0f;
  float ww = 0.0f, uu = 0.0f;
  for (int64_t i = chunk.start + threadIdx.x; i < chunk.start + chunk.length; i += kThreads) {
    const float g = t.grad[i] * c.grad_scale;
    const float m = c.beta1 * t.exp_avg[i] + (1.0f - c.beta1) * g;
    const float v = c.beta2 * t.exp_avg_sq[i] + (1.0f - c.beta2) * g * g;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    const float w = t.master[i];
    const float u = direction(m, v, w, wd, c);
    ww += w * w;
    uu += u * u;
  }
  ww = block_sum(ww, shared);
  uu = block_sum(uu, shared);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = ww;
    partials[2 * blockIdx.x + 1] = uu;
  }
}

// One thread per tensor: its chunks are consecutive in the table; sums them in order.
__global__ void lamb_ratio_kernel(AdamWTable table, const int32_t* noop, const float* partials,
                                  float* ratios) {
  if (noop != nullptr && *noop != 0) return;
  const int tensor = blockIdx.x * blockDim.x + threadIdx.x;
  if (tensor >= table.num_tensors) return;
  // The first chunk of this tensor: chunks are in tensor order, so a binary search finds it.
  int lo = 0, hi = table.num_chunks;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (table.chunks[mid].tensor < tensor) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  float ww = 0.0f, uu = 0.0f;
  for (int k = lo; k < table.num_chunks && table.chunks[k].tensor == tensor; ++k) {
    ww += partials[2 * k];
    uu += partials[2 * k + 1];
  }
  const float wn = sqrtf(ww), un = sqrtf(uu);
  ratios[tensor] = (wn > 0.0f && un > 0.0f) ? wn / un : 1.0f;
}

__global__ void __launch_bounds__(kThreads)
    lamb_update_kernel(AdamWTable table, LambHyper hyper, const float* lr, const int64_t* step,
                       const float* grad_scale, const int32_t* noop, const float* ratios) {
  if (noop != nullptr && *noop != 0) return;
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const AdamWTensor t = table.tensors[chunk.tensor];
  const LambConstants c = constants(hyper, step, grad_scale);
  const float wd = t.weight_decay ? hyper.weight_decay : 0.0f;
  const float scale = *lr * ratios[chunk.tensor];
  for (int64_t i = chunk.start + threadIdx.x; i < chunk.start + chunk.length; i += kThreads) {
    const float w = t.master[i];
    const float p = w - scale * direction(t.exp_avg[i], t.exp_avg_sq[i], w, wd, c);
    t.master[i] = p;
    if (t.model == nullptr) continue;
    if (t.model_dtype == static_cast<int32_t>(DType::kBF16)) {
      static_cast<__nv_bfloat16*>(t.model)[i] = __float2bfloat16_rn(p);
    } else if (t.model_dtype == static_cast<int32_t>(DType::kFP16)) {
      static_cast<__half*>(t.model)[i] = __float2half_rn(p);
    } else {
      static_cast<float*>(t.model)[i] = p;
    }
  }
}

}  // namespace

size_t lamb_workspace_bytes(int64_t chunks, int64_t tensors) {
  return static_cast<size_t>(2 * chunks + tensors) * sizeof(float);
}

size_t lamb_workspace_bound(int64_t total_numel, int64_t tensors) {
  return lamb_workspace_bytes(total_numel / kTensorChunkElements + tensors + 1, tensors);
}

void lamb_step(const AdamWTable& table, const LambHyper& hyper, const float* lr,
               const int64_t* step, const float* grad_scale, const int32_t* noop, void* workspace,
               size_t workspace_bytes, cudaStream_t stream) {
  REPLAY_REQUIRE(table.num_chunks > 0 && table.num_tensors > 0, "lamb_step: empty table");
  REPLAY_REQUIRE(lr != nullptr && step != nullptr, "lamb_step: lr and step are required");
  REPLAY_REQUIRE(workspace != nullptr &&
                     workspace_bytes >= lamb_workspace_bytes(table.num_chunks, table.num_tensors),
                 "lamb_step: workspace smaller than lamb_workspace_bytes()");
  float* partials = static_cast<float*>(workspace);
  float* ratios = partials + 2 * static_cast<int64_t>(table.num_chunks);
  lamb_moments_kernel<<<table.num_chunks, kThreads, 0, stream>>>(table, hyper, step, grad_scale,
                                                                 noop, partials);
  REPLAY_LAUNCH_CHECK();
  lamb_ratio_kernel<<<(table.num_tensors + 127) / 128, 128, 0, stream>>>(table, noop, partials,
                                                                         ratios);
  REPLAY_LAUNCH_CHECK();
  lamb_update_kernel<<<table.num_chunks, kThreads, 0, stream>>>(table, hyper, lr, step, grad_scale,
                                                                noop, ratios);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
