// pointwise.h: the UNet's small memory-bound ops around its GEMMs and convolutions (issue 28):
// GEGLU (the transformer blocks' feed-forward activation), nearest-neighbour 2x upsampling (the up
// path, before its convolution) and the channel concatenation of skip connections, each forward and
// backward. fp16 or bf16 storage, fp32 math, NHWC. fp64 CPU references: pointwise_reference.h.
//
// GEGLU, as diffusers' GEGLU (attention.py's FeedForward, activation_fn "geglu"): the projection's
// output in [rows, 2F] is split in halves along the last dimension, a = columns [0, F) and the gate
// b = columns [F, 2F) (hidden_states, gate = proj(x).chunk(2, dim=-1)), and
//   out[r, f] = a * gelu(b),  gelu(b) = b * Phi(b) = 0.5 * b * (1 + erf(b / sqrt(2)))
// the exact (erf) GELU, F.gelu's default; not the tanh approximation. Backward:
//   din[r, f]     = dout * gelu(b)                              (gradient of a)
//   din[r, F + f] = dout * a * (Phi(b) + b * phi(b))            (gradient of the gate)
// with phi the standard normal density. In SD2's blocks F = 4 * C: 1280 at 64x64, up to 5120.
//
// Upsampling, as F.interpolate(scale_factor=2, mode="nearest") on the up path: x [N, H, W, C],
//   y[n, 2h + i, 2w + j, c] = x[n, h, w, c],  i, j in {0, 1}                  y [N, 2H, 2W, C]
// backward: dx[n, h, w, c] = the four dy[n, 2h + i, 2w + j, c] added in fp32 in the fixed order
// (i, j) = (0, 0), (0, 1), (1, 0), (1, 1), then rounded once.
//
// Skip connections, as diffusers' up blocks (torch.cat([hidden_states, res_hidden_states], dim=1)):
// the up path's tensor first, the skip second, along channels:
//   y [rows, Ca + Cb] = [a [rows, Ca], b [rows, Cb]],  rows = N * H * W
// backward: da = dy[:, :Ca], db = dy[:, Ca:]. The skip's tensor also feeds the next block of the
// down path, so its gradient is the sum of two: accumulate_db adds into what db holds (in fp32,
// rounded once) instead of overwriting it; accumulate_da likewise. The concatenation is a kernel
// rather than a convolution reading two tensors: cuDNN's convolutions take one input, and writing
// the up path's output straight into the first Ca channels of the concatenated buffer would need
// every producer (a convolution, GroupNorm, the upsampling) to write with a row stride of Ca + Cb.
// The copy costs one read and one write of the concatenated tensor per direction.
//
// Requirements: dtype kFP16 or kBF16; F, C, Ca and Cb multiples of 8 (every SD2 width is a multiple
// of 320); every pointer 16-byte aligned; rows, N, H, W positive. Outputs may not alias inputs
// except where noted. Launchers only enqueue work on `stream`: no allocation, no synchronization,
// no host read of device memory, so they can be captured.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tensor.h"

namespace replay::unet {

// out [rows, F]; in [rows, 2F].
void geglu_forward(DType dtype, void* out, const void* in, int64_t rows, int F,
                   cudaStream_t stream);
// din [rows, 2F] (may alias in: each element is read by the thread that writes it, first); dout
// [rows, F].
void geglu_backward(DType dtype, void* din, const void* dout, const void* in, int64_t rows, int F,
                    cudaStream_t stream);

// The input's dimensions; the output is [batch, 2 * height, 2 * width, channels].
struct UpsampleShape {
  int64_t batch = 1;
  int64_t height = 1, width = 1;
  int channels = 0;
};
void upsample_nearest2x_forward(DType dtype, void* y, const void* x, const UpsampleShape& s,
                                cudaStream_t stream);
void upsample_nearest2x_backward(DType dtype, void* dx, const void* dy, const UpsampleShape& s,
                                 cudaStream_t stream);

void concat_channels_forward(DType dtype, void* y, const void* a, int Ca, const void* b, int Cb,
                             int64_t rows, cudaStream_t stream);
void concat_channels_backward(DType dtype, void* da, void* db, const void* dy, int Ca, int Cb,
                              int64_t rows, bool accumulate_da, bool accumulate_db,
                              cudaStream_t stream);

}  // namespace replay::unet
