// dropout.cu: fused bias + dropout + residual kernels (see dropout.h for the mask definition).
#include "common/kernels/dropout.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kBwdRowsPerGroupMin = 16;  // rows one backward block walks, at least
constexpr int kBwdMaxBlocks = 1024;      // backward blocks (partial rows x column tiles), at most
constexpr int kBwdRowBatch = 4;          // rows loaded before any is stored (loads in flight)

// Keep decisions for the 8 elements e0 .. e0 + 7 (e0 a multiple of 8): two Philox blocks.
__device__ __forceinline__ void keep_mask(bool keep[8], uint64_t seed, uint64_t position,
                                          int64_t e0, uint32_t threshold) {
  const uint64_t block = static_cast<uint64_t>(e0) / 4;
  const Philox4 r0 = philox_block(seed, position, block);
  const Philox4 r1 = philox_block(seed, position, block + 1);
  const uint32_t bits[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) keep[j] = bits[j] >= threshold;
}

// One 16-byte pack per thread. threshold == 0 means nothing is dropped: no RNG state is read.
__global__ void dropout_residual_forward_kernel(bf16* out, const bf16* x,
                                                const bf16* __restrict__ bias, const bf16* residual,
                                                int64_t packs, int C, uint32_t threshold,
                                                float scale, RngArgs rng) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  const int64_t e0 = k * 8;
  const PackBF16 xv = PackBF16::load_cs(x + e0);
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(xv.v[j]);
  if (bias) {
    const PackBF16 b = PackBF16::load(bias + e0 % C);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] += __bfloat162float(b.v[j]);
  }
  if (threshold != 0) {
    bool keep[8];
    keep_mask(keep, rng.slot->seed, rng.slot->offset + rng.op_offset, e0, threshold);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = keep[j] ? v[j] * scale : 0.0f;
  }
  if (residual) {
    const PackBF16 r = PackBF16::load_cs(residual + e0);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] += __bfloat162float(r.v[j]);
  }
  PackBF16 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) o.v[j] = __float2bfloat16_rn(v[j]);
  o.store(out + e0);
}

// Block (x, y) covers packs [x * blockDim.x, ...) of rows [y * rows_per_group, ...): each thread
// owns one pack of columns, walks its rows in order and writes its dbias partial to
// partials[y][...].
__global__ void dropout_residual_backward_kernel(bf16* dx, float* __restrict__ partials,
                                                 const bf16* dout, int64_t rows, int C,
                                                 int64_t rows_per_group, uint32_t threshold,
                                                 float scale, RngArgs rng) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= C / 8) return;
  const int64_t r_begin = blockIdx.y * rows_per_group;
  const int64_t r_end = min(rows, r_begin + rows_per_group);
  uint64_t seed = 0, position = 0;
  if (threshold != 0) {
    seed = rng.slot->seed;
    position = rng.slot->offset + rng.op_offset;
  }
  float acc[8] = {};
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kBwdRowBatch) {
    // All loads of the batch before any store (dx may alias dout, so the compiler cannot hoist
    // loads above stores by itself).
    PackBF16 d[kBwdRowBatch];
#pragma unroll
    for (int u = 0; u < kBwdRowBatch; ++u)
      if (r0 + u < r_end) d[u] = PackBF16::load_cs(dout + (r0 + u) * C + p * 8);
#pragma unroll
    for (int u = 0; u < kBwdRowBatch; ++u) {
      if (r0 + u >= r_end) break;
      const int64_t e0 = (r0 + u) * C + p * 8;
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(d[u].v[j]);
      if (threshold != 0) {
        bool keep[8];
        keep_mask(keep, seed, position, e0, threshold);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = keep[j] ? v[j] * scale : 0.0f;
      }
      PackBF16 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[j] += v[j];
        o.v[j] = __float2bfloat16_rn(v[j]);
      }
      o.store(dx + e0);
    }
  }
  if (partials) {
    float4* dst =
        reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * C + p * 8);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void check_args(int64_t rows, int C, float p, RngArgs rng) {
  REPLAY_REQUIRE(rows >= 1 && C >= 8 && C % 8 == 0,
                 "dropout needs rows >= 1 and C a positive multiple of 8");
  REPLAY_REQUIRE(p >= 0.0f && p < 1.0f, "dropout probability must be in [0, 1)");
  REPLAY_REQUIRE(dropout_threshold(p) == 0 || rng.slot != nullptr,
                 "dropout with p > 0 needs an RNG slot");
}

// The backward's blocks: column tiles of `threads` packs by groups of rows_per_group rows. Depends
// only on the shape, so the partial sums (and dbias) are the same on every run and every device.
struct BackwardPlan {
  int threads, col_tiles, groups;
  int64_t rows_per_group;
};

BackwardPlan plan_backward(int64_t rows, int C) {
  BackwardPlan plan{};
  const int packs = C / 8;
  plan.threads = std::min(kThreads, ceil_div(packs, 32) * 32);
  plan.col_tiles = ceil_div(packs, plan.threads);
  const int64_t max_groups = std::max(1, kBwdMaxBlocks / plan.col_tiles);
  const int64_t groups = std::min(ceil_div<int64_t>(rows, kBwdRowsPerGroupMin), max_groups);
  plan.rows_per_group = ceil_div<int64_t>(rows, groups);
  plan.groups = static_cast<int>(ceil_div<int64_t>(rows, plan.rows_per_group));
  return plan;
}

}  // namespace

void dropout_residual_forward(bf16* out, const bf16* x, const bf16* bias, const bf16* residual,
                              int64_t rows, int C, float p, RngArgs rng, cudaStream_t stream) {
  check_args(rows, C, p, rng);
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(bias) && aligned16(residual),
                 "dropout tensors must be 16-byte aligned");
  const int64_t packs = rows * C / 8;
  const int64_t blocks = ceil_div<int64_t>(packs, kThreads);
  REPLAY_REQUIRE(blocks <= INT32_MAX, "dropout tensor too large for a 1-D grid");
  dropout_residual_forward_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      out, x, bias, residual, packs, C, dropout_threshold(p), 1.0f / (1.0f - p), rng);
  REPLAY_LAUNCH_CHECK();
}

size_t dropout_residual_backward_workspace_bytes(int64_t rows, int C) {
  REPLAY_REQUIRE(rows >= 1 && C >= 8 && C % 8 == 0,
                 "dropout needs rows >= 1 and C a positive multiple of 8");
  return static_cast<size_t>(plan_backward(rows, C).groups) * C * sizeof(float);
}

void dropout_residual_backward(bf16* dx, float* dbias, const bf16* dout, int64_t rows, int C,
                               float p, RngArgs rng, bool accumulate_dbias, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  check_args(rows, C, p, rng);
  REPLAY_REQUIRE(aligned16(dx) && aligned16(dout) && aligned16(workspace),
                 "dropout tensors and workspace must be 16-byte aligned");
  const BackwardPlan plan = plan_backward(rows, C);
  float* partials = nullptr;
  if (dbias) {
    const size_t needed = static_cast<size_t>(plan.groups) * C * sizeof(float);
    REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= needed,
                   "dropout backward workspace too small: " + std::to_string(workspace_bytes) +
                       " < " + std::to_string(needed));
    partials = static_cast<float*>(workspace);
  }
  dropout_residual_backward_kernel<<<dim3(plan.col_tiles, plan.groups), plan.threads, 0, stream>>>(
      dx, partials, dout, rows, C, plan.rows_per_group, dropout_threshold(p), 1.0f / (1.0f - p),
      rng);
  REPLAY_LAUNCH_CHECK();
  if (dbias) column_sums<1>(dbias, nullptr, partials, plan.groups, C, accumulate_dbias, stream);
}

}  // namespace replay
