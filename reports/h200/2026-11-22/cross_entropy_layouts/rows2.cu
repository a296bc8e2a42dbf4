// Probe: what the row layouts' block barrier and reduction cost: rows.cu's kernel with each warp
// writing its own (max, sum) and no barrier, blocks that walk rows persistently, and flat.cu's
// grid-stride read with one block reduction at its end; next to the tree's statistics and forward.
#include "rows_kernels.cuh"

// Warps write their own (m, s) (no block barrier); PERSIST: G blocks walk rows b, b + G, ...
template <int U, bool NOBAR, bool PERSIST>
__global__ void __launch_bounds__(256) rows2_k(float* __restrict__ stats, float2* __restrict__ wpart,
    const bf16* __restrict__ logits, const int32_t* __restrict__ targets, long rows, long width) {
  __shared__ float2 wst[8];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const int t = threadIdx.x, T = blockDim.x, lane = t % 32, warp = t / 32;
  const long packs = width / 8;
  for (long r = blockIdx.x; r < rows; r += PERSIST ? gridDim.x : rows) {
    const uint4* body = reinterpret_cast<const uint4*>(logits + r * width);
    float m = -INFINITY, s = 0.f;
    for (long base = t; base < packs; base += long(U) * T) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) { const long p = base + u * T; x[u] = p < packs ? __ldcs(body + p) : make_uint4(kNI, kNI, kNI, kNI); }
      add_chunk(x, m, s);
    }
    if (NOBAR) {
      const float2 ws = wmerge(m, s);
      if (lane == 0) wpart[r * (T / 32) + warp] = ws;
      continue;
    }
    const float2 rs = block_stats(m, s, wst);
    if (t == 0) { stats[r] = rs.x; stats[rows + r] = rs.y; }
    if (PERSIST) __syncthreads();
  }
}
// Flat grid-stride math, then one block reduction and one write a block.
template <int U>
__global__ void __launch_bounds__(256) flatred_k(float2* out, const uint4* __restrict__ in, long n) {
  __shared__ float2 wst[8];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  long i = (long)blockIdx.x * blockDim.x * U + threadIdx.x; const long stride = (long)gridDim.x * blockDim.x * U;
  float m = -INFINITY, s = 0.f;
  for (; i < n; i += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * blockDim.x < n ? __ldcs(in + i + u * blockDim.x) : make_uint4(kNI, kNI, kNI, kNI);
    add_chunk(v, m, s);
  }
  const float2 b = block_stats(m, s, wst);
  if (threadIdx.x == 0) out[blockIdx.x] = b;
}

int main() {
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); setvbuf(stdout, nullptr, _IONBF, 0);
  struct Shape { const char* name; long rows, width; };
  const Shape shapes[] = {{"gpt3_tp4 2048x12576", 2048, 12576}, {"llama_tp8 8192x16032", 8192, 16032}, };
  float2* wp; CK(cudaMalloc(&wp, 8 << 20)); unsigned* ticket; CK(cudaMalloc(&ticket, 4)); CK(cudaMemset(ticket, 0, 4));
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
    vs.push_back({"tree stats", [&](int k, int o) { cross_entropy_stats(st[o], lg[k], tg, shape, s); }});
    vs.push_back({"rows T128 U2 (no mean)", [&](int k, int o) { pdl(rows_k<2, 0>, int(M), 128, s, st[o], rl[o], mn[o], cn[o], ticket, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
    vs.push_back({"rows T128 U2 nobar", [&](int k, int o) { pdl(rows2_k<2, true, false>, int(M), 128, s, st[o], wp, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
    vs.push_back({"rows T256 U4 nobar", [&](int k, int o) { pdl(rows2_k<4, true, false>, int(M), 256, s, st[o], wp, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
    vs.push_back({"rows T256 U4 bar", [&](int k, int o) { pdl(rows2_k<4, false, false>, int(M), 256, s, st[o], wp, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
    for (int g : {4, 6, 8}) {
      char* n = new char[64]; snprintf(n, 64, "persist %d/SM T256 U4 bar", g);
      vs.push_back({n, [&, g](int k, int o) { pdl(rows2_k<4, false, true>, 132 * g, 256, s, st[o], wp, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
      char* n2 = new char[64]; snprintf(n2, 64, "persist %d/SM T256 U4 nobar", g);
      vs.push_back({n2, [&, g](int k, int o) { pdl(rows2_k<4, true, true>, 132 * g, 256, s, st[o], wp, (const bf16*)lg[k], (const int32_t*)tg, M, W); }});
    }
    for (int g : {4, 8, 16}) {
      char* n = new char[64]; snprintf(n, 64, "flat+blockred %d/SM U4", g);
      vs.push_back({n, [&, g](int k, int o) { pdl(flatred_k<4>, 132 * g, 256, s, wp, (const uint4*)lg[k], M * W / 8); }});
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
      const bool checkable = strstr(v.name, "forward") || strstr(v.name, "+ mean") || strstr(v.name, "ticket");
      const bool ok = !checkable || dm == 0 && dt == 0 && ds < 1e-5 && std::fabs(ma - mb) < 1e-5 * std::fabs(ma) && ca == cb;
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
