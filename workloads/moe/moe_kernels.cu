// moe_kernels.cu: MLA's key/value assembly, the expert-index fold, the bf16 cast, the loss terms
// and the pipeline-stage head (moe_kernels.h).
#include "workloads/moe/moe_kernels.h"

#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // ceil_div

namespace replay::moe {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;

// One thread per 8 channels (16 bytes) of one token and head.
__global__ void assemble_kernel(uint4* k, uint4* v, const uint4* kvb, const uint4* kpe,
                                int64_t tokens, int heads, int nope8, int rope8, int v8) {
  const int per_head = nope8 + rope8 + v8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * heads * per_head) return;
  const int c = static_cast<int>(i % per_head);
  const int64_t th = i / per_head;  // token * heads + head
  const int64_t t = th / heads;
  if (c < nope8) {
    k[th * (nope8 + rope8) + c] = kvb[th * (nope8 + v8) + c];
  } else if (c < nope8 + rope8) {
    k[th * (nope8 + rope8) + c] = kpe[t * rope8 + (c - nope8)];
  } else {
    const int cv = c - nope8 - rope8;
    v[th * v8 + cv] = kvb[th * (nope8 + v8) + nope8 + cv];
  }
}

__global__ void assemble_backward_copy_kernel(uint4* dkvb, const uint4* dk, const uint4* dv,
                                              int64_t tokens, int heads, int nope8, int rope8,
                                              int v8) {
  const int per_head = nope8 + v8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * heads * per_head) return;
  const int c = static_cast<int>(i % per_head);
  const int64_t th = i / per_head;
  dkvb[th * per_head + c] = c < nope8 ? dk[th * (nope8 + rope8) + c] : dv[th * v8 + (c - nope8)];
}

// dkpe[t, r] = sum over heads in order of dk[t, h, nope + r].
__global__ void assemble_backward_kpe_kernel(bf16* dkpe, const bf16* dk, int64_t tokens, int heads,
                                             int nope, int rope) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * rope) return;
  const int r = static_cast<int>(i % rope);
  const int64_t t = i / rope;
  const int qk = nope + rope;
  float sum = 0.0f;
  for (int h = 0; h < heads; ++h) sum += __bfloat162float(dk[(t * heads + h) * qk + nope + r]);
  dkpe[i] = __float2bfloat16_rn(sum);
}

__global__ void fold_kernel(int32_t* local, const int32_t* global, int64_t n, int local_experts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t e = global[i];
  local[i] = e < 0 ? -1 : e % local_experts;
}

__global__ void to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void scale_scalar_kernel(float* out, const float* in, float factor) {
  out[0] = (in != nullptr ? in[0] : 1.0f) * factor;
}

__global__ void add_terms_kernel(float* loss, const float* terms, int n) {
  float sum = loss[0];
  for (int i = 0; i < n; ++i) sum += terms[i];
  loss[0] = sum;
}

constexpr int64_t kStageChunk = 8192;  // elements per partial sum

__global__ void stage_partials_kernel(float* partials, const bf16* y, const bf16* g, int64_t n) {
  __shared__ float warp_sums[kThreads / 32];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kStageChunk;
  const int64_t end = begin + kStageChunk < n ? begin + kStageChunk : n;
  float sum = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
    sum += __bfloat162float(y[i]) * __bfloat162float(g[i]);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    partials[blockIdx.x] = total;
  }
}

__global__ void stage_finish_kernel(float* loss, const float* partials, int64_t parts, int64_t n) {
  float total = 0.0f;
  for (int64_t p = 0; p < parts; ++p) total += partials[p];
  loss[0] = total / static_cast<float>(n);
}

__global__ void stage_backward_kernel(bf16* dy, const bf16* g, const float* scale, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = (scale != nullptr ? scale[0] : 1.0f) / static_cast<float>(n);
  dy[i] = __float2bfloat16_rn(__bfloat162float(g[i]) * s);
}

unsigned blocks(int64_t n) {
  return static_cast<unsigned>(ceil_div<int64_t>(n, kThreads));
}

void check_dims(const MlaDims& d) {
  REPLAY_REQUIRE(d.tokens >= 1 && d.heads >= 1 && d.nope >= 8 && d.rope >= 8 && d.v >= 8 &&
                     d.nope % 8 == 0 && d.rope % 8 == 0 && d.v % 8 == 0,
                 "MLA assembly needs positive sizes with the head dims multiples of 8 (got nope " +
                     std::to_string(d.nope) + ", rope " + std::to_string(d.rope) + ", v " +
                     std::to_string(d.v) + ")");
}

}  // namespace

void mla_assemble_kv(bf16* k, bf16* v, const bf16* kvb, const bf16* kpe, const MlaDims& d,
                     cudaStream_t stream) {
  check_dims(d);
  const int64_t n = d.tokens * d.heads * (d.nope + d.rope + d.v) / 8;
  assemble_kernel<<<blocks(n), kThreads, 0, stream>>>(
      reinterpret_cast<uint4*>(k), reinterpret_cast<uint4*>(v), reinterpret_cast<const uint4*>(kvb),
      reinterpret_cast<const uint4*>(kpe), d.tokens, d.heads, d.nope / 8, d.rope / 8, d.v / 8);
  REPLAY_LAUNCH_CHECK();
}

void mla_assemble_kv_backward(bf16* dkvb, bf16* dkpe, const bf16* dk, const bf16* dv,
                              const MlaDims& d, cudaStream_t stream) {
  check_dims(d);
  const int64_t n = d.tokens * d.heads * (d.nope + d.v) / 8;
  assemble_backward_copy_kernel<<<blocks(n), kThreads, 0, stream>>>(
      reinterpret_cast<uint4*>(dkvb), reinterpret_cast<const uint4*>(dk),
      reinterpret_cast<const uint4*>(dv), d.tokens, d.heads, d.nope / 8, d.rope / 8, d.v / 8);
  REPLAY_LAUNCH_CHECK();
  assemble_backward_kpe_kernel<<<blocks(d.tokens * d.rope), kThreads, 0, stream>>>(
      dkpe, dk, d.tokens, d.heads, d.nope, d.rope);
  REPLAY_LAUNCH_CHECK();
}

void moe_fold_indices(int32_t* local, const int32_t* global, int64_t n, int local_experts,
                      cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 1 && local_experts >= 1, "moe_fold_indices needs n and local experts >= 1");
  fold_kernel<<<blocks(n), kThreads, 0, stream>>>(local, global, n, local_experts);
  REPLAY_LAUNCH_CHECK();
}

void moe_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 1, "moe_to_bf16 needs n >= 1");
  to_bf16_kernel<<<blocks(n), kThreads, 0, stream>>>(out, in, n);
  REPLAY_LAUNCH_CHECK();
}

void moe_scale_scalar(float* out, const float* in, float factor, cudaStream_t stream) {
  REPLAY_REQUIRE(out != nullptr, "moe_scale_scalar needs its output");
  scale_scalar_kernel<<<1, 1, 0, stream>>>(out, in, factor);
  REPLAY_LAUNCH_CHECK();
}

void moe_add_terms(float* loss, const float* terms, int n, cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 0, "moe_add_terms needs n >= 0");
  if (n == 0) return;
  add_terms_kernel<<<1, 1, 0, stream>>>(loss, terms, n);
  REPLAY_LAUNCH_CHECK();
}

int64_t stage_head_partials(int64_t n) {
  return ceil_div<int64_t>(n, kStageChunk);
}

void stage_head_forward(float* loss, float* partials, const bf16* y, const bf16* g, int64_t n,
                        cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 1, "stage_head_forward needs n >= 1");
  const int64_t parts = stage_head_partials(n);
  stage_partials_kernel<<<static_cast<unsigned>(parts), kThreads, 0, stream>>>(partials, y, g, n);
  REPLAY_LAUNCH_CHECK();
  stage_finish_kernel<<<1, 1, 0, stream>>>(loss, partials, parts, n);
  REPLAY_LAUNCH_CHECK();
}

void stage_head_backward(bf16* dy, const bf16* g, const float* scale, int64_t n,
                         cudaStream_t stream) {
  REPLAY_REQUIRE(n >= 1, "stage_head_backward needs n >= 1");
  stage_backward_kernel<<<blocks(n), kThreads, 0, stream>>>(dy, g, scale, n);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::moe
