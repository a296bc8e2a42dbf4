// pointwise.cu: GEGLU, nearest-neighbour 2x upsampling and skip concatenation (pointwise.h).
//
// Every kernel moves 16-byte packs (8 values of 16 bits): a thread owns one pack of the tensor it
// writes (GEGLU's output or input gradient, the upsampled input's pack, the concatenation's pack)
// and walks the tensor with a grid-stride loop. Consecutive threads take consecutive packs of a
// row, so every load and store is coalesced whatever the widths are. Nothing reduces across
// threads: each output element is computed by exactly one thread in a fixed order, so the results
// are bitwise deterministic.
#include "workloads/unet/pointwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"

namespace replay::unet {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kPack = 8;  // 16-bit values in a 16-byte pack

__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_float(bf16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
using Pack = Pack128<T>;

__device__ __forceinline__ int64_t thread_index() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The exact GELU and its derivative's pieces: Phi(b) and b * phi(b).
__device__ __forceinline__ float normal_cdf(float b) {
  return 0.5f * (1.0f + erff(b * 0.70710678118654752f));
}
__device__ __forceinline__ float normal_pdf(float b) {
  return 0.39894228040143268f * expf(-0.5f * b * b);
}

// ---------------------------------------------------------------------------------------------------
// GEGLU.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    geglu_forward_kernel(T* out, const T* in, int64_t rows, int F) {
  const int packs = F / kPack;
  const int64_t total = rows * packs;
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t r = k / packs;
    const int f0 = static_cast<int>(k - r * packs) * kPack;
    const T* row = in + r * 2 * F;
    const Pack<T> a = Pack<T>::load(row + f0), b = Pack<T>::load(row + F + f0);
    Pack<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float g = to_float(b.v[j]);
      o.v[j] = from_float<T>(to_float(a.v[j]) * (g * normal_cdf(g)));
    }
    o.store(out + r * F + f0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    geglu_backward_kernel(T* din, const T* dout, const T* in, int64_t rows, int F) {
  const int packs = F / kPack;
  const int64_t total = rows * packs;
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t r = k / packs;
    const int f0 = static_cast<int>(k - r * packs) * kPack;
    const T* row = in + r * 2 * F;
    // All loads before the stores: din may alias in.
    const Pack<T> a = Pack<T>::load(row + f0), b = Pack<T>::load(row + F + f0);
    const Pack<T> d = Pack<T>::load(dout + r * F + f0);
    Pack<T> da, db;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float g = to_float(b.v[j]), x = to_float(a.v[j]), dy = to_float(d.v[j]);
      const float cdf = normal_cdf(g);
      da.v[j] = from_float<T>(dy * (g * cdf));
      db.v[j] = from_float<T>(dy * x * (cdf + g * normal_pdf(g)));
    }
    da.store(din + r * 2 * F + f0);
    db.store(din + r * 2 * F + F + f0);
  }
}

// ---------------------------------------------------------------------------------------------------
// Upsampling. Pack k of x is (n, h, w, channel pack cp) with the pack index fastest.

__global__ void __launch_bounds__(kThreads)
    upsample_forward_kernel(uint4* y, const uint4* x, int64_t W, int64_t packs, int64_t total) {
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t cp = k % packs;
    const int64_t pixel = k / packs;  // (n * H + h) * W + w
    const int64_t w = pixel % W;
    const int64_t nh = pixel / W;  // n * H + h
    const uint4 v = x[k];
    const int64_t row0 = (2 * nh) * (2 * W) + 2 * w;  // y pixel (n, 2h, 2w)
    y[row0 * packs + cp] = v;
    y[(row0 + 1) * packs + cp] = v;
    y[(row0 + 2 * W) * packs + cp] = v;
    y[(row0 + 2 * W + 1) * packs + cp] = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    upsample_backward_kernel(T* dx, const T* dy, int64_t W, int64_t packs, int64_t total) {
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t cp = k % packs;
    const int64_t pixel = k / packs;
    const int64_t w = pixel % W;
    const int64_t nh = pixel / W;
    const int64_t row0 = (2 * nh) * (2 * W) + 2 * w;
    const int64_t C = packs * kPack;
    const Pack<T> d00 = Pack<T>::load(dy + row0 * C + cp * kPack);
    const Pack<T> d01 = Pack<T>::load(dy + (row0 + 1) * C + cp * kPack);
    const Pack<T> d10 = Pack<T>::load(dy + (row0 + 2 * W) * C + cp * kPack);
    const Pack<T> d11 = Pack<T>::load(dy + (row0 + 2 * W + 1) * C + cp * kPack);
    Pack<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float s = to_float(d00.v[j]);
      s += to_float(d01.v[j]);
      s += to_float(d10.v[j]);
      s += to_float(d11.v[j]);
      o.v[j] = from_float<T>(s);
    }
    o.store(dx + k * kPack);
  }
}

// ---------------------------------------------------------------------------------------------------
// Concatenation. Pack k of y is (row, pack p of Ca / 8 + Cb / 8).

__global__ void __launch_bounds__(kThreads)
    concat_forward_kernel(uint4* y, const uint4* a, int64_t pa, const uint4* b, int64_t pb,
                          int64_t total) {
  const int64_t py = pa + pb;
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t r = k / py;
    const int64_t p = k - r * py;
    y[k] = p < pa ? a[r * pa + p] : b[r * pb + (p - pa)];
  }
}

template <typename T>
__device__ __forceinline__ void store_grad(T* dst, const Pack<T>& g, bool accumulate) {
  if (!accumulate) {
    g.store(dst);
    return;
  }
  const Pack<T> old = Pack<T>::load(dst);
  Pack<T> o;
#pragma unroll
  for (int j = 0; j < kPack; ++j) o.v[j] = from_float<T>(to_float(old.v[j]) + to_float(g.v[j]));
  o.store(dst);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    concat_backward_kernel(T* da, T* db, const T* dy, int64_t pa, int64_t pb, bool acc_a,
                           bool acc_b, int64_t total) {
  const int64_t py = pa + pb;
  for (int64_t k = thread_index(); k < total; k += grid_stride()) {
    const int64_t r = k / py;
    const int64_t p = k - r * py;
    const Pack<T> g = Pack<T>::load(dy + k * kPack);
    if (p < pa) {
      store_grad(da + (r * pa + p) * kPack, g, acc_a);
    } else {
      store_grad(db + (r * pb + (p - pa)) * kPack, g, acc_b);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Launch helpers.

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 1 << 30));
}

void check_storage(DType dtype, const char* op) {
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16,
                 std::string(op) + ": storage must be fp16 or bf16, got " + dtype_name(dtype));
}

void check_width(int64_t c, const char* op, const char* what) {
  REPLAY_REQUIRE(c >= kPack && c % kPack == 0, std::string(op) + ": " + what +
                                                   " must be a positive multiple of 8, got " +
                                                   std::to_string(c));
}

void check_aligned(std::initializer_list<const void*> pointers, const char* op) {
  for (const void* p : pointers)
    REPLAY_REQUIRE(p != nullptr && aligned16(p),
                   std::string(op) + ": every pointer must be non-null and 16-byte aligned");
}

}  // namespace

void geglu_forward(DType dtype, void* out, const void* in, int64_t rows, int F,
                   cudaStream_t stream) {
  check_storage(dtype, "geglu_forward");
  check_width(F, "geglu_forward", "F");
  REPLAY_REQUIRE(rows >= 1, "geglu_forward: rows must be positive");
  check_aligned({out, in}, "geglu_forward");
  const unsigned grid = grid_for(rows * (F / kPack));
  if (dtype == DType::kFP16) {
    geglu_forward_kernel<__half><<<grid, kThreads, 0, stream>>>(
        static_cast<__half*>(out), static_cast<const __half*>(in), rows, F);
  } else {
    geglu_forward_kernel<bf16><<<grid, kThreads, 0, stream>>>(
        static_cast<bf16*>(out), static_cast<const bf16*>(in), rows, F);
  }
  REPLAY_LAUNCH_CHECK();
}

void geglu_backward(DType dtype, void* din, const void* dout, const void* in, int64_t rows, int F,
                    cudaStream_t stream) {
  check_storage(dtype, "geglu_backward");
  check_width(F, "geglu_backward", "F");
  REPLAY_REQUIRE(rows >= 1, "geglu_backward: rows must be positive");
  check_aligned({din, dout, in}, "geglu_backward");
  const unsigned grid = grid_for(rows * (F / kPack));
  if (dtype == DType::kFP16) {
    geglu_backward_kernel<__half>
        <<<grid, kThreads, 0, stream>>>(static_cast<__half*>(din), static_cast<const __half*>(dout),
                                        static_cast<const __half*>(in), rows, F);
  } else {
    geglu_backward_kernel<bf16>
        <<<grid, kThreads, 0, stream>>>(static_cast<bf16*>(din), static_cast<const bf16*>(dout),
                                        static_cast<const bf16*>(in), rows, F);
  }
  REPLAY_LAUNCH_CHECK();
}

void upsample_nearest2x_forward(DType dtype, void* y, const void* x, const UpsampleShape& s,
                                cudaStream_t stream) {
  check_storage(dtype, "upsample_nearest2x_forward");
  check_width(s.channels, "upsample_nearest2x_forward", "channels");
  REPLAY_REQUIRE(s.batch >= 1 && s.height >= 1 && s.width >= 1,
                 "upsample_nearest2x_forward: N, H and W must be positive");
  check_aligned({y, x}, "upsample_nearest2x_forward");
  const int64_t packs = s.channels / kPack;
  const int64_t total = s.batch * s.height * s.width * packs;
  upsample_forward_kernel<<<grid_for(total), kThreads, 0, stream>>>(
      static_cast<uint4*>(y), static_cast<const uint4*>(x), s.width, packs, total);
  REPLAY_LAUNCH_CHECK();
}

void upsample_nearest2x_backward(DType dtype, void* dx, const void* dy, const UpsampleShape& s,
                                 cudaStream_t stream) {
  check_storage(dtype, "upsample_nearest2x_backward");
  check_width(s.channels, "upsample_nearest2x_backward", "channels");
  REPLAY_REQUIRE(s.batch >= 1 && s.height >= 1 && s.width >= 1,
                 "upsample_nearest2x_backward: N, H and W must be positive");
  check_aligned({dx, dy}, "upsample_nearest2x_backward");
  const int64_t packs = s.channels / kPack;
  const int64_t total = s.batch * s.height * s.width * packs;
  if (dtype == DType::kFP16) {
    upsample_backward_kernel<__half><<<grid_for(total), kThreads, 0, stream>>>(
        static_cast<__half*>(dx), static_cast<const __half*>(dy), s.width, packs, total);
  } else {
    upsample_backward_kernel<bf16><<<grid_for(total), kThreads, 0, stream>>>(
        static_cast<bf16*>(dx), static_cast<const bf16*>(dy), s.width, packs, total);
  }
  REPLAY_LAUNCH_CHECK();
}

void concat_channels_forward(DType dtype, void* y, const void* a, int Ca, const void* b, int Cb,
                             int64_t rows, cudaStream_t stream) {
  check_storage(dtype, "concat_channels_forward");
  check_width(Ca, "concat_channels_forward", "Ca");
  check_width(Cb, "concat_channels_forward", "Cb");
  REPLAY_REQUIRE(rows >= 1, "concat_channels_forward: rows must be positive");
  check_aligned({y, a, b}, "concat_channels_forward");
  const int64_t pa = Ca / kPack, pb = Cb / kPack;
  const int64_t total = rows * (pa + pb);
  concat_forward_kernel<<<grid_for(total), kThreads, 0, stream>>>(
      static_cast<uint4*>(y), static_cast<const uint4*>(a), pa, static_cast<const uint4*>(b), pb,
      total);
  REPLAY_LAUNCH_CHECK();
}

void concat_channels_backward(DType dtype, void* da, void* db, const void* dy, int Ca, int Cb,
                              int64_t rows, bool accumulate_da, bool accumulate_db,
                              cudaStream_t stream) {
  check_storage(dtype, "concat_channels_backward");
  check_width(Ca, "concat_channels_backward", "Ca");
  check_width(Cb, "concat_channels_backward", "Cb");
  REPLAY_REQUIRE(rows >= 1, "concat_channels_backward: rows must be positive");
  check_aligned({da, db, dy}, "concat_channels_backward");
  const int64_t pa = Ca / kPack, pb = Cb / kPack;
  const int64_t total = rows * (pa + pb);
  if (dtype == DType::kFP16) {
    concat_backward_kernel<__half><<<grid_for(total), kThreads, 0, stream>>>(
        static_cast<__half*>(da), static_cast<__half*>(db), static_cast<const __half*>(dy), pa, pb,
        accumulate_da, accumulate_db, total);
  } else {
    concat_backward_kernel<bf16><<<grid_for(total), kThreads, 0, stream>>>(
        static_cast<bf16*>(da), static_cast<bf16*>(db), static_cast<const bf16*>(dy), pa, pb,
        accumulate_da, accumulate_db, total);
  }
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::unet
