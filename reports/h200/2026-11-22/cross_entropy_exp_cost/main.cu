// Does the cross-entropy statistics kernel wait on its exps? 13e5598's kernel with the exp of each
// logit replaced (exp_term.cuh), in the suite's stream protocol.
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/cross_entropy.h"
using bf16 = __nv_bfloat16;
using namespace replay;
#define DECL(n) namespace replay { namespace n { \
  void cross_entropy_forward(float*, float*, float*, int32_t*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t); \
  void cross_entropy_stats(float*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t); } }
DECL(e0) DECL(e1) DECL(e2) DECL(e3) DECL(e4)
#define CK(x) REPLAY_CUDA_CHECK(x)
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
int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  using Fwd = void (*)(float*, float*, float*, int32_t*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t);
  using Sts = void (*)(float*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t);
  const Fwd fwd[] = {e0::cross_entropy_forward, e1::cross_entropy_forward, e2::cross_entropy_forward, e3::cross_entropy_forward, e4::cross_entropy_forward};
  const Sts sts[] = {e0::cross_entropy_stats, e1::cross_entropy_stats, e2::cross_entropy_stats, e3::cross_entropy_stats, e4::cross_entropy_stats};
  const char* names[] = {"ex2.approx every logit (13e5598)", "no exp (wrong results)", "polynomial 1 in 4", "polynomial 1 in 8", "polynomial 1 in 2"};
  struct Shape { const char* name; int64_t rows, width; };
  const Shape shapes[] = {{"gpt3_tp4 2048x12576", 2048, 12576}, {"llama_tp8 8192x16032", 8192, 16032}};
  for (const Shape& sh : shapes) {
    const int64_t M = sh.rows, V = sh.width; const CrossEntropyShape shape{M, V, 0};
    bf16* logits[3]; int32_t *targets, *cnt; float *stats, *rl, *mean;
    for (auto& l : logits) CK(cudaMalloc(&l, M * V * 2));
    CK(cudaMalloc(&targets, M * 4)); CK(cudaMalloc(&stats, 3 * M * 4)); CK(cudaMalloc(&rl, M * 4)); CK(cudaMalloc(&mean, 4)); CK(cudaMalloc(&cnt, 4));
    for (int k = 0; k < 3; ++k) filln_k<<<1024, 256, 0, s>>>(logits[k], M * V, 17 + k);
    filli_k<<<64, 256, 0, s>>>(targets, M, int(V));
    std::vector<float> ref(3 * M); float ref_mean = 0;
    for (int v = 0; v < 5; ++v) {
      fwd[v](stats, rl, mean, cnt, logits[0], targets, shape, s);
      CK(cudaStreamSynchronize(s));
      std::vector<float> st(3 * M); float mv;
      CK(cudaMemcpy(st.data(), stats, 3 * M * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&mv, mean, 4, cudaMemcpyDeviceToHost));
      if (v == 0) { ref = st; ref_mean = mv; }
      double d = 0; for (int64_t r = 0; r < M; ++r) d = std::max(d, std::fabs((double)st[M + r] - ref[M + r]) / ref[M + r]);
      printf("%s %-34s mean %.7f (ref %.7f), max sum rel diff %.3g\n", sh.name, names[v], mv, ref_mean, d);
    }
    for (int round = 0; round < 3; ++round)
      for (int v = 0; v < 5; ++v) {
        const float tf = stream_us(s, [&](int k) { fwd[v](stats, rl, mean, cnt, logits[k], targets, shape, s); });
        const float ts = stream_us(s, [&](int k) { sts[v](stats, logits[k], targets, shape, s); });
        printf("%s round %d %-34s forward %.2f us, statistics alone %.2f us\n", sh.name, round, names[v], tf, ts);
      }
    for (auto& l : logits) CK(cudaFree(l));
    CK(cudaFree(targets)); CK(cudaFree(stats)); CK(cudaFree(rl)); CK(cudaFree(mean)); CK(cudaFree(cnt));
  }
  return 0;
}
