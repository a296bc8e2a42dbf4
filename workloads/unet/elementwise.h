// elementwise.h: the UNet model's glue kernels (issue 28): the residual and skip additions, SiLU
// on the timestep embedding, the per-(sample, channel) timestep bias of every residual block with
// its gradient, the fp16/bf16 -> fp32 cast of a weight gradient, and the planted overflow of
// --overflow-at. fp16 or bf16 storage, fp32 math, one rounding per output; NHWC.
//
//   add            y = a + b                                  (y may alias a or b)
//   add_into       y += x
//   silu_forward   y = x * sigmoid(x)
//   silu_backward  dx (=|+=) dy * s * (1 + x * (1 - s)),  s = sigmoid(x)
//   channel_bias_forward   y[n, p, c] = h[n, p, c] + t[n, c]   (y may alias h)
//   channel_bias_backward  dt[n, c] = sum over p of dy[n, p, c], fp32: partial sums over chunks of
//                          64 pixels in order, then the chunks in order (a fixed order:
//                          deterministic), rounded once to the storage type
//   to_float       out[i] = float(in[i])                      (a 16-bit weight gradient into fp32)
//   poison_at      x[0] = +Inf when *iteration == at           (--overflow-at: one step's loss
//                  gradient made infinite, read from the device step counter: capturable)
//
// Requirements: dtype kFP16 or kBF16; element counts and channel counts multiples of 8; pointers
// 16-byte aligned. Launchers only enqueue work on `stream` and check the launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tensor.h"

namespace replay::unet {

void add(DType dtype, void* y, const void* a, const void* b, int64_t n, cudaStream_t stream);
void add_into(DType dtype, void* y, const void* x, int64_t n, cudaStream_t stream);
void silu_forward(DType dtype, void* y, const void* x, int64_t n, cudaStream_t stream);
void silu_backward(DType dtype, void* dx, const void* dy, const void* x, int64_t n, bool accumulate,
                   cudaStream_t stream);
void channel_bias_forward(DType dtype, void* y, const void* h, const void* t, int64_t batch,
                          int64_t pixels, int64_t channels, cudaStream_t stream);
size_t channel_bias_backward_workspace_bytes(int64_t batch, int64_t pixels, int64_t channels);
void channel_bias_backward(DType dtype, void* dt, const void* dy, int64_t batch, int64_t pixels,
                           int64_t channels, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);
void to_float(DType dtype, float* out, const void* in, int64_t n, cudaStream_t stream);
void poison_at(DType dtype, void* x, const int64_t* iteration, int64_t at, cudaStream_t stream);

}  // namespace replay::unet
