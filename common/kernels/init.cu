// init.cu: Philox-based normal/uniform initialisation and constant fill.
#include "common/kernels/init.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "common/device_utils.cuh"
#include "common/philox.h"

namespace replay {
namespace {

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// The four values of Philox block `blk`: normals by Box-Muller on two pairs (a = mean, b = stddev)
// or uniforms in [a, b) from 24 bits. One function, so a shard's draw (init_slice_kernel) is
// bitwise the full tensor's.
template <bool kNormal>
__device__ __forceinline__ void philox_values(uint64_t seed, uint64_t stream_id, uint64_t blk,
                                              float a, float b, float v[4]) {
  const Philox4 r = philox_block(seed, stream_id, blk);
  const uint32_t bits[4] = {r.x, r.y, r.z, r.w};
  if constexpr (kNormal) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float u1 = philox_uniform(bits[2 * p]), u2 = philox_uniform(bits[2 * p + 1]);
      const float rad = __fmul_rn(b, sqrtf(-2.0f * logf(u1)));
      float s, c;
      sincospif(2.0f * u2, &s, &c);
      v[2 * p] = __fmaf_rn(rad, c, a);
      v[2 * p + 1] = __fmaf_rn(rad, s, a);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v[j] = __fmaf_rn(b - a, static_cast<float>(bits[j] >> 8) * 5.9604645e-8f, a);
  }
}

// Each thread produces the four values of one Philox block, so the result does not depend on the
// grid.
template <typename T, bool kNormal>
__global__ void init_random_kernel(T* x, int64_t n, uint64_t seed, uint64_t stream_id, float a,
                                   float b) {
  const int64_t blocks = (n + 3) / 4;
  for (int64_t blk = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; blk < blocks;
       blk += int64_t(gridDim.x) * blockDim.x) {
    float v[4];
    philox_values<kNormal>(seed, stream_id, static_cast<uint64_t>(blk), a, b, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * blk + j;
      if (i < n) x[i] = from_float<T>(v[j]);
    }
  }
}

// A shard's element i takes the value of the full tensor's element g(i) (InitSlice).
template <typename T>
__global__ void init_slice_kernel(T* x, int64_t n, InitSlice s, uint64_t seed, uint64_t stream_id,
                                  float a, float b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t row = i / s.cols;
    const int64_t col = i - row * s.cols;
    int64_t full_row = 0;
    for (int k = 0; k < s.sections; ++k) {
      if (row < s.rows[k]) {
        full_row = s.full_row[k] + row;
        break;
      }
      row -= s.rows[k];
    }
    const int64_t g = full_row * s.full_cols + s.col_offset + col;
    float v[4];
    philox_values<true>(seed, stream_id, static_cast<uint64_t>(g / 4), a, b, v);
    x[i] = from_float<T>(v[g % 4]);
  }
}

template <typename T>
__global__ void init_constant_kernel(T* x, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = from_float<T>(value);
}

int grid_for(int64_t work) {
  return static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(work, 256), 65536));
}

template <bool kNormal>
void launch_random(const TensorView& x, uint64_t seed, uint64_t stream_id, float a, float b,
                   cudaStream_t stream) {
  const int64_t n = x.numel();
  REPLAY_REQUIRE(x.is_contiguous(), "init needs a contiguous tensor, got " + x.describe());
  if (n == 0) return;
  const int grid = grid_for((n + 3) / 4);
  switch (x.dtype) {
    case DType::kFP32:
      init_random_kernel<float, kNormal>
          <<<grid, 256, 0, stream>>>(static_cast<float*>(x.data), n, seed, stream_id, a, b);
      break;
    case DType::kBF16:
      init_random_kernel<__nv_bfloat16, kNormal>
          <<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x.data), n, seed, stream_id, a, b);
      break;
    case DType::kFP16:
      init_random_kernel<__half, kNormal>
          <<<grid, 256, 0, stream>>>(static_cast<__half*>(x.data), n, seed, stream_id, a, b);
      break;
    default:
      REPLAY_REQUIRE(false, std::string("init does not support ") + dtype_name(x.dtype));
  }
  REPLAY_LAUNCH_CHECK();
}

}  // namespace

void init_normal(const TensorView& x, uint64_t seed, uint64_t stream_id, float mean, float stddev,
                 cudaStream_t stream) {
  launch_random<true>(x, seed, stream_id, mean, stddev, stream);
}

void init_normal_slice(const TensorView& x, const InitSlice& slice, uint64_t seed,
                       uint64_t stream_id, float mean, float stddev, cudaStream_t stream) {
  const int64_t n = x.numel();
  REPLAY_REQUIRE(x.is_contiguous(), "init needs a contiguous tensor, got " + x.describe());
  REPLAY_REQUIRE(slice.sections >= 1 && slice.sections <= 4 && slice.cols > 0 &&
                     slice.full_cols >= slice.col_offset + slice.cols,
                 "init_normal_slice: a malformed slice for " + x.describe());
  int64_t rows = 0;
  for (int k = 0; k < slice.sections; ++k) rows += slice.rows[k];
  REPLAY_REQUIRE(rows * slice.cols == n, "init_normal_slice: the slice's " + std::to_string(rows) +
                                             " x " + std::to_string(slice.cols) +
                                             " elements do not match " + x.describe());
  if (n == 0) return;
  const int grid = grid_for(n);
  switch (x.dtype) {
    case DType::kFP32:
      init_slice_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(x.data), n, slice, seed,
                                                  stream_id, mean, stddev);
      break;
    case DType::kBF16:
      init_slice_kernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x.data), n, slice,
                                                  seed, stream_id, mean, stddev);
      break;
    case DType::kFP16:
      init_slice_kernel<<<grid, 256, 0, stream>>>(static_cast<__half*>(x.data), n, slice, seed,
                                                  stream_id, mean, stddev);
      break;
    default:
      REPLAY_REQUIRE(false, std::string("init does not support ") + dtype_name(x.dtype));
  }
  REPLAY_LAUNCH_CHECK();
}

void init_uniform(const TensorView& x, uint64_t seed, uint64_t stream_id, float lo, float hi,
                  cudaStream_t stream) {
  launch_random<false>(x, seed, stream_id, lo, hi, stream);
}

void init_constant(const TensorView& x, float value, cudaStream_t stream) {
  const int64_t n = x.numel();
  REPLAY_REQUIRE(x.is_contiguous(), "init needs a contiguous tensor, got " + x.describe());
  if (n == 0) return;
  const int grid = grid_for(n);
  switch (x.dtype) {
    case DType::kFP32:
      init_constant_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(x.data), n, value);
      break;
    case DType::kBF16:
      init_constant_kernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x.data), n, value);
      break;
    case DType::kFP16:
      init_constant_kernel<<<grid, 256, 0, stream>>>(static_cast<__half*>(x.data), n, value);
      break;
    case DType::kINT32:
      REPLAY_REQUIRE(false, "init_constant on int32: use cudaMemsetAsync");
      break;
    default:
      REPLAY_REQUIRE(false, std::string("init does not support ") + dtype_name(x.dtype));
  }
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
