// dropout.h: fused bias + dropout + residual add, out = residual + dropout(x + bias), forward and
// backward, with the keep mask drawn from Philox and regenerated (never stored) in the backward.
//
// Mask: x is [rows, C] and element e = r * C + c (its flat index) is kept when
//   philox_block(slot->seed, slot->offset + op_offset, e / 4), component e % 4,
//   is >= dropout_threshold(p)
// which happens with probability 1 - p (to within 2^-32); kept elements are scaled by 1 / (1 - p).
// The slot is read on the device, so one captured launch draws a fresh mask each step. p is a
// constant hyperparameter passed by value; p = 0 reads no RNG state (rng.slot may be null) and is
// exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/philox.h"

namespace replay {

// The integer form of p the mask compares against: floor(p * 2^32), so that host references and the
// kernels make bit-identical keep decisions. Requires 0 <= p < 1.
inline uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(std::floor(static_cast<double>(p) * 4294967296.0));
}

// out = residual + dropout(x + bias). x, residual, out: [rows, C] bf16; bias: [C] bf16 or null;
// residual may be null (plain dropout, with or without bias). out may alias x or residual.
// C must be a multiple of 8 and every pointer 16-byte aligned. mask_row > 0 draws the mask of rows
// mask_row .. mask_row + rows - 1 of a larger [*, C] tensor (its elements e counted from there):
// a sequence-parallel rank's shard of the tokens gets the slice of the whole tensor's mask.
void dropout_residual_forward(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* bias,
                              const __nv_bfloat16* residual, int64_t rows, int C, float p,
                              RngArgs rng, cudaStream_t stream, int64_t mask_row = 0);

// Workspace for the dbias partial sums (zero is fine when dbias is null); scratch, its contents
// undefined after the call.
size_t dropout_residual_backward_workspace_bytes(int64_t rows, int C);

// dx = dout * mask / (1 - p) (bf16 [rows, C]; may alias dout), the mask regenerated from the same
// rng. dbias[c] = sum over rows of dx[r, c] in fp32 (before rounding dx), deterministic: per-block
// partials in the workspace, then summed in a fixed order; skipped when dbias is null;
// accumulate_dbias adds into dbias instead of overwriting it. The residual's gradient is dout
// itself: no kernel is needed, the caller uses (or adds) dout directly.
// mask_row as in the forward.
void dropout_residual_backward(__nv_bfloat16* dx, float* dbias, const __nv_bfloat16* dout,
                               int64_t rows, int C, float p, RngArgs rng, bool accumulate_dbias,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream,
                               int64_t mask_row = 0);

}  // namespace replay
