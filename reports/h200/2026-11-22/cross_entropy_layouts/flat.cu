// Probe: is the cross-entropy statistics' gap to a plain read the layout (block a row) or the math?
// Flat grid-stride reads of the GPT-3 TP4 / Llama TP8 logits with (0) a trivial xor, (1) the
// statistics' math (bf16x2 max, rescale, ex2 terms), (2) the math without exps; with and without
// programmatic dependent launch; next to the tree's cross_entropy_stats and cross_entropy_forward.
#include "probe.cuh"

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
      add_chunk<U, MODE == 1>(v, m, s);
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
    add_chunk<U, MODE == 1>(v, m, s);
  }
  if (s == -1.f || m == 12345.f) out[blockIdx.x] = s + m;
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
        stream_us(s, [&](int k) { pdl(flat_k<4, true, 0>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { flat_k<4, false, 1><<<grid, 256, 0, s>>>(part, L(k), n); }),
        stream_us(s, [&](int k) { pdl(flat_k<4, true, 1>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { pdl(flat_k<4, true, 2>, grid, 256, s, part, L(k), n); }));
      printf("grid %5d x 256 U8: xor+pdl %.2f | math+pdl %.2f us\n", grid,
        stream_us(s, [&](int k) { pdl(flat_k<8, true, 0>, grid, 256, s, part, L(k), n); }),
        stream_us(s, [&](int k) { pdl(flat_k<8, true, 1>, grid, 256, s, part, L(k), n); }));
    }
    for (int wps : {32, 48, 64}) {  // warps an SM
      const int grid = sms * wps / 8; const long warps = (long)grid * 8; const long per = (n + warps - 1) / warps;
      printf("warp runs %d warps/SM (%ld packs a warp): U4 math %.2f | U8 math %.2f | U4 noexp %.2f us\n", wps, per,
        stream_us(s, [&](int k) { pdl(warprun_k<4, 1>, grid, 256, s, part, L(k), n, per); }),
        stream_us(s, [&](int k) { pdl(warprun_k<8, 1>, grid, 256, s, part, L(k), n, per); }),
        stream_us(s, [&](int k) { pdl(warprun_k<4, 2>, grid, 256, s, part, L(k), n, per); }));
    }
    for (auto& l : logits) CK(cudaFree(l));
    CK(cudaFree(targets)); CK(cudaFree(stats)); CK(cudaFree(rl)); CK(cudaFree(mean)); CK(cudaFree(cnt));
  }
  CK(cudaGetLastError());
  return 0;
}
