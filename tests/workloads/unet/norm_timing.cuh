// norm_timing.cuh: what the GroupNorm and LayerNorm GPU tests' printed timings share: 16-bit
// tensors filled on the device, and a mean time a call after a warm-up. One test binary includes
// it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/check.h"
#include "common/tensor.h"
#include "tests/support/compare.h"

namespace replay::unet::timing {

using test::DeviceBuffer;

// Fills n 16-bit values with uniform [-2, 2) + offset, from a counter hash: no host round trip for
// tensors of hundreds of MB.
__global__ void fill_kernel(uint16_t* p, int64_t n, uint64_t seed, float offset, bool fp16) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float v = offset + 4.0f * (static_cast<float>(h >> 40) * (1.0f / 16777216.0f) - 0.5f);
    p[i] =
        fp16 ? __half_as_ushort(__float2half_rn(v)) : __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

void fill(DeviceBuffer<uint16_t>& b, uint64_t seed, float offset, DType t) {
  fill_kernel<<<1024, 256>>>(b.get(), static_cast<int64_t>(b.size()), seed, offset,
                             t == DType::kFP16);
  REPLAY_LAUNCH_CHECK();
}

template <typename F>
float time_ms(F&& body, int iterations) {
  cudaEvent_t start, stop;
  REPLAY_CUDA_CHECK(cudaEventCreate(&start));
  REPLAY_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) body();
  REPLAY_CUDA_CHECK(cudaEventRecord(start, nullptr));
  for (int i = 0; i < iterations; ++i) body();
  REPLAY_CUDA_CHECK(cudaEventRecord(stop, nullptr));
  REPLAY_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  REPLAY_CUDA_CHECK(cudaEventDestroy(start));
  REPLAY_CUDA_CHECK(cudaEventDestroy(stop));
  return ms / iterations;
}

}  // namespace replay::unet::timing
