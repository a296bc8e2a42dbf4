// column_sums.cuh: the deterministic second pass shared by the backward kernels that produce
// parameter gradients (norms, dropout bias): sums fp32 partial rows [parts, C] into [C] in a fixed
// order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "common/device_utils.cuh"

namespace replay {

// out_k[c] (+)= sum over p = 0..parts-1 of partials[(k * parts + p) * C + c], for k < kOutputs.
// A block covers 32 columns with 8 row groups: group y sums parts y, y + 8, ... in order, then the
// eight group sums are added in order 0..7, so the result never depends on timing.
template <int kOutputs>
__global__ void __launch_bounds__(256)
    column_sums_kernel(float* out0, float* out1, const float* __restrict__ partials, int parts,
                       int C, bool accumulate) {
  __shared__ float group_sums[kOutputs][8][32];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float* outs[2] = {out0, out1};
#pragma unroll
  for (int k = 0; k < kOutputs; ++k) {
    float s = 0.0f;
    if (c < C) {
      const float* col = partials + static_cast<int64_t>(k) * parts * C + c;
      for (int p = threadIdx.y; p < parts; p += 8) s += col[static_cast<int64_t>(p) * C];
    }
    group_sums[k][threadIdx.y][threadIdx.x] = s;
  }
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
  for (int k = 0; k < kOutputs; ++k) {
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < 8; ++g) s += group_sums[k][g][threadIdx.x];
    outs[k][c] = accumulate ? outs[k][c] + s : s;
  }
}

template <int kOutputs>
inline void column_sums(float* out0, float* out1, const float* partials, int parts, int C,
                        bool accumulate, cudaStream_t stream) {
  column_sums_kernel<kOutputs>
      <<<ceil_div(C, 32), dim3(32, 8), 0, stream>>>(out0, out1, partials, parts, C, accumulate);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
