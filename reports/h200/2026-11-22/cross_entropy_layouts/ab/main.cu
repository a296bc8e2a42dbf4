// A/B harness: the cross-entropy forward (statistics + mean) of 14bf607 ("base") against the tree's
// ("new"), and the variants in new_tu.cu, in the suite's stream protocol (graphs of 24 calls over 3 input sets).
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/cross_entropy.h"
using bf16 = __nv_bfloat16;
namespace replay { namespace base {
void cross_entropy_forward(float*, float*, float*, int32_t*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t);
} }
namespace replay {
int exp_variants();
const char* exp_name(int);
void exp_forward(int v, float*, float*, float*, int32_t*, const bf16*, const int32_t*, const CrossEntropyShape&, cudaStream_t);
}
using namespace replay;
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
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct Shape { const char* name; int64_t rows, width; };
  const Shape shapes[] = {{"gpt3_tp4 2048x12576", 2048, 12576}, {"llama_tp8 8192x16032", 8192, 16032}, {"odd 1000x12571", 1000, 12571}, {"odd 5000x1001", 5000, 1001}, {"gpt3 full vocab 2048x50304", 2048, 50304}, {"few rows 64x50304", 64, 50304}, {"long odd 2048x8197", 2048, 8197}};
  int fails = 0; setvbuf(stdout, nullptr, _IONBF, 0);
  for (const Shape& sh : shapes) {
    const int64_t M = sh.rows, V = sh.width; const CrossEntropyShape shape{M, V, 0};
    bf16* logits[3]; int32_t* targets; float *stats[2], *rl[2], *mean[2]; int32_t* cnt[2];
    for (auto& l : logits) { CK(cudaMalloc(&l, M * V * 2 + 64)); }
    CK(cudaMalloc(&targets, M * 4));
    for (int k = 0; k < 2; ++k) { CK(cudaMalloc(&stats[k], 3 * M * 4)); CK(cudaMalloc(&rl[k], M * 4)); CK(cudaMalloc(&mean[k], 4)); CK(cudaMalloc(&cnt[k], 4)); }
    for (int k = 0; k < 3; ++k) filln_k<<<1024, 256, 0, s>>>(logits[k], M * V + 32, 17 + k);
    filli_k<<<64, 256, 0, s>>>(targets, M, int(V));
    CK(cudaStreamSynchronize(s));
    // Check: the two versions give the same bits on every set (and on a misaligned start for the odd shape).
    for (int k = 0; k < 3; ++k) {
      const bf16* in = logits[k] + (V % 8 ? 3 : 0);
      base::cross_entropy_forward(stats[0], rl[0], mean[0], cnt[0], in, targets, shape, s);
      cross_entropy_forward(stats[1], rl[1], mean[1], cnt[1], in, targets, shape, s);
      CK(cudaStreamSynchronize(s));
      std::vector<float> a(3 * M), b(3 * M), ra(M), rb(M); float ma, mb;
      CK(cudaMemcpy(a.data(), stats[0], 3 * M * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), stats[1], 3 * M * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ra.data(), rl[0], M * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(rb.data(), rl[1], M * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&ma, mean[0], 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&mb, mean[1], 4, cudaMemcpyDeviceToHost));
      double dmax = 0, dsum = 0, dt = 0, dl = 0;
      for (int64_t r = 0; r < M; ++r) { dmax = std::max(dmax, (double)std::fabs(a[r] - b[r])); dsum = std::max(dsum, std::fabs((double)a[M + r] - b[M + r]) / a[M + r]); dt = std::max(dt, (double)std::fabs(a[2 * M + r] - b[2 * M + r])); dl = std::max(dl, (double)std::fabs(ra[r] - rb[r])); }
      const bool same = memcmp(a.data(), b.data(), a.size() * 4) == 0 && memcmp(ra.data(), rb.data(), ra.size() * 4) == 0 && memcmp(&ma, &mb, 4) == 0;
      const bool ok = dmax == 0 && dt == 0 && dsum < 1e-5 && dl < 1e-4 && std::fabs(ma - mb) < 1e-5;
      if (!ok) ++fails;
      printf("%s set %d: mean %.7f vs %.7f; max diff %g, sum rel diff %g, target diff %g, row loss diff %g: %s%s\n", sh.name, k, ma, mb, dmax, dsum, dt, dl, ok ? "ok" : "WRONG", same ? " (bit-identical)" : "");
    }
    if (V % 8 == 0) {
      for (int v = 0; v < exp_variants(); ++v) {
        base::cross_entropy_forward(stats[0], rl[0], mean[0], cnt[0], logits[0], targets, shape, s);
        exp_forward(v, stats[1], rl[1], mean[1], cnt[1], logits[0], targets, shape, s);
        CK(cudaStreamSynchronize(s));
        std::vector<float> a(3 * M), b(3 * M); float ma, mb;
        CK(cudaMemcpy(a.data(), stats[0], 3 * M * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), stats[1], 3 * M * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&ma, mean[0], 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&mb, mean[1], 4, cudaMemcpyDeviceToHost));
        double dmax = 0, dsum = 0, dt = 0;
        for (int64_t r = 0; r < M; ++r) { dmax = std::max(dmax, (double)std::fabs(a[r] - b[r])); dsum = std::max(dsum, std::fabs((double)a[M + r] - b[M + r]) / a[M + r]); dt = std::max(dt, (double)std::fabs(a[2 * M + r] - b[2 * M + r])); }
        const bool ok = dmax == 0 && dt == 0 && dsum < 1e-5 && std::fabs(ma - mb) < 1e-5;
        if (!ok) ++fails;
        printf("  %s vs base: max diff %g, sum rel diff %g, target diff %g, mean %.7f vs %.7f %s\n", exp_name(v), dmax, dsum, dt, ma, mb, ok ? "ok" : "WRONG");
      }
    }
    const double bytes = 2.0 * M * V + 4.0 * M;
    for (int round = 0; round < 3; ++round) {
      const float tb = stream_us(s, [&](int k) { base::cross_entropy_forward(stats[0], rl[0], mean[0], cnt[0], logits[k], targets, shape, s); });
      const float tn = stream_us(s, [&](int k) { cross_entropy_forward(stats[1], rl[1], mean[1], cnt[1], logits[k], targets, shape, s); });
      const float ts = stream_us(s, [&](int k) { cross_entropy_stats(stats[1], logits[k], targets, shape, s); });
      printf("%s round %d: base %.2f us (%.0f GB/s)  new %.2f us (%.0f GB/s)  new stats alone %.2f us\n", sh.name, round, tb, bytes / tb * 1e-3, tn, bytes / tn * 1e-3, ts);
      if (V % 8 == 0) {
        for (int v = 0; v < exp_variants(); ++v) {
          const float tx = stream_us(s, [&](int k) { exp_forward(v, stats[1], rl[1], mean[1], cnt[1], logits[k], targets, shape, s); });
          const float txs = stream_us(s, [&](int k) { exp_forward(v, stats[1], rl[1], nullptr, nullptr, logits[k], targets, shape, s); });
          printf("    %-22s %.2f us (%.0f GB/s), stats alone %.2f us\n", exp_name(v), tx, bytes / tx * 1e-3, txs);
        }
      }
    }
    for (auto& l : logits) CK(cudaFree(l));
    CK(cudaFree(targets));
    for (int k = 0; k < 2; ++k) { CK(cudaFree(stats[k])); CK(cudaFree(rl[k])); CK(cudaFree(mean[k])); CK(cudaFree(cnt[k])); }
  }
  printf("%s\n", fails ? "FAILED: outputs differ" : "all outputs agree");
  return fails ? 1 : 0;
}
