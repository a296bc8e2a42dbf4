// layer_norm.h: LayerNorm over rows [rows, C] in fp16 or bf16 storage with fp32 math, forward and
// backward, for the spatial transformers of the Stable Diffusion v2 UNet (issue 28: norm1, norm2
// and norm3 of every transformer block, over B x H x W tokens of C = 320, 640 or 1280 channels).
//
// Until these kernels the UNet ran its LayerNorms through the GroupNorm kernels as one group over
// one pixel per sample (group_norm.h): a block per token (640 bytes at C = 320) and three kernels
// forward, four backward, in chunks of 32,768 tokens; here a warp owns a row.
//
//   mean = sum(x) / C,  rstd = 1 / sqrt(sum((x - mean)^2) / C + eps)   fp32 [rows], saved
//   out = (x - mean) * rstd * gamma + beta
//   backward (xhat = (x - mean) * rstd, g = dout * gamma):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dgamma = sum over rows of dout * xhat, dbeta = sum of dout         fp32 [C]
//
// The same math, statistics and layouts as group_norm.h with one group and one pixel per sample
// (the UNet's saved mean and rstd are [rows, 1] either way), so the fp64 reference of
// unet_reference.h checks both.
//
// Forward: one warp a row, the row read once into registers (16-byte packs, evict-first), mean and
// variance two exact passes over those registers (butterfly sums: a fixed order), out written
// evict-first. Backward: a fixed grid of layer_norm_backward_blocks(rows) blocks of 8 warps; warp w
// of block b takes rows (b * 8 + w), + 8 * blocks, ...; each lane keeps its columns' dgamma and
// dbeta sums in registers, a block adds its warps' sums in warp order into one partial row, and
// column_sums (common/kernels/column_sums.cuh) adds the partial rows in a fixed order. Every sum
// depends on (rows, C) alone: deterministic, bit for bit, on any device.
//
// Requirements: dtype kFP16 or kBF16; 1 <= rows < 2^31; C a multiple of 8 in [8,
// kLayerNormMaxChannels]; every tensor pointer 16-byte aligned, the workspace too. out may alias
// x; dx may alias dout when accumulate_dx is false (a lane reads a row's packs before it writes
// them). Launchers only enqueue work on `stream` (programmatic dependent launches): no allocation,
// no synchronization, no host read, so they can be captured.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/tensor.h"

namespace replay::unet {

constexpr int kLayerNormMaxChannels = 1536;  // 6 packs of 8 values a lane

// Throws Error naming the shape when it breaks the requirements above.
void check_layer_norm_shape(int64_t rows, int C);
// The backward's blocks (a pure function of rows) and its workspace: 2 partial rows of C floats a
// block. Callable without a GPU.
int layer_norm_backward_blocks(int64_t rows);
size_t layer_norm_backward_workspace_bytes(int64_t rows, int C);

void layer_norm_forward(DType dtype, void* out, float* mean, float* rstd, const void* x,
                        const void* gamma, const void* beta, int64_t rows, int C, float eps,
                        cudaStream_t stream);

// accumulate_dx adds dx into what dx holds (a residual stream's gradient summed in place);
// accumulate_param_grads adds into dgamma and dbeta.
void layer_norm_backward(DType dtype, void* dx, float* dgamma, float* dbeta, const void* dout,
                         const void* x, const void* gamma, const float* mean, const float* rstd,
                         int64_t rows, int C, bool accumulate_dx, bool accumulate_param_grads,
                         void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay::unet
