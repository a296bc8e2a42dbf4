// activations.cu: SwiGLU and GeLU kernels (see activations.h). One 16-byte pack (8 values) per
// thread: memory-bound, so the only goals are full-width loads and stores and enough threads in
// flight. Streaming loads pair with streaming stores (device_utils.cuh, Pack128), because streaming
// loads with plain stores are the slowest pairing (measured: reports/RESULTS.md, Cache hints for
// the streaming kernels). GeLU follows the same pairing unmeasured: no workload runs it (the GPT-3
// MLP takes GeLU from its GEMM's epilogue) and no benchmark times it.
#include "common/kernels/activations.h"

#include <cstdint>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + __expf(-x));
}

__global__ void swiglu_forward_kernel(bf16* __restrict__ out, const bf16* __restrict__ in,
                                      int64_t packs, int F) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  const int fp = F / 8;
  const int64_t m = k / fp;
  const int f = static_cast<int>(k - m * fp) * 8;
  const bf16* row = in + m * 2 * F;
  const PackBF16 gate = PackBF16::load_cs(row + f), up = PackBF16::load_cs(row + F + f);
  PackBF16 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float g = __bfloat162float(gate.v[j]);
    o.v[j] = __float2bfloat16_rn(g * sigmoid(g) * __bfloat162float(up.v[j]));
  }
  o.store_cs(out + m * F + f);
}

__global__ void swiglu_backward_kernel(bf16* __restrict__ din, const bf16* __restrict__ dout,
                                       const bf16* __restrict__ in, int64_t packs, int F) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  const int fp = F / 8;
  const int64_t m = k / fp;
  const int f = static_cast<int>(k - m * fp) * 8;
  const int64_t row = m * 2 * F;
  const PackBF16 gate = PackBF16::load_cs(in + row + f), up = PackBF16::load_cs(in + row + F + f);
  const PackBF16 d = PackBF16::load_cs(dout + m * F + f);
  PackBF16 dgate, dup;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float g = __bfloat162float(gate.v[j]), u = __bfloat162float(up.v[j]);
    const float dy = __bfloat162float(d.v[j]);
    const float s = sigmoid(g);
    dgate.v[j] = __float2bfloat16_rn(dy * u * s * (1.0f + g * (1.0f - s)));
    dup.v[j] = __float2bfloat16_rn(dy * g * s);
  }
  dgate.store_cs(din + row + f);
  dup.store_cs(din + row + F + f);
}

__global__ void gelu_forward_kernel(bf16* out, const bf16* x, int64_t packs) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  const PackBF16 xv = PackBF16::load_cs(x + k * 8);
  PackBF16 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float v = __bfloat162float(xv.v[j]);
    const float t = tanhf(kSqrt2OverPi * (v + kGeluCoeff * v * v * v));
    o.v[j] = __float2bfloat16_rn(0.5f * v * (1.0f + t));
  }
  o.store_cs(out + k * 8);
}

__global__ void gelu_backward_kernel(bf16* dx, const bf16* dout, const bf16* __restrict__ x,
                                     int64_t packs) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  const PackBF16 xv = PackBF16::load_cs(x + k * 8), d = PackBF16::load_cs(dout + k * 8);
  PackBF16 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float v = __bfloat162float(xv.v[j]);
    const float t = tanhf(kSqrt2OverPi * (v + kGeluCoeff * v * v * v));
    const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v * v);
    const float grad = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dinner;
    o.v[j] = __float2bfloat16_rn(__bfloat162float(d.v[j]) * grad);
  }
  o.store_cs(dx + k * 8);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

unsigned grid_for(int64_t packs) {
  const int64_t blocks = ceil_div<int64_t>(packs, kThreads);
  REPLAY_REQUIRE(blocks <= INT32_MAX, "tensor too large for a 1-D grid");
  return static_cast<unsigned>(blocks);
}

void check_swiglu(int64_t M, int F) {
  REPLAY_REQUIRE(M >= 1, "swiglu needs at least one row");
  REPLAY_REQUIRE(F >= 8 && F % 8 == 0, "swiglu width F must be a positive multiple of 8");
}

}  // namespace

void swiglu_forward(bf16* out, const bf16* in, int64_t M, int F, cudaStream_t stream) {
  check_swiglu(M, F);
  REPLAY_REQUIRE(aligned16(out) && aligned16(in), "swiglu tensors must be 16-byte aligned");
  const int64_t packs = M * (F / 8);
  launch_dependent(swiglu_forward_kernel, grid_for(packs), kThreads, stream, out, in, packs, F);
  REPLAY_LAUNCH_CHECK();
}

void swiglu_backward(bf16* din, const bf16* dout, const bf16* in, int64_t M, int F,
                     cudaStream_t stream) {
  check_swiglu(M, F);
  REPLAY_REQUIRE(aligned16(din) && aligned16(dout) && aligned16(in),
                 "swiglu tensors must be 16-byte aligned");
  const int64_t packs = M * (F / 8);
  launch_dependent(swiglu_backward_kernel, grid_for(packs), kThreads, stream, din, dout, in, packs,
                   F);
  REPLAY_LAUNCH_CHECK();
}

void gelu_forward(bf16* out, const bf16* x, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 8 && n % 8 == 0, "gelu element count must be a positive multiple of 8");
  REPLAY_REQUIRE(aligned16(out) && aligned16(x), "gelu tensors must be 16-byte aligned");
  launch_dependent(gelu_forward_kernel, grid_for(n / 8), kThreads, stream, out, x, n / 8);
  REPLAY_LAUNCH_CHECK();
}

void gelu_backward(bf16* dx, const bf16* dout, const bf16* x, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 8 && n % 8 == 0, "gelu element count must be a positive multiple of 8");
  REPLAY_REQUIRE(aligned16(dx) && aligned16(dout) && aligned16(x),
                 "gelu tensors must be 16-byte aligned");
  launch_dependent(gelu_backward_kernel, grid_for(n / 8), kThreads, stream, dx, dout, x, n / 8);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
