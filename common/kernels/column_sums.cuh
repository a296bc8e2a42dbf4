// column_sums.cuh: the deterministic second pass shared by the backward kernels that produce
// parameter gradients (norms, dropout bias): sums fp32 partial rows [parts, C] into [C] in a fixed
// order, as a programmatic dependent launch of the kernel that wrote the partials.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/dependent_launch.cuh"

namespace replay {

// Block (x, k) covers 32 columns of output k as 8 float4 columns by 32 row groups: group y sums
// parts y, y + 32, ... in order, then the 32 group sums are added in order 0..31, so the result
// depends only on (parts, C), never on timing. A warp reads four partial rows, 128 contiguous bytes
// each. With ~100-200 parts a thread has a handful of independent 16-byte loads, all issued before
// the first add, so the pass costs about one L2 round trip after its launch.
//
// The partials are scratch: once read, their L2 lines are discarded (discard.global.L2), so the
// few MB the backward kernels wrote never go out to DRAM. Written at the end of a stream of dx
// stores, they sit dirty in L2 otherwise, and their write-back takes DRAM time from whatever runs
// next. The LayerNorm backward at 2048 x 12288 (6.3 MB of partials a call), in a stream of calls,
// took 44.2 instead of 45.4 us on an H200 and 61.5 instead of 62.8 us on an H100. The discards are
// issued before the block's reduction: issued after its barrier, they gained the LayerNorm only
// 0.5 us on the H200 and cost the dropout backward (1 MB of partials) 0.6. Each block reads whole
// 128-byte lines of its own (its 32 columns of each partial row) when C is a multiple of 32 and
// the partials are 128-byte aligned; otherwise a line is shared with another block's columns and
// nothing is discarded.
constexpr int kColumnSumsGroups = 32;

// Drops a 128-byte line from L2 without writing it back; its contents become undefined.
static __device__ __forceinline__ void discard_l2_line(const void* line) {
#if __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
#endif
}

// (static: this header is included by several translation units)
static __global__ void __launch_bounds__(8 * kColumnSumsGroups)
    column_sums_kernel(float* out0, float* out1, const float* __restrict__ partials, int parts,
                       int C, bool accumulate, bool discard) {
  __shared__ float4 group_sums[kColumnSumsGroups][8];
  allow_dependent_launch();
  wait_for_previous_grid();                     // the partials come from the kernel before this one
  const int c4 = blockIdx.x * 8 + threadIdx.x;  // float4 column
  const bool valid = c4 * 4 < C;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (valid) {
    const float4* col =
        reinterpret_cast<const float4*>(partials + static_cast<int64_t>(blockIdx.y) * parts * C) +
        c4;
#pragma unroll 8
    for (int p = threadIdx.y; p < parts; p += kColumnSumsGroups) {
      const float4 v = col[static_cast<int64_t>(p) * (C / 4)];
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
  }
  // The eight threads that read a line are lanes of one warp, whose loads have returned.
  __syncwarp();
  if (discard && threadIdx.x == 0) {
    const float4* line =
        reinterpret_cast<const float4*>(partials + static_cast<int64_t>(blockIdx.y) * parts * C) +
        blockIdx.x * 8;
    for (int p = threadIdx.y; p < parts; p += kColumnSumsGroups)
      discard_l2_line(line + static_cast<int64_t>(p) * (C / 4));
  }
  group_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || !valid) return;
  float4 total = group_sums[0][threadIdx.x];
  for (int g = 1; g < kColumnSumsGroups; ++g) {
    const float4 v = group_sums[g][threadIdx.x];
    total.x += v.x;
    total.y += v.y;
    total.z += v.z;
    total.w += v.w;
  }
  // Scalar stores: the outputs carry no alignment requirement.
  float* o = (blockIdx.y == 0 ? out0 : out1) + c4 * 4;
  o[0] = accumulate ? o[0] + total.x : total.x;
  o[1] = accumulate ? o[1] + total.y : total.y;
  o[2] = accumulate ? o[2] + total.z : total.z;
  o[3] = accumulate ? o[3] + total.w : total.w;
}

// out_k[c] (+)= sum over p = 0..parts-1 of partials[(k * parts + p) * C + c], for k < outputs
// (1 or 2; out1 is unused when 1). C must be a multiple of 4 and partials 16-byte aligned. Runs as
// a programmatic dependent of the kernel launched just before it on `stream`, the one that wrote
// the partials. The partials' contents are undefined afterwards (see the discard above).
inline void column_sums(int outputs, float* out0, float* out1, float* partials, int parts, int C,
                        bool accumulate, cudaStream_t stream) {
  REPLAY_REQUIRE(C % 4 == 0 && reinterpret_cast<uintptr_t>(partials) % 16 == 0,
                 "column_sums needs C a multiple of 4 and 16-byte aligned partials");
  const bool discard = C % 32 == 0 && reinterpret_cast<uintptr_t>(partials) % 128 == 0;
  launch_dependent(column_sums_kernel, dim3(ceil_div(C, 32), outputs), dim3(8, kColumnSumsGroups),
                   stream, out0, out1, partials, parts, C, accumulate, discard);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
