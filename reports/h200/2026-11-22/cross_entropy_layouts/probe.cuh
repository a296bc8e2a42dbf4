// probe.cuh: what the layout probes share: the statistics' per-logit helpers, input fills and the
// suite's stream protocol (graphs of 24 calls over 3 input sets, median of 12 launches).
#pragma once
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/cross_entropy.h"
using bf16 = __nv_bfloat16;
using namespace replay;
#define CK(x) REPLAY_CUDA_CHECK(x)

__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { uint32_t r; asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
constexpr float kL2e = 1.4426950408889634f;
constexpr uint32_t kNI = 0xff80ff80u;
__device__ __forceinline__ float2 wmerge(float m, float s) {
  const float mx = warp_reduce_max(m);
  return make_float2(mx, warp_reduce_sum(mx == -INFINITY ? 0.0f : s * ex2((m - mx) * kL2e)));
}
__device__ __forceinline__ float pack_el(uint4 w, int k) {
  const uint32_t word = k < 4 ? (k < 2 ? w.x : w.y) : (k < 6 ? w.z : w.w);
  return __uint_as_float(k % 2 ? word & 0xffff0000u : word << 16);
}
__global__ void filln_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float a = 0; for (int j = 0; j < 4; ++j) { uint32_t h = ((uint32_t)i * 4 + j) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15; a += (h & 0xffff) / 65536.0f - 0.5f; }
    p[i] = __float2bfloat16(a * 3.0f);
  }
}
__global__ void filli_k(int32_t* p, size_t n, int mod) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = (int32_t)((i * 7919) % mod);
}
float stream_us(cudaStream_t s, const std::function<void(int)>& call) {
  const int calls = 24, sets = 3; cudaGraph_t g; cudaGraphExec_t ex;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) call(i % sets);
  CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ex, g, 0));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < 15; ++r) { CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ex, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (r >= 3) t.push_back(ms * 1e3f / calls); }
  std::sort(t.begin(), t.end()); CK(cudaGraphExecDestroy(ex)); CK(cudaGraphDestroy(g)); return t[t.size() / 2];
}
template <typename K, typename... A>
void pdl(K kernel, int grid, int block, cudaStream_t s, A... args) {
  cudaLaunchAttribute attr{}; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization; attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{}; c.gridDim = grid; c.blockDim = block; c.stream = s; c.attrs = &attr; c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, kernel, args...));
}
