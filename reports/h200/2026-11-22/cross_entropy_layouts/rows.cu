// Probe: cross-entropy statistics with few threads a row looping over it (one wave of rows, the
// grid-stride read's pattern), against the tree's kernel; the mean as a one-block dependent or by
// the last block to finish (a ticket).
#include "rows_kernels.cuh"

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
