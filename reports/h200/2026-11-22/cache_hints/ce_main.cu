// Cross-entropy forward (statistics + mean) and backward at the GPT-3 175B TP4 shard (2048 x 12576), in the suite's
// stream protocol (graphs of 24 calls over 3 input sets, median of 12 launches); prints us a call and result hashes.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/cross_entropy.h"
#include "stream.cuh"
using bf16 = __nv_bfloat16;
using namespace replay;
__global__ void filln_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float a = 0; for (int j = 0; j < 4; ++j) { uint32_t h = ((uint32_t)i * 4 + j) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15; a += (h & 0xffff) / 65536.0f - 0.5f; }
    p[i] = __float2bfloat16(a * 3.0f);
  }
}
__global__ void filli_k(int32_t* p, size_t n, int mod) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = (int32_t)((i * 7919) % mod);
}
int main() {
  cudaStream_t S; CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
  const int64_t M = 2048, V = 12576; const CrossEntropyShape shape{M, V, 0};
  bf16 *logits[3], *dlogits[3]; int32_t* targets; float *stats[3], *rl[3], *mean[3], *dloss; int32_t* cnt[3];
  for (int k = 0; k < 3; ++k) {
    CK(cudaMalloc(&logits[k], M * V * 2)); CK(cudaMalloc(&dlogits[k], M * V * 2)); CK(cudaMalloc(&stats[k], 3 * M * 4));
    CK(cudaMalloc(&rl[k], M * 4)); CK(cudaMalloc(&mean[k], 4)); CK(cudaMalloc(&cnt[k], 4));
    filln_k<<<1024, 256, 0, S>>>(logits[k], M * V, 17 + k);
  }
  CK(cudaMalloc(&targets, M * 4)); CK(cudaMalloc(&dloss, 4)); filli_k<<<64, 256, 0, S>>>(targets, M, int(V));
  const float one = 1.0f; CK(cudaMemcpy(dloss, &one, 4, cudaMemcpyHostToDevice));
  for (int k = 0; k < 3; ++k) cross_entropy_forward(stats[k], rl[k], mean[k], cnt[k], logits[k], targets, shape, S);
  CK(cudaStreamSynchronize(S));
  {
    cross_entropy_backward(dlogits[0], logits[0], stats[0], targets, cnt[0], dloss, shape, S);
    CK(cudaStreamSynchronize(S));
    std::vector<uint16_t> h(M * V); float m;
    CK(cudaMemcpy(h.data(), dlogits[0], M * V * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(&m, mean[0], 4, cudaMemcpyDeviceToHost));
    uint64_t hash = 1469598103934665603ull; for (uint16_t v : h) hash = (hash ^ v) * 1099511628211ull;
    std::printf("mean loss %.7f dlogits hash %016llx\n", m, (unsigned long long)hash);
  }
  auto time = [&](std::function<void(int)> call) { return stream_us(S, call); };
  for (int round = 0; round < 3; ++round) {
    double f = time([&](int k) { cross_entropy_forward(stats[k], rl[k], mean[k], cnt[k], logits[k], targets, shape, S); });
    double b = time([&](int k) { cross_entropy_backward(dlogits[k], logits[k], stats[k], targets, cnt[k], dloss, shape, S); });
    std::printf("round %d: forward %.2f backward %.2f us\n", round, f, b);
  }
  return 0;
}
