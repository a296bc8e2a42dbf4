// elementwise.cu: the UNet model's glue kernels (elementwise.h). Each thread owns 16-byte packs of
// what it writes (grid-stride loops); nothing reduces across threads, so every result is bitwise
// deterministic.
#include "workloads/unet/elementwise.h"

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
constexpr int kPack = 8;

__device__ __forceinline__ float f32(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float f32(bf16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ int64_t first() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}
__device__ __forceinline__ int64_t stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(work, kThreads), 132 * 16)));
}

void check(DType dtype, int64_t n, std::initializer_list<const void*> ptrs, const char* op) {
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16,
                 std::string(op) + ": dtype must be fp16 or bf16");
  REPLAY_REQUIRE(
      n >= 0 && n % kPack == 0,
      std::string(op) + ": element count must be a multiple of 8, got " + std::to_string(n));
  for (const void* p : ptrs)
    REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                   std::string(op) + ": pointers must be 16-byte aligned");
}

template <typename T>
__global__ void add_kernel(T* y, const T* a, const T* b, int64_t packs) {
  for (int64_t k = first(); k < packs; k += stride()) {
    const Pack128<T> x = Pack128<T>::load(a + k * kPack), z = Pack128<T>::load(b + k * kPack);
    Pack128<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) o.v[j] = from_f32<T>(f32(x.v[j]) + f32(z.v[j]));
    o.store(y + k * kPack);
  }
}

template <typename T>
__global__ void silu_forward_kernel(T* y, const T* x, int64_t packs) {
  for (int64_t k = first(); k < packs; k += stride()) {
    const Pack128<T> a = Pack128<T>::load(x + k * kPack);
    Pack128<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float v = f32(a.v[j]);
      o.v[j] = from_f32<T>(v * sigmoid(v));
    }
    o.store(y + k * kPack);
  }
}

template <typename T>
__global__ void silu_backward_kernel(T* dx, const T* dy, const T* x, int64_t packs,
                                     bool accumulate) {
  for (int64_t k = first(); k < packs; k += stride()) {
    const Pack128<T> a = Pack128<T>::load(x + k * kPack), d = Pack128<T>::load(dy + k * kPack);
    Pack128<T> prev;
    if (accumulate) prev = Pack128<T>::load(dx + k * kPack);
    Pack128<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float v = f32(a.v[j]), s = sigmoid(v);
      float g = f32(d.v[j]) * s * (1.0f + v * (1.0f - s));
      if (accumulate) g += f32(prev.v[j]);
      o.v[j] = from_f32<T>(g);
    }
    o.store(dx + k * kPack);
  }
}

template <typename T>
__global__ void channel_bias_forward_kernel(T* y, const T* h, const T* t, int64_t pixels,
                                            int64_t cpacks, int64_t packs) {
  for (int64_t k = first(); k < packs; k += stride()) {
    const int64_t cp = k % cpacks;
    const int64_t n = k / cpacks / pixels;
    const Pack128<T> a = Pack128<T>::load(h + k * kPack);
    const Pack128<T> b = Pack128<T>::load(t + (n * cpacks + cp) * kPack);
    Pack128<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) o.v[j] = from_f32<T>(f32(a.v[j]) + f32(b.v[j]));
    o.store(y + k * kPack);
  }
}

constexpr int64_t kChunk = 64;  // pixels per partial sum

// partial[n, chunk, c] = sum of dy[n, p, c] over the chunk's pixels, in order.
template <typename T>
__global__ void channel_bias_partial_kernel(float* partial, const T* dy, int64_t pixels,
                                            int64_t channels, int64_t chunks, int64_t total) {
  for (int64_t k = first(); k < total; k += stride()) {
    const int64_t c = k % channels, nc = k / channels;  // nc = n * chunks + chunk
    const int64_t n = nc / chunks, chunk = nc % chunks;
    const int64_t p0 = chunk * kChunk, p1 = p0 + kChunk < pixels ? p0 + kChunk : pixels;
    const T* p = dy + (n * pixels) * channels + c;
    float sum = 0.0f;
    for (int64_t i = p0; i < p1; ++i) sum += f32(p[i * channels]);
    partial[k] = sum;
  }
}

template <typename T>
__global__ void channel_bias_sum_kernel(T* dt, const float* partial, int64_t channels,
                                        int64_t chunks, int64_t total) {
  for (int64_t k = first(); k < total; k += stride()) {
    const int64_t c = k % channels, n = k / channels;
    const float* p = partial + n * chunks * channels + c;
    float sum = 0.0f;
    for (int64_t i = 0; i < chunks; ++i) sum += p[i * channels];
    dt[k] = from_f32<T>(sum);
  }
}

template <typename T>
__global__ void to_float_kernel(float* out, const T* in, int64_t n) {
  for (int64_t k = first(); k < n; k += stride()) out[k] = f32(in[k]);
}

template <typename T>
__global__ void poison_kernel(T* x, const int64_t* iteration, int64_t at) {
  if (*iteration == at) x[0] = from_f32<T>(__int_as_float(0x7f800000));
}

#define REPLAY_DISPATCH(dtype, KERNEL, ...) \
  do {                                      \
    if ((dtype) == DType::kFP16) {          \
      using T = __half;                     \
      KERNEL;                               \
    } else {                                \
      using T = bf16;                       \
      KERNEL;                               \
    }                                       \
  } while (0)

}  // namespace

void add(DType dtype, void* y, const void* a, const void* b, int64_t n, cudaStream_t stream) {
  check(dtype, n, {y, a, b}, "add");
  if (n == 0) return;
  const int64_t packs = n / kPack;
  REPLAY_DISPATCH(
      dtype, (add_kernel<T><<<grid_for(packs), kThreads, 0, stream>>>(
                 static_cast<T*>(y), static_cast<const T*>(a), static_cast<const T*>(b), packs)));
  REPLAY_LAUNCH_CHECK();
}

void add_into(DType dtype, void* y, const void* x, int64_t n, cudaStream_t stream) {
  add(dtype, y, y, x, n, stream);
}

void silu_forward(DType dtype, void* y, const void* x, int64_t n, cudaStream_t stream) {
  check(dtype, n, {y, x}, "silu_forward");
  if (n == 0) return;
  const int64_t packs = n / kPack;
  REPLAY_DISPATCH(dtype, (silu_forward_kernel<T><<<grid_for(packs), kThreads, 0, stream>>>(
                             static_cast<T*>(y), static_cast<const T*>(x), packs)));
  REPLAY_LAUNCH_CHECK();
}

void silu_backward(DType dtype, void* dx, const void* dy, const void* x, int64_t n, bool accumulate,
                   cudaStream_t stream) {
  check(dtype, n, {dx, dy, x}, "silu_backward");
  if (n == 0) return;
  const int64_t packs = n / kPack;
  REPLAY_DISPATCH(dtype, (silu_backward_kernel<T><<<grid_for(packs), kThreads, 0, stream>>>(
                             static_cast<T*>(dx), static_cast<const T*>(dy),
                             static_cast<const T*>(x), packs, accumulate)));
  REPLAY_LAUNCH_CHECK();
}

void channel_bias_forward(DType dtype, void* y, const void* h, const void* t, int64_t batch,
                          int64_t pixels, int64_t channels, cudaStream_t stream) {
  check(dtype, channels, {y, h, t}, "channel_bias_forward");
  REPLAY_REQUIRE(batch >= 1 && pixels >= 1, "channel_bias_forward: empty tensor");
  const int64_t cpacks = channels / kPack, packs = batch * pixels * cpacks;
  REPLAY_DISPATCH(dtype, (channel_bias_forward_kernel<T><<<grid_for(packs), kThreads, 0, stream>>>(
                             static_cast<T*>(y), static_cast<const T*>(h), static_cast<const T*>(t),
                             pixels, cpacks, packs)));
  REPLAY_LAUNCH_CHECK();
}

size_t channel_bias_backward_workspace_bytes(int64_t batch, int64_t pixels, int64_t channels) {
  return static_cast<size_t>(batch * ceil_div<int64_t>(pixels, kChunk) * channels) * sizeof(float);
}

void channel_bias_backward(DType dtype, void* dt, const void* dy, int64_t batch, int64_t pixels,
                           int64_t channels, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  check(dtype, channels, {dt, dy}, "channel_bias_backward");
  REPLAY_REQUIRE(batch >= 1 && pixels >= 1, "channel_bias_backward: empty tensor");
  REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= channel_bias_backward_workspace_bytes(
                                                                batch, pixels, channels),
                 "channel_bias_backward: workspace too small");
  const int64_t chunks = ceil_div<int64_t>(pixels, kChunk);
  const int64_t partials = batch * chunks * channels, total = batch * channels;
  auto* partial = static_cast<float*>(workspace);
  REPLAY_DISPATCH(dtype,
                  (channel_bias_partial_kernel<T><<<grid_for(partials), kThreads, 0, stream>>>(
                      partial, static_cast<const T*>(dy), pixels, channels, chunks, partials)));
  REPLAY_LAUNCH_CHECK();
  REPLAY_DISPATCH(dtype, (channel_bias_sum_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(
                             static_cast<T*>(dt), partial, channels, chunks, total)));
  REPLAY_LAUNCH_CHECK();
}

void to_float(DType dtype, float* out, const void* in, int64_t n, cudaStream_t stream) {
  check(dtype, 0, {}, "to_float");
  if (n == 0) return;
  REPLAY_DISPATCH(dtype, (to_float_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(
                             out, static_cast<const T*>(in), n)));
  REPLAY_LAUNCH_CHECK();
}

void poison_at(DType dtype, void* x, const int64_t* iteration, int64_t at, cudaStream_t stream) {
  check(dtype, 0, {}, "poison_at");
  REPLAY_DISPATCH(dtype,
                  (poison_kernel<T><<<1, 1, 0, stream>>>(static_cast<T*>(x), iteration, at)));
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::unet
