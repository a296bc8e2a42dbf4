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
// Adds one chunk (U packs a thread) to the running (m, s): the chunk's max on bf16 pairs, one
// rescale of s, then a term per logit into four partial sums. EXP false leaves out the exps (the
// results are then wrong; for timing only).
template <int U, bool EXP = true>
__device__ __forceinline__ void add_chunk(const uint4 (&x)[U], float& m, float& s) {
  uint32_t pr = kNI;
#pragma unroll
  for (int u = 0; u < U; ++u) pr = max2(pr, max2(max2(x[u].x, x[u].y), max2(x[u].z, x[u].w)));
  const float cm = fmaxf(__uint_as_float(pr << 16), __uint_as_float(pr & 0xffff0000u));
  const float mn = fmaxf(m, cm);
  if (mn != m) s *= ex2((m - mn) * kL2e);
  m = mn;
  const float ml = m == -INFINITY ? 0.f : m * kL2e;
  float sums[4] = {0, 0, 0, 0};
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t w[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float t = fmaf(__uint_as_float(k % 2 ? w[k / 2] & 0xffff0000u : w[k / 2] << 16), kL2e, -ml);
      sums[k % 4] += EXP ? ex2(t) : t;
    }
  }
  s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
}
// The block's (max, sum) from its threads' (m, s), through `wst` (one float2 a warp). All threads
// call it; the result is meaningful in warp 0 only.
__device__ __forceinline__ float2 block_stats(float m, float s, float2* wst) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float2 ws = wmerge(m, s);
  if (lane == 0) wst[warp] = ws;
  __syncthreads();
  if (warp != 0) return ws;
  const float2 w = lane < blockDim.x / 32 ? wst[lane] : make_float2(-INFINITY, 0.f);
  return wmerge(w.x, w.y);
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
