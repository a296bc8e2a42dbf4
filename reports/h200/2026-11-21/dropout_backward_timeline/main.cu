// Dropout backward timeline: %globaltimer from thread (0,0) of every block; stream protocol of 24 calls over 3 sets.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <vector>
#include "common/check.h"
#include "common/kernels/dropout.h"
using bf16 = __nv_bfloat16;
namespace replay { extern unsigned long long* g_tl; extern int g_call; }
using namespace replay;
#define CK(x) REPLAY_CUDA_CHECK(x)
__global__ void fill_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 65536.0f - 0.5f);
  }
}
template <typename T> T* dalloc(size_t n) { void* p; CK(cudaMalloc(&p, n * sizeof(T) + 256)); return (T*)p; }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  cudaStream_t S; CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
  const int64_t M = argc > 1 ? atol(argv[1]) : 2048; const int C = argc > 2 ? atoi(argv[2]) : 12288;
  const size_t wsb = dropout_residual_backward_workspace_bytes(M, C);
  struct Set { bf16 *dout, *dx; float* db; PhiloxSlot* slot; void* ws; } set[3];
  for (int k = 0; k < 3; ++k) {
    set[k] = {dalloc<bf16>(M * C), dalloc<bf16>(M * C), dalloc<float>(C), dalloc<PhiloxSlot>(1), dalloc<char>(wsb)};
    fill_k<<<1024, 256, 0, S>>>(set[k].dout, M * C, 1 + k);
    PhiloxSlot h{1234u + k, 0}; CK(cudaMemcpy(set[k].slot, &h, sizeof(h), cudaMemcpyHostToDevice));
  }
  const int kPerBlock = 32, kBlocks = 160, kPerCall = kPerBlock * kBlocks + 16;
  unsigned long long* tl = dalloc<unsigned long long>(4 * kPerCall);
  CK(cudaMemset(tl, 0, 4 * kPerCall * 8)); g_tl = tl; CK(cudaStreamSynchronize(S));
  const int calls = 24; cudaGraph_t g; cudaGraphExec_t ex; g_call = 0;
  CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) { const Set& s = set[i % 3];
    dropout_residual_backward(s.dx, s.db, s.dout, M, C, 0.1f, RngArgs{s.slot, 0}, false, s.ws, wsb, S); }
  CK(cudaStreamEndCapture(S, &g)); CK(cudaGraphInstantiate(&ex, g, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); std::vector<double> t;
  for (int r = 0; r < 12; ++r) { cudaEventRecord(a, S); CK(cudaGraphLaunch(ex, S)); cudaEventRecord(b, S); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) t.push_back(1e3 * ms / calls); }
  std::printf("dropout backward %ld x %d, stream of %d calls: %.2f us a call\n", (long)M, C, calls, med(t));
  std::vector<unsigned long long> h(4 * kPerCall); CK(cudaMemcpy(h.data(), tl, h.size() * 8, cudaMemcpyDeviceToHost));
  int blocks = 0; for (int bI = 0; bI < kBlocks; ++bI) if (h[bI * kPerBlock + 1]) blocks = bI + 1;
  std::printf("blocks %d\n", blocks);
  for (int c = 0; c < 4; ++c) {
    const unsigned long long* H = h.data() + c * kPerCall;
    unsigned long long m = ~0ull; for (int bI = 0; bI < blocks; ++bI) m = std::min(m, H[bI * kPerBlock + 1]);
    const double t0 = (double)m;
    auto line = [&](const char* n, int e) { std::vector<double> v; for (int bI = 0; bI < blocks; ++bI) if (H[bI * kPerBlock + e]) v.push_back((H[bI * kPerBlock + e] - t0) / 1e3);
      if (v.empty()) return; std::sort(v.begin(), v.end()); std::printf("  %-22s min %7.2f  med %7.2f  max %7.2f us\n", n, v.front(), v[v.size()/2], v.back()); };
    std::printf("call %d (us from this call's first post-wait):\n", c);
    line("entry", 0); line("after grid wait", 1);
    for (int k = 0; k < 8; ++k) { char n[32]; std::snprintf(n, 32, "batch %d stored", k); line(n, 2 + k); }
    line("row loop end", 20); line("lanes' barrier", 21); line("partial written", 22);
    const unsigned long long* cs = H + kPerBlock * kBlocks;
    std::printf("  column_sums block 0: entry %.2f after wait %.2f done %.2f; last block: after wait %.2f done %.2f\n",
      ((double)cs[0] - t0) / 1e3, ((double)cs[1] - t0) / 1e3, ((double)cs[2] - t0) / 1e3, ((double)cs[4] - t0) / 1e3, ((double)cs[5] - t0) / 1e3);
    if (c < 3) { const unsigned long long* N = h.data() + (c + 1) * kPerCall; unsigned long long m2 = ~0ull; for (int bI = 0; bI < blocks; ++bI) m2 = std::min(m2, N[bI * kPerBlock + 1]);
      std::printf("  next call's first post-wait: %.2f\n", ((double)m2 - t0) / 1e3); }
  }
  return 0;
}
