// activations.h: SwiGLU on a fused gate+up GEMM output and tanh-approximation GeLU, forward and
// backward (bf16 storage, fp32 math).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace replay {

// SwiGLU. in: [M, 2F] bf16, the fused GEMM output with gate = columns [0, F) and up = [F, 2F).
//   out[m, f] = silu(gate) * up,  silu(g) = g * sigmoid(g).            out: [M, F] bf16
// F must be a multiple of 8 and every pointer 16-byte aligned.
void swiglu_forward(__nv_bfloat16* out, const __nv_bfloat16* in, int64_t M, int F,
                    cudaStream_t stream);

// din[m, f]     = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))   (gradient of the gate)
// din[m, F + f] = dout * silu(g)                                         (gradient of up)
// din: [M, 2F] bf16; dout: [M, F].
void swiglu_backward(__nv_bfloat16* din, const __nv_bfloat16* dout, const __nv_bfloat16* in,
                     int64_t M, int F, cudaStream_t stream);

// GeLU, tanh approximation: out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), over n elements.
// n must be a multiple of 8 and every pointer 16-byte aligned; out may alias x.
void gelu_forward(__nv_bfloat16* out, const __nv_bfloat16* x, int64_t n, cudaStream_t stream);

// dx = dout * gelu'(x). dx may alias dout.
void gelu_backward(__nv_bfloat16* dx, const __nv_bfloat16* dout, const __nv_bfloat16* x, int64_t n,
                   cudaStream_t stream);

}  // namespace replay
