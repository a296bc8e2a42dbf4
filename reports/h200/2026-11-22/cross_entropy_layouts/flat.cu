// Probe: is the cross-entropy statistics' gap to a plain read the layout (block a row) or the math?
// Flat grid-stride reads of the GPT-3 TP4 / Llama TP8 logits with (0) a trivial xor, (1) the
// statistics' math (bf16x2 max, rescale, ex2 terms), (2) the math without exps; with and without
// programmatic dependent launch; next to the tree's cross_entropy_stats and cross_entropy_forward.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/cross_entropy.h"
using bf16 = __nv_bfloat16;
using namespace replay;
#define CK(x) REPLAY_CUDA_CHECK(x)

__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { uint32_t r; asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
constexpr float kL2e = 1.4426950408889634f;

template <int U, bool PDL, int MODE>
__global__ void __launch_bounds__(256) flat_k(float* out, const uint4* __restrict__ in, long n) {
  if (PDL) { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory"); }
  long i = (long)blockIdx.x * blockDim.x * U + threadIdx.x; const long stride = (long)gridDim.x * blockDim.x * U;
  unsigned acc = 0; float m = -INFINITY, s = 0.f;
  for (; i < n; i += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * blockDim.x < n ? __ldcs(in + i + u * blockDim.x) : make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
    if (MODE == 0) {
#pragma unroll
      for (int u = 0; u < U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    } else {
      uint32_t p = 0xff80ff80u;
#pragma unroll
      for (int u = 0; u < U; ++u) p = max2(p, max2(max2(v[u].x, v[u].y), max2(v[u].z, v[u].w)));
      const float cm = fmaxf(__uint_as_float(p << 16), __uint_as_float(p & 0xffff0000u));
      const float mn = fmaxf(m, cm);
      if (mn != m) s *= ex2((m - mn) * kL2e);
      m = mn;
      const float ml = m * kL2e;
      float sums[4] = {0, 0, 0, 0};
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float x = __uint_as_float(k % 2 ? w[k / 2] & 0xffff0000u : w[k / 2] << 16);
          sums[k % 4] += MODE == 1 ? ex2(fmaf(x, kL2e, -ml)) : fmaf(x, kL2e, -ml);
        }
      }
      s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
    }
  }
  if (acc == 0x12345678u || s == -1.f || m == 12345.f) out[blockIdx.x] = s + m;
}

// Each warp owns one contiguous run of packs and walks it 32 * U packs a step.
template <int U, int MODE>
__global__ void __launch_bounds__(256) warprun_k(float* out, const uint4* __restrict__ in, long n, long per_warp) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32; const int lane = threadIdx.x % 32;
  const long begin = warp * per_warp, end = min(n, begin + per_warp);
  float m = -INFINITY, s = 0.f;
  for (long i = begin + lane; i < end; i += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * 32 < end ? __ldcs(in + i + u * 32) : make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
    uint32_t p = 0xff80ff80u;
#pragma unroll
    for (int u = 0; u < U; ++u) p = max2(p, max2(max2(v[u].x, v[u].y), max2(v[u].z, v[u].w)));
    const float cm = fmaxf(__uint_as_float(p << 16), __uint_as_float(p & 0xffff0000u));
    const float mn = fmaxf(m, cm);
    if (mn != m) s *= ex2((m - mn) * kL2e);
    m = mn;
    const float ml = m * kL2e;
    float sums[4] = {0, 0, 0, 0};
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float x = __uint_as_float(k % 2 ? w[k / 2] & 0xffff0000u : w[k / 2] << 16);
        sums[k % 4] += MODE == 1 ? ex2(fmaf(x, kL2e, -ml)) : fmaf(x, kL2e, -ml);
      }
    }
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
  if (s == -1.f || m == 12345.f) out[blockIdx.x] = s + m;
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
void pdl_launch(K kernel, int grid, int block, cudaStream_t s, A... args) {
  cudaLaunchAttribute attr{}; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization; attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{}; c.gridDim = grid; c.blockDim = block; c.stream = s; c.attrs = &attr; c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, kernel, args...));
}
int main() {
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); setvbuf(stdout, nullptr, _IONBF, 0);
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Shape { const char* name; long rows, width; };
  const Shape shapes[] = {{"gpt3_tp4 2048x12576", 2048, 12576}, {"llama_tp8 8192x16032", 8192, 16032}};
  float* part; CK(cudaMalloc(&part, 1 << 22));
  for (int round = 0; round < 2; ++round)
  for (const Shape& sh : shapes) {
    const long M = sh.rows, V = sh.width, n = M * V / 8; const CrossEntropyShape shape{M, V, 0};
    bf16* logits[3]; int32_t* targets; float *stats, *rl, *mean; int32_t* cnt;
    for (auto& l : logits) CK(cudaMalloc(&l, M * V * 2));
    CK(cudaMalloc(&targets, M * 4)); CK(cudaMalloc(&stats, 3 * M * 4)); CK(cudaMalloc(&rl, M * 4)); CK(cudaMalloc(&mean, 4)); CK(cudaMalloc(&cnt, 4));
    for (int k = 0; k < 3; ++k) filln_k<<<1024, 256, 0, s>>>(logits[k], M * V, 17 + k);
    filli_k<<<64, 256, 0, s>>>(targets, M, int(V));
    CK(cudaStreamSynchronize(s));
    auto L = [&](int k) { return reinterpret_cast<const uint4*>(logits[k]); };
    printf("== round %d %s (%.1f MB)\n", round, sh.name, M * V * 2 / 1e6);
    printf("tree forward (stats + mean)     %.2f us\n", stream_us(s, [&](int k) { cross_entropy_forward(stats, rl, mean, cnt, logits[k], targets, shape, s); }));
    printf("tree stats                      %.2f us\n", stream_us(s, [&](int k) { cross_entropy_stats(stats, logits[k], targets, shape, s); }));
    for (int bps : {4, 8, 16}) {
      const int grid = sms * bps;
      printf("grid %5d x 256 U4: xor %.2f | xor+pdl %.2f | math %.2f | math+pdl %.2f | math-noexp+pdl %.2f us\n", grid,
        stream_us(s, [&](int k) { flat_k<4, false, 0><<<grid, 256, 0, s>>>(part, L(k), n); }),
        stream_us(s, [&](int k) { pdl_launch(flat_k<4, true, 0>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { flat_k<4, false, 1><<<grid, 256, 0, s>>>(part, L(k), n); }),
        stream_us(s, [&](int k) { pdl_launch(flat_k<4, true, 1>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { pdl_launch(flat_k<4, true, 2>, grid, 256, s, part, L(k), n); }));
      printf("grid %5d x 256 U8: xor+pdl %.2f | math+pdl %.2f us\n", grid,
        stream_us(s, [&](int k) { pdl_launch(flat_k<8, true, 0>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { pdl_launch(flat_k<8, true, 1>, grid, 256, s, part, L(k), n); }));
    }
    for (int wps : {32, 48, 64}) {  // warps an SM
      const int grid = sms * wps / 8; const long warps = (long)grid * 8; const long per = (n + warps - 1) / warps;
      printf("warp runs %d warps/SM (%ld packs a warp): U4 math %.2f | U8 math %.2f | U4 noexp %.2f us\n", wps, per,
        stream_us(s, [&](int k) { pdl_launch(warprun_k<4, 1>, grid, 256, s, part, L(k), n, per); }),
        stream_us(s, [&](int k) { pdl_launch(warprun_k<8, 1>, grid, 256, s, part, L(k), n, per); }),
        stream_us(s, [&](int k) { pdl_launch(warprun_k<4, 2>, grid, 256, s, part, L(k), n, per); }));
    }
    for (auto& l : logits) CK(cudaFree(l));
    CK(cudaFree(targets)); CK(cudaFree(stats)); CK(cudaFree(rl)); CK(cudaFree(mean)); CK(cudaFree(cnt));
  }
  CK(cudaGetLastError());
  return 0;
}
