// group_norm.h: GroupNorm over NHWC activations, forward and backward, optionally fused with SiLU
// (out = silu(groupnorm(x))), fp16 or bf16 storage with fp32 math, for the Stable Diffusion v2
// UNet (issue 28). Deterministic: every sum has a fixed order, nothing uses float atomics.
//
// Layout. x, out, dout and dx are [N, HW, C] contiguous (NHWC: H and W folded into HW pixels,
// channels innermost). Channel c belongs to group c / (C / G): a group is C / G consecutive
// channels of every pixel of one sample, HW * C / G elements (81,920 at 64x64, C = 320, G = 16;
// 245,760 at 64x64, C = 960).
//
// Statistics (biased variance, as torch.nn.GroupNorm):
//   mean[n, g] = sum(x) / M,  rstd[n, g] = 1 / sqrt(sum((x - mean)^2) / M + eps),  M = HW * C / G
//   y = (x - mean) * rstd * gamma[c] + beta[c];  out = y, or silu(y) = y * sigmoid(y)
// mean and rstd are fp32 [N, G], saved by the forward for the backward. The pre-activation y is not
// saved: the fused backward recomputes it from x and the statistics.
//
// Backward, from the saved statistics (xhat = (x - mean) * rstd; dy = dout, or
// dout * sigmoid(y) * (1 + y * (1 - sigmoid(y))) with SiLU; g = dy * gamma):
//   dx = rstd * (g - mean_group(g) - xhat * mean_group(g * xhat))       storage type, [N, HW, C]
//   dgamma[c] = sum over n, pixels of dy * xhat,  dbeta[c] = sum of dy  fp32 [C]
//
// How a group's reduction is split (all GroupNorm calls of one shape use the same split, which
// depends on the shape alone, never on the device or on timing): each sample's pixels are cut into
// blocks_per_sample tiles of pixels_per_block pixels, one thread block per tile and all C channels
// of each pixel, so that N * blocks_per_sample is about a thousand blocks and an H100 is full even
// at small N. The forward runs three kernels: per-tile (mean, M2) of every group; a small one that
// merges a sample's tiles in a fixed order (Chan's formula: no E[x^2] - E[x]^2 cancellation) into
// mean and rstd; the one that writes out. The backward runs four: per-tile channel sums of dy and
// dy * xhat (and their gamma-weighted group sums); a small one that adds a sample's group sums
// into dx's coefficients; the one that writes dx; column sums of the per-tile channel partials
// for dgamma and dbeta (fixed order).
//
// Requirements: dtype kFP16 or kBF16; N >= 1, HW >= 1; C a multiple of 8 with
// 8 <= C <= kGroupNormMaxChannels; 1 <= G <= kGroupNormMaxGroups with C % G == 0; every tensor
// pointer (x, out, dout, dx, gamma, beta) 16-byte aligned, the workspace 16-byte aligned (256, as
// arena buffers are, lets the column sums drop their partials from L2). gamma and beta are [C] in
// the storage type (the model's fp16 or bf16 weights); dgamma and dbeta are fp32 (the master
// gradients). eps is a constant hyperparameter, passed by value.
//
// Aliasing: out may alias x; dx may alias dout when accumulate_dx is false (each element is read by
// the thread that writes it, before it writes it). Launchers only enqueue work on `stream`: no
// allocation, no synchronization, no host read of device memory, so they can be captured.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/tensor.h"

namespace replay::unet {

constexpr int kGroupNormMaxChannels = 4096;
constexpr int kGroupNormMaxGroups = 128;

struct GroupNormShape {
  int64_t batch = 1;   // N
  int64_t pixels = 1;  // H * W
  int channels = 0;    // C
  int groups = 0;      // G

  int group_channels() const { return channels / groups; }
  int64_t elements() const { return batch * pixels * channels; }
};

enum class GroupNormAct : uint8_t { kNone, kSilu };

// The split of a shape (see above), for tests and reports. threads = the block's threads: C / 8
// columns of 16 bytes times `lanes` pixels at a time, rounded up to whole warps.
struct GroupNormSplit {
  int lanes = 1;
  int threads = 32;
  int64_t pixels_per_block = 1;
  int64_t blocks_per_sample = 1;
};

// Throws Error naming the shape when it breaks the requirements above.
void check_group_norm_shape(const GroupNormShape& s);
GroupNormSplit group_norm_split(const GroupNormShape& s);

// Workspace (scratch: undefined after the call) of each direction: per-tile group partials in the
// forward; per-tile channel partials, group partials and dx's coefficients in the backward (about
// 8 * N * blocks_per_sample * C bytes: 2.6 MB at N = 32, C = 320). Pure functions of the shape,
// callable without a GPU.
size_t group_norm_forward_workspace_bytes(const GroupNormShape& s);
size_t group_norm_backward_workspace_bytes(const GroupNormShape& s);

void group_norm_forward(DType dtype, void* out, float* mean, float* rstd, const void* x,
                        const void* gamma, const void* beta, const GroupNormShape& s, float eps,
                        GroupNormAct act, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// act must be the forward's. accumulate_dx adds dx into what dx holds (a residual branch's
// gradient summed in place); accumulate_param_grads adds into dgamma and dbeta (gradient
// accumulation over micro-batches).
void group_norm_backward(DType dtype, void* dx, float* dgamma, float* dbeta, const void* dout,
                         const void* x, const void* gamma, const void* beta, const float* mean,
                         const float* rstd, const GroupNormShape& s, GroupNormAct act,
                         bool accumulate_dx, bool accumulate_param_grads, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay::unet
