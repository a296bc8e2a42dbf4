// accumulate.cu: fp32 accumulation and the ordered mean of a few scalars.
#include "common/kernels/accumulate.h"

#include <algorithm>

#include "common/check.h"
#include "common/device_utils.cuh"

namespace replay {
namespace {

// Four floats per thread with 16-byte accesses; the tail (n % 4) element-wise.
__global__ void accumulate_kernel(float* dst, const float* src, int64_t n) {
  const int64_t packs = n / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < packs; p += stride) {
    PackF32 d = PackF32::load(dst + 4 * p);
    const PackF32 s = PackF32::load(src + 4 * p);
#pragma unroll
    for (int j = 0; j < 4; ++j) d.v[j] += s.v[j];
    d.store(dst + 4 * p);
  }
  for (int64_t i = 4 * packs + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    dst[i] += src[i];
}

__global__ void mean_kernel(float* dst, const float* src, int n) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += src[i];
  dst[0] = sum / static_cast<float>(n);
}

}  // namespace

void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(n > 0 && dst != nullptr && src != nullptr,
                 "accumulate needs two non-empty vectors");
  REPLAY_REQUIRE(
      reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0,
      "accumulate needs 16-byte aligned vectors");
  const int blocks =
      static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(ceil_div<int64_t>(n, 4), 256), 4096));
  accumulate_kernel<<<blocks, 256, 0, stream>>>(dst, src, n);
  REPLAY_LAUNCH_CHECK();
}

void mean_of(float* dst, const float* src, int n, cudaStream_t stream) {
  REPLAY_REQUIRE(n > 0 && dst != nullptr && src != nullptr, "mean_of needs at least one value");
  mean_kernel<<<1, 1, 0, stream>>>(dst, src, n);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
