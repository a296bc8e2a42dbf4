// dropout.cu: fused bias + dropout + residual kernels (see dropout.h for the mask definition).
//
// Both directions use one layout: a thread owns one 16-byte pack of columns (8 elements) and walks
// a run of rows, so the bias pack (forward) is loaded once and the dbias partial (backward)
// accumulates in registers. Rows come in small batches: a batch's loads are all issued first, then
// its keep masks are drawn from Philox (they do not depend on the data, so that arithmetic runs
// while the loads are in flight), then the batch is combined and stored.
//
// The runs interleave: with Q runs over the grid, run q takes rows q, q + Q, q + 2Q, ... So at any
// moment the whole grid works in one window of about Q x batch consecutive rows, and no run has
// more than one row more than another; contiguous runs of ceil(rows / Q) rows, whose last runs are
// short or empty, streamed slower (measured: reports/RESULTS.md, The dropout's row order).
//
// The backward's blocks stack kBwdLanes such runs on the same packs (threadIdx.y) and add their
// dbias partials in shared memory before writing one partial row a block: a quarter of the
// partial bytes, and a quarter of the rows for column_sums to add. dbias is finished by
// column_sums, because finishing it inside the kernel (a ticket or a grid barrier) was slower, and
// giving each block or cluster whole columns of every row, which needs no partial rows, leaves
// narrow row slices that stream slower (measured: reports/RESULTS.md, The dropout backward).
//
// Row data is loaded through L2 only (ld.global.cg) and stored plainly, the fastest pairing of
// hints here; streaming loads (ld.global.cs) with plain stores were the slowest. Non-coherent loads
// (ld.global.nc) were as fast, but dx may alias dout and out may alias x or residual, which .nc
// does not allow (measured: reports/RESULTS.md, Cache hints for the streaming kernels).
//
// At GPT-3 sizes the Philox arithmetic (two Philox4x32-10 blocks, about 80 integer instructions
// per 8 elements, ~150 instructions per 8 elements in all) takes about half the memory time, so
// it must overlap the loads, and the grid is exactly one wave of resident blocks with equal shares
// of rows: no block waits for a second, partial wave.
#include "common/kernels/dropout.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
// Rows whose loads a thread issues before it computes any, and the register cap (64) that leaves
// room for 1024 threads per SM: 64 bytes of loads in flight per thread (x and residual forward,
// dout backward), ~64 KB per SM, twice what Little's law asks at ~4 TB/s and ~1 us.
constexpr int kFwdRowBatch = 2;
constexpr int kBwdRowBatch = 4;
constexpr int kMinBlocksPerSM = 4;
constexpr int kBwdLanes = 4;  // backward row runs a block: blocks of up to 1024 threads
constexpr int kBwdThreads = kThreads * kBwdLanes;
constexpr int kBwdMaxBlocks = 256;  // bounds the dbias partials: groups <= 256 / column tiles

// The launch's Philox stream (philox.h) and the keep bits of 8 consecutive elements.
struct Philox : PhiloxStream {
  using PhiloxStream::PhiloxStream;

  // Keep bits of the 8 elements e0 .. e0 + 7 (e0 a multiple of 8): bit j is element e0 + j.
  __device__ __forceinline__ uint32_t keep_bits(int64_t e0, uint32_t threshold) const {
    const uint64_t block = static_cast<uint64_t>(e0) / 4;
    const Philox4 r0 = draw(block), r1 = draw(block + 1);
    const uint32_t words[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
    uint32_t bits = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) bits |= static_cast<uint32_t>(words[j] >= threshold) << j;
    return bits;
  }
};

// The launch's Philox stream; threshold == 0 (p = 0) reads no RNG state.
__device__ __forceinline__ Philox launch_philox(RngArgs rng, uint32_t threshold) {
  if (threshold == 0) return Philox(0, 0);
  return Philox(rng.slot->seed, rng.slot->offset + rng.op_offset);
}

// The last batch of a run, of `left` < kBatch + 1 rows (none when left is 0).
template <int kBatch, typename Batch>
__device__ __forceinline__ void last_batch(int64_t left, int64_t r0, Batch& batch) {
  if constexpr (kBatch > 0) {
    if (left == kBatch) {
      batch(std::integral_constant<int, kBatch>{}, r0);
    } else {
      last_batch<kBatch - 1>(left, r0, batch);
    }
  }
}

// Walks run q of Q (rows q, q + Q, ... below `rows`) in batches of kBatch rows and one last batch
// of the rest, calling batch(integral_constant<int, n>, r0) for rows r0, r0 + Q, ..., r0 + (n - 1)
// Q: no bounds checks inside.
template <int kBatch, typename Batch>
__device__ __forceinline__ void walk_run(int64_t q, int64_t Q, int64_t rows, Batch&& batch) {
  const int64_t count = q < rows ? (rows - q + Q - 1) / Q : 0;
  int64_t k = 0;
  for (; k + kBatch <= count; k += kBatch) batch(std::integral_constant<int, kBatch>{}, q + k * Q);
  last_batch<kBatch - 1>(count - k, q + k * Q, batch);
}

// Block (x, y) covers packs [x * blockDim.x, ...) of run y of gridDim.y.
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    dropout_residual_forward_kernel(bf16* out, const bf16* x, const bf16* __restrict__ bias,
                                    const bf16* residual, int64_t rows, int C, uint32_t threshold,
                                    float scale, RngArgs rng, int64_t first_element) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= C / 8) return;
  const Philox philox = launch_philox(rng, threshold);
  float b[8] = {};
  if (bias) {
    const PackBF16 bv = PackBF16::load(bias + p * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = __bfloat162float(bv.v[j]);
  }
  const int64_t Q = gridDim.y;
  walk_run<kFwdRowBatch>(blockIdx.y, Q, rows, [&](auto batch, int64_t r0) {
    constexpr int kRows = decltype(batch)::value;
    // Loads first (out may alias x or residual, so all of them precede the batch's stores), then
    // the masks, whose arithmetic overlaps the loads' latency.
    PackBF16 xv[kRows], rv[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      xv[u] = PackBF16::load_cg(x + (r0 + u * Q) * C + p * 8);
      if (residual) rv[u] = PackBF16::load_cg(residual + (r0 + u * Q) * C + p * 8);
    }
    uint32_t keep[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      keep[u] = threshold != 0
                    ? philox.keep_bits(first_element + (r0 + u * Q) * C + p * 8, threshold)
                    : ~0u;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      PackBF16 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = __bfloat162float(xv[u].v[j]);
        if (bias) v += b[j];
        if (threshold != 0) v = (keep[u] >> j) & 1u ? v * scale : 0.0f;
        if (residual) v += __bfloat162float(rv[u].v[j]);
        o.v[j] = __float2bfloat16_rn(v);
      }
      o.store(out + (r0 + u * Q) * C + p * 8);
    }
  });
}

// Block (x, y) covers packs [x * blockDim.x, ...) of runs y * kBwdLanes + lane of gridDim.y *
// kBwdLanes, one a lane (threadIdx.y); each block writes one dbias partial row, partials[y][its
// columns], the lanes' sums added in lane order.
__global__ void __launch_bounds__(kBwdThreads, 1)
    dropout_residual_backward_kernel(bf16* dx, float* __restrict__ partials, const bf16* dout,
                                     int64_t rows, int C, uint32_t threshold, float scale,
                                     RngArgs rng, int64_t first_element) {
  __shared__ float4 lane_sums[kBwdLanes - 1][kThreads][2];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int p = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.y;
  const bool owns = p < C / 8;  // threads past the last pack still join the lanes' barrier
  const Philox philox = launch_philox(rng, threshold);
  float acc[8] = {};
  if (owns) {
    const int64_t Q = int64_t{gridDim.y} * kBwdLanes;
    walk_run<kBwdRowBatch>(
        blockIdx.y * int64_t{kBwdLanes} + lane, Q, rows, [&](auto batch, int64_t r0) {
          constexpr int kRows = decltype(batch)::value;
          // dx may alias dout: the batch is loaded before any of it is stored.
          PackBF16 d[kRows];
#pragma unroll
          for (int u = 0; u < kRows; ++u) d[u] = PackBF16::load_cg(dout + (r0 + u * Q) * C + p * 8);
          uint32_t keep[kRows];
#pragma unroll
          for (int u = 0; u < kRows; ++u)
            keep[u] = threshold != 0
                          ? philox.keep_bits(first_element + (r0 + u * Q) * C + p * 8, threshold)
                          : ~0u;
#pragma unroll
          for (int u = 0; u < kRows; ++u) {
            PackBF16 o;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              float v = __bfloat162float(d[u].v[j]);
              if (threshold != 0) v = (keep[u] >> j) & 1u ? v * scale : 0.0f;
              acc[j] += v;
              o.v[j] = __float2bfloat16_rn(v);
            }
            o.store(dx + (r0 + u * Q) * C + p * 8);
          }
        });
  }
  if (partials == nullptr) return;
  if (lane > 0) {
    lane_sums[lane - 1][threadIdx.x][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    lane_sums[lane - 1][threadIdx.x][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
  if (lane > 0 || !owns) return;
#pragma unroll
  for (int l = 0; l < kBwdLanes - 1; ++l) {
    const float4 lo = lane_sums[l][threadIdx.x][0], hi = lane_sums[l][threadIdx.x][1];
    acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
    acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
  }
  float4* dst = reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * C + p * 8);
  dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void check_args(int64_t rows, int C, float p, RngArgs rng, int64_t mask_row) {
  REPLAY_REQUIRE(mask_row >= 0, "dropout: the mask's first row must not be negative");
  REPLAY_REQUIRE(rows >= 1 && C >= 8 && C % 8 == 0,
                 "dropout needs rows >= 1 and C a positive multiple of 8");
  REPLAY_REQUIRE(p >= 0.0f && p < 1.0f, "dropout probability must be in [0, 1)");
  REPLAY_REQUIRE(dropout_threshold(p) == 0 || rng.slot != nullptr,
                 "dropout with p > 0 needs an RNG slot");
}

// The blocks: column tiles of `threads` packs by `groups` row groups, each block `lanes` threads
// deep, one run of rows a lane.
struct Plan {
  int threads, lanes, col_tiles, groups;
};

// As many row groups as make one wave of resident blocks (every SM full; 2048 x 12288 on 132 SMs:
// the backward's 6 tiles x 22 groups of 4 lanes, 88 runs of 23 or 24 rows), at most max_groups.
// Depends only on the shape (C and the bound, which the caller derives from the rows) and the
// device, never on timing. Made once per (kernel, device, C, bound) and cached: the occupancy query
// costs microseconds of host time on every launch otherwise.
template <typename Kernel>
Plan make_plan(Kernel kernel, int lanes, int device, int C, int64_t max_groups) {
  Plan plan{};
  const int packs = C / 8;
  plan.threads = std::min(kThreads, ceil_div(packs, 32) * 32);
  plan.lanes = lanes;
  plan.col_tiles = ceil_div(packs, plan.threads);
  int sms = 0, per_sm = 0;
  REPLAY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  REPLAY_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, plan.threads * lanes, 0));
  const int64_t wave_groups = std::max<int64_t>(1, int64_t{sms} * per_sm / plan.col_tiles);
  plan.groups = static_cast<int>(std::min(wave_groups, max_groups));
  return plan;
}

template <typename Kernel>
Plan plan_blocks(Kernel kernel, int lanes, int C, int64_t max_groups) {
  static std::map<std::tuple<const void*, int, int, int64_t>, Plan> cache;
  static std::mutex mutex;
  int device = 0;
  REPLAY_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, C, max_groups);
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, make_plan(kernel, lanes, device, C, max_groups)).first;
  }
  return it->second;
}

// The backward's bound on row groups: it sizes the dbias workspace from the shape alone.
int64_t backward_max_groups(int64_t rows, int C) {
  const int col_tiles = ceil_div(C / 8, std::min(kThreads, ceil_div(C / 8, 32) * 32));
  return std::min<int64_t>(std::max(1, kBwdMaxBlocks / col_tiles),
                           ceil_div<int64_t>(rows, kBwdRowBatch * kBwdLanes));
}

}  // namespace

void dropout_residual_forward(bf16* out, const bf16* x, const bf16* bias, const bf16* residual,
                              int64_t rows, int C, float p, RngArgs rng, cudaStream_t stream,
                              int64_t mask_row) {
  check_args(rows, C, p, rng, mask_row);
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(bias) && aligned16(residual),
                 "dropout tensors must be 16-byte aligned");
  const Plan plan =
      plan_blocks(dropout_residual_forward_kernel, 1, C, ceil_div<int64_t>(rows, kFwdRowBatch));
  launch_dependent(dropout_residual_forward_kernel, dim3(plan.col_tiles, plan.groups), plan.threads,
                   stream, out, x, bias, residual, rows, C, dropout_threshold(p), 1.0f / (1.0f - p),
                   rng, mask_row * C);
  REPLAY_LAUNCH_CHECK();
}

size_t dropout_residual_backward_workspace_bytes(int64_t rows, int C) {
  REPLAY_REQUIRE(rows >= 1 && C >= 8 && C % 8 == 0,
                 "dropout needs rows >= 1 and C a positive multiple of 8");
  return static_cast<size_t>(backward_max_groups(rows, C)) * C * sizeof(float);
}

void dropout_residual_backward(bf16* dx, float* dbias, const bf16* dout, int64_t rows, int C,
                               float p, RngArgs rng, bool accumulate_dbias, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, int64_t mask_row) {
  check_args(rows, C, p, rng, mask_row);
  REPLAY_REQUIRE(aligned16(dx) && aligned16(dout) && aligned16(workspace),
                 "dropout tensors and workspace must be 16-byte aligned");
  const Plan plan =
      plan_blocks(dropout_residual_backward_kernel, kBwdLanes, C, backward_max_groups(rows, C));
  float* partials = nullptr;
  if (dbias) {
    const size_t needed = static_cast<size_t>(plan.groups) * C * sizeof(float);
    REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= needed,
                   "dropout backward workspace too small: " + std::to_string(workspace_bytes) +
                       " < " + std::to_string(needed));
    partials = static_cast<float*>(workspace);
  }
  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),
                   dim3(plan.threads, plan.lanes), stream, dx, partials, dout, rows, C,
                   dropout_threshold(p), 1.0f / (1.0f - p), rng, mask_row * C);
  REPLAY_LAUNCH_CHECK();
  if (dbias) column_sums(1, dbias, nullptr, partials, plan.groups, C, accumulate_dbias, stream);
}

}  // namespace replay
