// norms.h: LayerNorm and RMSNorm over rows of width C, forward and backward (bf16 storage, fp32
// math), with deterministic parameter gradients (per-block partial sums reduced in a fixed order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace replay {

// Shapes every norm op accepts: rows >= 1, C a multiple of 8 with 8 <= C <= kNormMaxChannels, and
// every tensor pointer 16-byte aligned. eps is a constant hyperparameter, so it is passed by value.
constexpr int kNormMaxChannels = 32768;

// LayerNorm forward over x [rows, C]:
//   mean = sum(x) / C,  rstd = 1 / sqrt(sum((x - mean)^2) / C + eps),
//   out = (x - mean) * rstd * gamma + beta.
// gamma, beta: [C] bf16. mean, rstd: [rows] fp32, saved for the backward. out may alias x.
void layernorm_forward(__nv_bfloat16* out, float* mean, float* rstd, const __nv_bfloat16* x,
                       const __nv_bfloat16* gamma, const __nv_bfloat16* beta, int64_t rows, int C,
                       float eps, cudaStream_t stream);

// RMSNorm forward: rstd = 1 / sqrt(sum(x^2) / C + eps), out = x * rstd * gamma. rstd: [rows] fp32.
void rmsnorm_forward(__nv_bfloat16* out, float* rstd, const __nv_bfloat16* x,
                     const __nv_bfloat16* gamma, int64_t rows, int C, float eps,
                     cudaStream_t stream);

// Workspace the backward needs for the per-block partial sums of the parameter gradients. It
// depends on the current device's SM count (the backward runs one persistent pass over the rows per
// SM); query it at plan time with the device that will run the op current. The workspace is
// scratch: its contents are undefined after the call.
size_t layernorm_backward_workspace_bytes(int64_t rows, int C);
size_t rmsnorm_backward_workspace_bytes(int64_t rows, int C);

// LayerNorm backward from the saved mean and rstd (xhat = (x - mean) * rstd, g = dout * gamma):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))           bf16 [rows, C]
//   dgamma = sum over rows of dout * xhat, dbeta = sum of dout  fp32 [C]
// accumulate_dx adds dx into what dx already holds (a residual stream's gradient summed in place);
// accumulate_param_grads adds into dgamma/dbeta (gradient accumulation over micro-batches). Both
// sums are deterministic: fixed assignment of rows to blocks, fixed reduction order, no atomics.
void layernorm_backward(__nv_bfloat16* dx, float* dgamma, float* dbeta, const __nv_bfloat16* dout,
                        const __nv_bfloat16* x, const __nv_bfloat16* gamma, const float* mean,
                        const float* rstd, int64_t rows, int C, bool accumulate_dx,
                        bool accumulate_param_grads, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// RMSNorm backward (xhat = x * rstd, g = dout * gamma):
//   dx = rstd * (g - xhat * mean(g * xhat)),  dgamma = sum over rows of dout * xhat.
void rmsnorm_backward(__nv_bfloat16* dx, float* dgamma, const __nv_bfloat16* dout,
                      const __nv_bfloat16* x, const __nv_bfloat16* gamma, const float* rstd,
                      int64_t rows, int C, bool accumulate_dx, bool accumulate_param_grads,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay
