// device_utils.cuh: small device-side building blocks shared by replay's kernels: ceil_div, 16-byte
// vector packs of bf16/fp32, and deterministic warp and block reductions (fixed order, no atomics).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace replay {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Sixteen bytes of T, loaded and stored with one 128-bit access. Pointers must be 16-byte aligned.
//
// Cache hints, for a kernel that reads one stream and writes another: streaming loads with plain
// stores are the slowest pairing, so a kernel pairs streaming loads with streaming stores, or
// L2-only loads with plain stores, whichever is faster for it, and the norm backward (norms.cu)
// keeps plain stores (measured: reports/RESULTS.md, Cache hints for the streaming kernels).
template <typename T>
struct alignas(16) Pack128 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];

  __device__ __forceinline__ static Pack128 load(const T* p) {
    Pack128 r;
    *reinterpret_cast<int4*>(r.v) = *reinterpret_cast<const int4*>(p);
    return r;
  }
  // Streaming load (ld.global.cs): read-once data, evicted first from L1 and L2.
  __device__ __forceinline__ static Pack128 load_cs(const T* p) {
    Pack128 r;
    *reinterpret_cast<int4*>(r.v) = __ldcs(reinterpret_cast<const int4*>(p));
    return r;
  }
  // Load cached in L2 only (ld.global.cg), with L2's normal eviction priority.
  __device__ __forceinline__ static Pack128 load_cg(const T* p) {
    Pack128 r;
    *reinterpret_cast<int4*>(r.v) = __ldcg(reinterpret_cast<const int4*>(p));
    return r;
  }
  __device__ __forceinline__ void store(T* p) const {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(v);
  }
  // Streaming store (st.global.cs): write-once data, evicted first.
  __device__ __forceinline__ void store_cs(T* p) const {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(v));
  }
};

using PackBF16 = Pack128<__nv_bfloat16>;  // 8 values
using PackF32 = Pack128<float>;           // 4 values

// Butterfly sum (float or double): every lane ends with the same value, and the order is fixed.
template <typename T>
__device__ __forceinline__ T warp_reduce_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block in a fixed order with one barrier; every thread receives the result. `scratch`
// holds 32 values and must not be in use by another call still in flight (a caller that sums twice
// in a row gives each call its own scratch). blockDim.x must be a multiple of 32.
template <typename T>
__device__ __forceinline__ T block_sum_once(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_reduce_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_reduce_sum(lane < warps ? scratch[lane] : T{0});
}

// block_sum_once with a barrier first, so that consecutive calls may share one scratch (the
// previous call's readers are done before it is written again). `scratch` holds 32 floats.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  __syncthreads();  // scratch may still be read by a previous call
  return block_sum_once(v, scratch);
}

__device__ __forceinline__ float block_reduce_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_reduce_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return warp_reduce_max(v);
}

}  // namespace replay
