// Dropout forward/backward in a stream of 24 calls over 3 buffer sets (the suite's protocol); prints us a call
// for p = 0.1 and p = 0 (no Philox), backward with and without dbias.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>
#include "common/check.h"
#include "common/kernels/dropout.h"
#include "stream.cuh"
using bf16 = __nv_bfloat16;
using namespace replay;
__global__ void fill_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 65536.0f - 0.5f);
  }
}
// A plain copy in 16-byte packs, grid-stride over one wave of resident blocks.
__global__ void __launch_bounds__(256) copy_k(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v; asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
    dst[i] = v;
  }
}
template <typename T> T* dalloc(size_t n) { void* p; CK(cudaMalloc(&p, n * sizeof(T) + 256)); return (T*)p; }
int main(int argc, char** argv) {
  cudaStream_t S; CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
  const int64_t M = 2048; const int C = 12288;
  const size_t wsb = dropout_residual_backward_workspace_bytes(M, C);
  struct Set { bf16 *a, *b, *c, *bias; float* db; PhiloxSlot* slot; void* ws; } set[3];
  for (int k = 0; k < 3; ++k) {
    set[k] = {dalloc<bf16>(M * C), dalloc<bf16>(M * C), dalloc<bf16>(M * C), dalloc<bf16>(C), dalloc<float>(C), dalloc<PhiloxSlot>(1), dalloc<char>(wsb)};
    fill_k<<<1024, 256, 0, S>>>(set[k].a, M * C, 1 + k); fill_k<<<1024, 256, 0, S>>>(set[k].b, M * C, 7 + k);
    fill_k<<<16, 256, 0, S>>>(set[k].bias, C, 11 + k);
    PhiloxSlot h{1234u + k, 0}; CK(cudaMemcpy(set[k].slot, &h, sizeof(h), cudaMemcpyHostToDevice));
  }
  CK(cudaStreamSynchronize(S));
  auto time = [&](std::function<void(const Set&)> call) { return stream_us(S, [&](int k) { call(set[k]); }); };
  {  // result check: a hash of dx and dbias's sum, for comparing variants
    const Set& s = set[0];
    dropout_residual_backward(s.c, s.db, s.a, M, C, 0.1f, RngArgs{s.slot, 0}, false, s.ws, wsb, S);
    CK(cudaStreamSynchronize(S));
    std::vector<uint16_t> h(M * C); std::vector<float> db(C);
    CK(cudaMemcpy(h.data(), s.c, M * C * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(db.data(), s.db, C * 4, cudaMemcpyDeviceToHost));
    uint64_t hash = 1469598103934665603ull; size_t kept = 0;
    for (uint16_t v : h) { hash = (hash ^ v) * 1099511628211ull; kept += (v & 0x7fff) != 0; }
    double sum = 0; for (float v : db) sum += v;
    std::printf("dx hash %016llx kept %.5f dbias sum %.6f dbias[0..2] %.6f %.6f %.6f\n", (unsigned long long)hash, double(kept) / h.size(), sum, db[0], db[1], db[2]);
  }
  for (int round = 0; round < 3; ++round) {
    double b1 = time([&](const Set& s) { dropout_residual_backward(s.c, s.db, s.a, M, C, 0.1f, RngArgs{s.slot, 0}, false, s.ws, wsb, S); });
    double b0 = time([&](const Set& s) { dropout_residual_backward(s.c, s.db, s.a, M, C, 0.0f, RngArgs{s.slot, 0}, false, s.ws, wsb, S); });
    double n1 = time([&](const Set& s) { dropout_residual_backward(s.c, nullptr, s.a, M, C, 0.1f, RngArgs{s.slot, 0}, false, s.ws, wsb, S); });
    double n0 = time([&](const Set& s) { dropout_residual_backward(s.c, nullptr, s.a, M, C, 0.0f, RngArgs{s.slot, 0}, false, s.ws, wsb, S); });
    double f1 = time([&](const Set& s) { dropout_residual_forward(s.c, s.a, s.bias, s.b, M, C, 0.1f, RngArgs{s.slot, 0}, S); });
    double c1 = time([&](const Set& s) { copy_k<<<132 * 8, 256, 0, S>>>((uint4*)s.c, (const uint4*)s.a, M * C / 8); });
    double c2 = time([&](const Set& s) { CK(cudaMemcpyAsync(s.c, s.a, M * C * 2, cudaMemcpyDeviceToDevice, S)); });
    std::printf("round %d: copy kernel %.2f cudaMemcpyAsync %.2f us (%.1f MB moved)\n", round, c1, c2, 2.0 * M * C * 2 / 1e6);
    std::printf("round %d: bwd+dbias p=0.1 %.2f p=0 %.2f | bwd p=0.1 %.2f p=0 %.2f | fwd p=0.1 %.2f us\n", round, b1, b0, n1, n0, f1);
  }
  return 0;
}
