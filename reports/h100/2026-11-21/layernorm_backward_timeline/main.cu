// LayerNorm backward timeline: %globaltimer per block (thread 0) at entry, after the grid wait, per row (data landed,
// dx written), at loop end, around the cluster sum, at exit; column_sums block 0 and last block. Stream protocol.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/norms.h"
using bf16 = __nv_bfloat16;
namespace replay { extern unsigned long long* g_tl; extern int g_call; extern int g_variant_host; void set_variant(int); }
using namespace replay;
#define CK(x) REPLAY_CUDA_CHECK(x)
__global__ void fill_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 65536.0f - 0.5f);
  }
}
__global__ void fillf_k(float* p, size_t n, float a, float b) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = a + b * (i % 7);
}
template <typename T> T* dalloc(size_t n) { void* p; CK(cudaMalloc(&p, n * sizeof(T) + 256)); return (T*)p; }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  cudaStream_t S; CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
  const int64_t M = argc > 1 ? atol(argv[1]) : 2048; const int C = argc > 2 ? atoi(argv[2]) : 12288;
  const int variant = argc > 3 ? atoi(argv[3]) : 0; set_variant(variant); std::printf("variant %d\n", variant);
  const size_t wsb = layernorm_backward_workspace_bytes(M, C);
  struct Set { bf16 *dout, *x, *dx; float *mean, *rstd, *ws; } set[3];
  bf16* gamma = dalloc<bf16>(C); float* dg = dalloc<float>(C); float* db = dalloc<float>(C);
  fill_k<<<256, 256, 0, S>>>(gamma, C, 7);
  for (int k = 0; k < 3; ++k) {
    set[k] = {dalloc<bf16>(M * C), dalloc<bf16>(M * C), dalloc<bf16>(M * C), dalloc<float>(M), dalloc<float>(M), (float*)dalloc<char>(wsb)};
    fill_k<<<1024, 256, 0, S>>>(set[k].dout, M * C, 1 + k); fill_k<<<1024, 256, 0, S>>>(set[k].x, M * C, 11 + k);
    fillf_k<<<64, 256, 0, S>>>(set[k].mean, M, 0.01f, 0.001f); fillf_k<<<64, 256, 0, S>>>(set[k].rstd, M, 3.0f, 0.1f);
  }
  const int kPerBlock = 48, kBlocks = 160, kPerCall = kPerBlock * kBlocks + 16;
  unsigned long long* tl = dalloc<unsigned long long>(4 * kPerCall);
  CK(cudaMemset(tl, 0, 4 * kPerCall * 8));
  g_tl = tl;
  CK(cudaStreamSynchronize(S));
  const int calls = 24; cudaGraph_t g; cudaGraphExec_t ex;
  g_call = 0;
  CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) { const Set& s = set[i % 3];
    layernorm_backward(s.dx, dg, db, s.dout, s.x, gamma, s.mean, s.rstd, M, C, false, false, s.ws, wsb, S); }
  CK(cudaStreamEndCapture(S, &g)); CK(cudaGraphInstantiate(&ex, g, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<double> t;
  for (int r = 0; r < 12; ++r) { cudaEventRecord(a, S); CK(cudaGraphLaunch(ex, S)); cudaEventRecord(b, S); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) t.push_back(1e3 * ms / calls); }
  std::printf("LayerNorm backward %ld x %d, stream of %d calls: %.2f us a call (median of %zu replays)\n", (long)M, C, calls, med(t), t.size());
  {
    auto fnv = [](const void* d, size_t n) { const unsigned char* b = (const unsigned char*)d; unsigned long long x = 1469598103934665603ull; for (size_t i = 0; i < n; ++i) x = (x ^ b[i]) * 1099511628211ull; return x; };
    std::vector<unsigned short> hx(M * C); std::vector<float> hg(C), hb(C);
    CK(cudaMemcpy(hx.data(), set[0].dx, M * C * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hg.data(), dg, C * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hb.data(), db, C * 4, cudaMemcpyDeviceToHost));
    std::printf("hashes: dx %016llx dgamma %016llx dbeta %016llx\n", fnv(hx.data(), hx.size() * 2), fnv(hg.data(), C * 4), fnv(hb.data(), C * 4));
  }
  std::vector<unsigned long long> h(4 * kPerCall);
  CK(cudaMemcpy(h.data(), tl, h.size() * 8, cudaMemcpyDeviceToHost));
  int blocks = 0; for (int bI = 0; bI < kBlocks; ++bI) if (h[bI * kPerBlock + 1]) blocks = bI + 1;
  const int rows = (int)((M + blocks - 1) / blocks);
  std::printf("blocks %d, rows a block %d\n", blocks, rows);
  // resolution check
  std::vector<unsigned long long> all; for (int bI = 0; bI < blocks; ++bI) for (int e = 0; e < 48; ++e) if (h[bI * kPerBlock + e]) all.push_back(h[bI * kPerBlock + e]);
  std::sort(all.begin(), all.end()); unsigned long long mind = ~0ull; for (size_t i = 1; i < all.size(); ++i) if (all[i] != all[i-1]) mind = std::min(mind, all[i] - all[i-1]);
  std::printf("smallest nonzero timestamp step: %llu ns\n", mind);
  const double t0 = [&] { unsigned long long m = ~0ull; for (int bI = 0; bI < blocks; ++bI) m = std::min(m, h[bI * kPerBlock + 1]); return (double)m; }();
  for (int c = 0; c < 4; ++c) {
    const unsigned long long* H = h.data() + c * kPerCall;
    auto ev = [&](int e) { std::vector<double> v; for (int bI = 0; bI < blocks; ++bI) if (H[bI * kPerBlock + e]) v.push_back((H[bI * kPerBlock + e] - t0) / 1e3); std::sort(v.begin(), v.end()); return v; };
    auto line = [&](const char* n, int e) { auto v = ev(e); if (v.empty()) return; std::printf("  %-22s min %8.2f  med %8.2f  max %8.2f us\n", n, v.front(), v[v.size()/2], v.back()); };
    std::printf("call %d (times from call 0's first post-wait, us):\n", c);
    line("entry", 0); line("after grid wait", 1);
    for (int k = 0; k < rows && k < 20; ++k) { char n1[32], n2[32]; std::snprintf(n1, 32, "row %d landed", k); std::snprintf(n2, 32, "row %d dx issued", k);
      if (k < 2 || k >= rows - 2) { line(n1, 2 + 2 * k); line(n2, 3 + 2 * k); } }
    line("loop end", 44); line("cluster sums in smem", 45); line("after cluster sync", 43); line("partial written", 46); line("exit", 47);
    const unsigned long long* cs = H + kPerBlock * kBlocks;
    std::printf("  column_sums block 0: entry %.2f  after wait %.2f  done %.2f;  last block: after wait %.2f  done %.2f\n",
      (cs[0] - t0) / 1e3, (cs[1] - t0) / 1e3, (cs[2] - t0) / 1e3, (cs[4] - t0) / 1e3, (cs[5] - t0) / 1e3);
    std::vector<double> per; for (int bI = 0; bI < blocks; ++bI) per.push_back((H[bI * kPerBlock + 44] - H[bI * kPerBlock + 1]) / 1e3);
    std::sort(per.begin(), per.end());
    std::vector<double> period; for (int bI = 0; bI < blocks; ++bI) period.push_back((double)(H[bI * kPerBlock + 3 + 2 * (rows - 2)] - H[bI * kPerBlock + 3]) / 1e3 / (rows - 2));
    std::sort(period.begin(), period.end());
    std::printf("  block wait->loop end: min %.2f med %.2f max %.2f us; row period (rows 1..%d): min %.3f med %.3f max %.3f us\n",
      per.front(), per[per.size()/2], per.back(), rows - 2, period.front(), period[period.size()/2], period.back());
  }
  // per-block detail for the last call: which blocks are slow
  const unsigned long long* H = h.data() + 3 * kPerCall;
  std::printf("call 3 per block (block: landed0, loop end, exit) us:\n");
  for (int bI = 0; bI < blocks; ++bI) std::printf("%d:%.1f/%.1f/%.1f%s", bI, (H[bI*kPerBlock+2]-t0)/1e3, (H[bI*kPerBlock+44]-t0)/1e3, (H[bI*kPerBlock+47]-t0)/1e3, bI % 8 == 7 ? "\n" : "  ");
  std::printf("\n");
  return 0;
}
