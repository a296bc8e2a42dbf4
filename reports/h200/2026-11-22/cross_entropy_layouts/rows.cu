// Probe: cross-entropy statistics with few threads a row looping over it (one wave of rows, the
// grid-stride read's pattern), against the tree's kernel; the mean as a one-block dependent or by
// the last block to finish (a ticket).
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
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
// MEAN: 0 none (row losses only), 1 last block sums the row losses (ticket)
template <int U, int MEAN>
__global__ void __launch_bounds__(256) rows_k(float* __restrict__ stats, float* __restrict__ row_loss, float* mean, int* count, unsigned* ticket,
    const bf16* __restrict__ logits, const int32_t* __restrict__ targets, long rows, long width) {
  __shared__ float2 wst[8]; __shared__ float tl; __shared__ bool last; __shared__ float scratch[32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const long r = blockIdx.x; const int t = threadIdx.x, T = blockDim.x, lane = t % 32, warp = t / 32;
  const uint4* body = reinterpret_cast<const uint4*>(logits + r * width);  // aligned rows only (probe)
  const long packs = width / 8;
  const int32_t target = targets[r];
  const long local = target;  // vocab_start 0
  const bool held = target >= 0 && local < width;
  const long tp = held ? local / 8 : -1; const int tk = int(local % 8);
  float m = -INFINITY, s = 0.f;
  for (long base = t; base < packs; base += long(U) * T) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { const long p = base + u * T; x[u] = p < packs ? __ldcs(body + p) : make_uint4(kNI, kNI, kNI, kNI); }
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * T == tp) tl = pack_el(x[u], tk);
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
      for (int k = 0; k < 8; ++k) sums[k % 4] += ex2(fmaf(__uint_as_float(k % 2 ? w[k / 2] & 0xffff0000u : w[k / 2] << 16), kL2e, -ml));
    }
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
  const float2 ws = wmerge(m, s);
  if (lane == 0) wst[warp] = ws;
  __syncthreads();
  if (warp == 0) {
    const float2 w = lane < T / 32 ? wst[lane] : make_float2(-INFINITY, 0.f);
    const float2 rs = wmerge(w.x, w.y);
    if (lane == 0) {
      const float tlg = held ? tl : 0.f;
      stats[r] = rs.x; stats[rows + r] = rs.y; stats[2 * rows + r] = tlg;
      row_loss[r] = target < 0 ? 0.f : (rs.x - tlg) + logf(rs.y);
      if (MEAN == 1) { __threadfence(); last = atomicAdd(ticket, 1u) == unsigned(rows - 1); }
    }
  }
  if (MEAN == 0) return;
  __syncthreads();
  if (!last) return;
  __threadfence();
  float sum = 0.f, counted = 0.f;
  for (long b = t; b < rows; b += 4L * T) {
    float l[4], c[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { const long q = b + u * T; const bool in = q < rows; const bool cnt = in && targets[q] >= 0; l[u] = in ? __ldcg(row_loss + q) : 0.f; c[u] = cnt ? 1.f : 0.f; }
    sum += (l[0] + l[1]) + (l[2] + l[3]); counted += (c[0] + c[1]) + (c[2] + c[3]);
  }
  sum = block_reduce_sum(sum, scratch); counted = block_reduce_sum(counted, scratch);
  if (t == 0) { *count = int(counted); *mean = counted > 0 ? sum / counted : 0.f; *ticket = 0u; }
}
// The one-block dependent mean (as the tree's, 512 threads).
__global__ void __launch_bounds__(512) mean_k(float* mean, int* count, const float* row_loss, const int32_t* targets, long rows) {
  __shared__ float scratch[32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const int T = 512; float sum = 0.f, counted = 0.f;
  for (long b = threadIdx.x; b < rows; b += 4L * T) {
    float l[4], c[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { const long q = b + u * T; const bool in = q < rows; const bool cnt = in && targets[q] >= 0; l[u] = in ? row_loss[q] : 0.f; c[u] = cnt ? 1.f : 0.f; }
    sum += (l[0] + l[1]) + (l[2] + l[3]); counted += (c[0] + c[1]) + (c[2] + c[3]);
  }
  sum = block_reduce_sum(sum, scratch); counted = block_reduce_sum(counted, scratch);
  if (threadIdx.x == 0) { *count = int(counted); *mean = counted > 0 ? sum / counted : 0.f; }
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
int main() {
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); setvbuf(stdout, nullptr, _IONBF, 0);
  struct Shape { const char* name; long rows, width; };
  const Shape shapes[] = {{"gpt3_tp4 2048x12576", 2048, 12576}, {"llama_tp8 8192x16032", 8192, 16032}, {"gpt3 full 2048x50304", 2048, 50304}, {"few 64x50304", 64, 50304}};
  unsigned* ticket; CK(cudaMalloc(&ticket, 4)); CK(cudaMemset(ticket, 0, 4));
  int bad = 0;
  for (int round = 0; round < 3; ++round)
  for (const Shape& sh : shapes) {
    const long M = sh.rows, W = sh.width; const CrossEntropyShape shape{M, W, 0};
    bf16* lg[3]; int32_t* tg; float *st[2], *rl[2], *mn[2]; int* cn[2];
    for (auto& l : lg) CK(cudaMalloc(&l, M * W * 2));
    CK(cudaMalloc(&tg, M * 4));
    for (int k = 0; k < 2; ++k) { CK(cudaMalloc(&st[k], 3 * M * 4)); CK(cudaMalloc(&rl[k], M * 4)); CK(cudaMalloc(&mn[k], 4)); CK(cudaMalloc(&cn[k], 4)); }
    for (int k = 0; k < 3; ++k) filln_k<<<1024, 256, 0, s>>>(lg[k], M * W, 17 + k);
    filli_k<<<64, 256, 0, s>>>(tg, M, int(W));
    CK(cudaStreamSynchronize(s));
    printf("== round %d %s\n", round, sh.name);
    struct V { const char* name; std::function<void(int, int)> f; };  // (set, output index)
    std::vector<V> vs;
    vs.push_back({"tree forward", [&](int k, int o) { cross_entropy_forward(st[o], rl[o], mn[o], cn[o], lg[k], tg, shape, s); }});
    for (int T : {64, 128, 256}) {
      vs.push_back({nullptr, nullptr});
      char* n1 = new char[64]; snprintf(n1, 64, "rows T%d U4 + mean", T);
      vs.back() = {n1, [&, T](int k, int o) { pdl(rows_k<4, 0>, int(M), T, s, st[o], rl[o], mn[o], cn[o], ticket, (const bf16*)lg[k], (const int32_t*)tg, M, W); pdl(mean_k, 1, 512, s, mn[o], cn[o], (const float*)rl[o], (const int32_t*)tg, M); }};
      char* n2 = new char[64]; snprintf(n2, 64, "rows T%d U4 ticket", T);
      vs.push_back({n2, [&, T](int k, int o) { pdl(rows_k<4, 1>, int(M), T, s, st[o], rl[o], mn[o], cn[o], ticket, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
      char* n3 = new char[64]; snprintf(n3, 64, "rows T%d U2 + mean", T);
      vs.push_back({n3, [&, T](int k, int o) { pdl(rows_k<2, 0>, int(M), T, s, st[o], rl[o], mn[o], cn[o], ticket, (const bf16*)lg[k], (const int32_t*)tg, M, W); pdl(mean_k, 1, 512, s, mn[o], cn[o], (const float*)rl[o], (const int32_t*)tg, M); }});
      char* n4 = new char[64]; snprintf(n4, 64, "rows T%d U8 + mean", T);
      vs.push_back({n4, [&, T](int k, int o) { pdl(rows_k<8, 0>, int(M), T, s, st[o], rl[o], mn[o], cn[o], ticket, (const bf16*)lg[k], (const int32_t*)tg, M, W); pdl(mean_k, 1, 512, s, mn[o], cn[o], (const float*)rl[o], (const int32_t*)tg, M); }});
    }
    for (auto& v : vs) {
      // check against the tree on set 0
      cross_entropy_forward(st[0], rl[0], mn[0], cn[0], lg[0], tg, shape, s);
      v.f(0, 1); CK(cudaStreamSynchronize(s));
      std::vector<float> a(3 * M), b(3 * M); float ma, mb; int ca, cb;
      CK(cudaMemcpy(a.data(), st[0], 12 * M, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), st[1], 12 * M, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&ma, mn[0], 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&mb, mn[1], 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&ca, cn[0], 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&cb, cn[1], 4, cudaMemcpyDeviceToHost));
      double dm = 0, ds = 0, dt = 0;
      for (long r = 0; r < M; ++r) { dm = std::max(dm, (double)std::fabs(a[r] - b[r])); ds = std::max(ds, std::fabs((double)a[M + r] - b[M + r]) / a[M + r]); dt = std::max(dt, (double)std::fabs(a[2 * M + r] - b[2 * M + r])); }
      const bool ok = dm == 0 && dt == 0 && ds < 1e-5 && std::fabs(ma - mb) < 1e-5 * std::fabs(ma) && ca == cb;
      bad += !ok;
      const float us = stream_us(s, [&](int k) { v.f(k, 1); });
      printf("  %-24s %7.2f us   (mean %.6f vs %.6f, count %d/%d, max diff %g, sum rel %.1e, target diff %g) %s\n", v.name, us, mb, ma, cb, ca, dm, ds, dt, ok ? "ok" : "WRONG");
    }
    for (auto& l : lg) CK(cudaFree(l));
    CK(cudaFree(tg)); for (int k = 0; k < 2; ++k) { CK(cudaFree(st[k])); CK(cudaFree(rl[k])); CK(cudaFree(mn[k])); CK(cudaFree(cn[k])); }
  }
  CK(cudaGetLastError());
  printf("%d wrong\n", bad);
  return bad != 0;
}
