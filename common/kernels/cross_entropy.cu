// cross_entropy.cu: vocab-parallel softmax cross-entropy: shard stats, combine, loss, backward.
#include "common/kernels/cross_entropy.h"

#include <climits>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // PackBF16, block_reduce_sum, block_reduce_max
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

// One block per row of logits. A thread takes kChunkPacks 16-byte packs per chunk (packs t,
// t + T, ...), issues all of their loads before it uses any, then works on them: 256 threads x 8
// packs cover 16384 logits, so a GPT-3 shard row (12576 logits, 25 KB) is one chunk, and an SM
// with four such blocks has ~100 KB of loads in flight. Rows wider than a chunk take several.
constexpr int kRowThreads = 256;
constexpr int kChunkPacks = 8;
constexpr int kRowBlocksPerSM = 4;  // register cap (64) for four rows in flight per SM
constexpr int kLossThreads = 1024;  // the single block of the loss reduction

// exp(x - m) is computed as 2^(x * log2(e) - m * log2(e)): one FFMA and one MUFU.EX2 per logit.
// ex2.approx has a relative error near 2^-22, far below the bf16 gradient's rounding and the
// loss's fp32 tolerance; m * log2(e) is rounded once per row, the same way in the statistics and
// the backward, so the softmax stays normalized.
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A row of logits is read as a scalar head up to the first 16-byte boundary, a body of 8-wide packs
// and a scalar tail, so any vocabulary width (and any row start) gets 16-byte accesses for the
// bulk.
__device__ __forceinline__ int64_t unaligned_head(const __nv_bfloat16* row, int64_t width) {
  const int64_t past = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16) / 2;
  return past == 0 ? 0 : min(width, 8 - past);
}

// Eight bf16 logits as one streaming 16-byte load, and as floats (a bf16 is the top half of a
// float). Plain uint4 registers: the chunk's packs stay in registers however many are in use.
__device__ __forceinline__ uint4 load_pack(const __nv_bfloat16* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void unpack(uint4 w, float (&v)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// How many of a chunk's kChunkPacks packs a thread has, given the packs left from its first one.
__device__ __forceinline__ int chunk_packs(int64_t left) {
  const int64_t n = ceil_div<int64_t>(left, kRowThreads);
  return n < kChunkPacks ? static_cast<int>(n) : kChunkPacks;
}

// Online softmax statistics: m is the running max, s the sum of exp(x - m).
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * exp2_approx((m - x) * kLog2e) + 1.0f;
    m = x;
  } else {
    s += exp2_approx((x - m) * kLog2e);
  }
}

__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSM)
    cross_entropy_stats_kernel(float* __restrict__ stats, const __nv_bfloat16* __restrict__ logits,
                               const int32_t* __restrict__ targets, int64_t rows, int64_t width,
                               int64_t vocab_start) {
  __shared__ float scratch[32];
  allow_dependent_launch();  // cross_entropy_loss may be placed while this grid runs
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x;
  const __nv_bfloat16* row = logits + r * width;
  const int64_t head = unaligned_head(row, width);
  const int64_t packs = (width - head) / 8;
  const int64_t tail = head + packs * 8;

  // The target's logit, fetched first so that its latency hides under the row.
  float target_logit = 0.0f;
  if (t == 0) {
    const int32_t target = targets[r];
    const int64_t local = static_cast<int64_t>(target) - vocab_start;
    if (target != kCrossEntropyIgnoreIndex && local >= 0 && local < width)
      target_logit = __bfloat162float(row[local]);
  }

  float m = -INFINITY, s = 0.0f;
  for (int64_t i = t; i < head; i += kRowThreads) online_add(m, s, __bfloat162float(row[i]));
  for (int64_t base = t; base < packs; base += kChunkPacks * kRowThreads) {
    const __nv_bfloat16* src = row + head + base * 8;  // pack u of the chunk: src + u * T * 8
    const int n = chunk_packs(packs - base);
    uint4 x[kChunkPacks];
#pragma unroll
    for (int u = 0; u < kChunkPacks; ++u) {
      if (u < n) x[u] = load_pack(src + u * kRowThreads * 8);
    }
    // Per pack: rescale the running sum when the max grows (rarely, once the max has settled).
#pragma unroll
    for (int u = 0; u < kChunkPacks; ++u) {
      if (u < n) {
        float v[8], pack_max = -INFINITY;
        unpack(x[u], v);
#pragma unroll
        for (int k = 0; k < 8; ++k) pack_max = fmaxf(pack_max, v[k]);
        if (pack_max > m) {
          s *= exp2_approx((m - pack_max) * kLog2e);  // 0 while m is still -inf
          m = pack_max;
        }
        if (m > -INFINITY) {
          const float m_log2 = m * kLog2e;
#pragma unroll
          for (int k = 0; k < 8; ++k) s += exp2_approx(fmaf(v[k], kLog2e, -m_log2));
        }
      }
    }
  }
  for (int64_t i = tail + t; i < width; i += kRowThreads)
    online_add(m, s, __bfloat162float(row[i]));

  // Combine the threads: the row max first, then each thread's sum rescaled to it.
  const float row_max = block_reduce_max(m, scratch);
  const float row_sum =
      block_reduce_sum(m == -INFINITY ? 0.0f : s * exp2_approx((m - row_max) * kLog2e), scratch);
  if (t == 0) {
    stats[r] = row_max;
    stats[rows + r] = row_sum;
    stats[2 * rows + r] = target_logit;
  }
}

// One thread per row; shards combined in rank order.
__global__ void cross_entropy_combine_kernel(float* __restrict__ stats,
                                             const float* __restrict__ stacked, int shards,
                                             int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float m = -INFINITY;
  for (int k = 0; k < shards; ++k) m = fmaxf(m, stacked[k * 3 * rows + r]);
  float s = 0.0f, target = 0.0f;
  for (int k = 0; k < shards; ++k) {
    const float* shard = stacked + k * 3 * rows;
    s += shard[rows + r] * expf(shard[r] - m);
    target += shard[2 * rows + r];  // only the shard holding the target is non-zero
  }
  stats[r] = m;
  stats[rows + r] = s;
  stats[2 * rows + r] = target;
}

// A programmatic dependent of the kernel before it (the statistics or their combine): placed while
// that one drains, it waits for it and then costs about one L2 round trip and a block reduction.
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_loss_kernel(float* __restrict__ row_loss, float* __restrict__ mean_loss,
                              int32_t* __restrict__ count, const float* __restrict__ stats,
                              const int32_t* __restrict__ targets, int64_t rows) {
  __shared__ float scratch[32];
  wait_for_previous_grid();
  float sum = 0.0f, counted = 0.0f;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    float loss = 0.0f;
    if (targets[r] != kCrossEntropyIgnoreIndex) {
      // (max - target) first: both are large and close, the log-sum is small.
      loss = (stats[r] - stats[2 * rows + r]) + logf(stats[rows + r]);
      counted += 1.0f;
    }
    row_loss[r] = loss;
    sum += loss;
  }
  sum = block_reduce_sum(sum, scratch);
  counted = block_reduce_sum(counted, scratch);  // exact: rows < 2^24
  if (threadIdx.x == 0) {
    *count = static_cast<int32_t>(counted);
    *mean_loss = counted > 0.0f ? sum / counted : 0.0f;
  }
}

__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSM) cross_entropy_backward_kernel(
    __nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* __restrict__ stats,
    const int32_t* __restrict__ targets, const int32_t* __restrict__ count,
    const float* __restrict__ dloss, int64_t rows, int64_t width, int64_t vocab_start) {
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x;
  const int32_t target = targets[r];
  const int counted = *count;
  const bool ignored = target == kCrossEntropyIgnoreIndex || counted == 0;
  const float scale = ignored ? 0.0f : *dloss / static_cast<float>(counted);
  const float max_log2 = stats[r] * kLog2e, inv_sum = 1.0f / stats[rows + r];
  const int64_t local = static_cast<int64_t>(target) - vocab_start;  // may lie outside this shard
  const __nv_bfloat16* in = logits + r * width;
  __nv_bfloat16* out = dlogits + r * width;
  auto grad = [&](float x, bool is_target) {  // (softmax - onehot) * scale
    const float p = exp2_approx(fmaf(x, kLog2e, -max_log2)) * inv_sum;
    return ignored ? 0.0f : (is_target ? p - 1.0f : p) * scale;
  };

  const int64_t head = unaligned_head(in, width);
  const int64_t packs = (width - head) / 8;
  const int64_t tail = head + packs * 8;
  for (int64_t i = t; i < head; i += kRowThreads)
    out[i] = __float2bfloat16_rn(grad(__bfloat162float(in[i]), i == local));
  for (int64_t base = t; base < packs; base += kChunkPacks * kRowThreads) {
    // Pack u of the chunk is at + u * T * 8. dlogits may alias logits: the chunk is loaded before
    // any of it is stored.
    const __nv_bfloat16* src = in + head + base * 8;
    __nv_bfloat16* dst = out + head + base * 8;
    const int n = chunk_packs(packs - base);
    const int64_t target_at = local - (head + base * 8);  // target's offset from pack 0, if here
    uint4 x[kChunkPacks];
#pragma unroll
    for (int u = 0; u < kChunkPacks; ++u)
      if (u < n) x[u] = load_pack(src + u * kRowThreads * 8);
#pragma unroll
    for (int u = 0; u < kChunkPacks; ++u) {
      if (u < n) {
        const int64_t offset = target_at - u * kRowThreads * 8;
        const int target_k = static_cast<uint64_t>(offset) < 8 ? static_cast<int>(offset) : -1;
        float v[8];
        unpack(x[u], v);
        PackBF16 g;
#pragma unroll
        for (int k = 0; k < 8; ++k) g.v[k] = __float2bfloat16_rn(grad(v[k], target_k == k));
        g.store(dst + u * kRowThreads * 8);
      }
    }
  }
  for (int64_t i = tail + t; i < width; i += kRowThreads)
    out[i] = __float2bfloat16_rn(grad(__bfloat162float(in[i]), i == local));
}

void check_shape(const CrossEntropyShape& s) {
  REPLAY_REQUIRE(s.rows > 0 && s.vocab_shard > 0, "empty cross-entropy shape");
  REPLAY_REQUIRE(s.rows <= INT_MAX, "rows must fit the grid: " + std::to_string(s.rows));
  REPLAY_REQUIRE(s.vocab_start >= 0, "negative vocab_start");
}

}  // namespace

void cross_entropy_stats(float* stats, const __nv_bfloat16* logits, const int32_t* targets,
                         const CrossEntropyShape& shape, cudaStream_t stream) {
  check_shape(shape);
  cross_entropy_stats_kernel<<<static_cast<unsigned>(shape.rows), kRowThreads, 0, stream>>>(
      stats, logits, targets, shape.rows, shape.vocab_shard, shape.vocab_start);
  REPLAY_LAUNCH_CHECK();
}

void cross_entropy_combine_stats(float* stats, const float* stacked, int shards, int64_t rows,
                                 cudaStream_t stream) {
  REPLAY_REQUIRE(shards > 0 && rows > 0, "empty cross-entropy combine");
  const int64_t blocks = ceil_div<int64_t>(rows, 256);
  REPLAY_REQUIRE(blocks <= INT_MAX, "too many rows");
  cross_entropy_combine_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(stats, stacked,
                                                                                  shards, rows);
  REPLAY_LAUNCH_CHECK();
}

void cross_entropy_loss(float* row_loss, float* mean_loss, int32_t* count, const float* stats,
                        const int32_t* targets, int64_t rows, cudaStream_t stream) {
  REPLAY_REQUIRE(rows > 0 && rows < (int64_t{1} << 24),
                 "rows must be in [1, 2^24) (exact fp32 count): " + std::to_string(rows));
  launch_dependent(cross_entropy_loss_kernel, dim3(1), dim3(kLossThreads), stream, row_loss,
                   mean_loss, count, stats, targets, rows);
  REPLAY_LAUNCH_CHECK();
}

void cross_entropy_backward(__nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* stats,
                            const int32_t* targets, const int32_t* count, const float* dloss,
                            const CrossEntropyShape& shape, cudaStream_t stream) {
  check_shape(shape);
  REPLAY_REQUIRE(
      reinterpret_cast<uintptr_t>(dlogits) % 16 == reinterpret_cast<uintptr_t>(logits) % 16,
      "dlogits and logits must share their 16-byte alignment");
  cross_entropy_backward_kernel<<<static_cast<unsigned>(shape.rows), kRowThreads, 0, stream>>>(
      dlogits, logits, stats, targets, count, dloss, shape.rows, shape.vocab_shard,
      shape.vocab_start);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
