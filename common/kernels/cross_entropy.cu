// cross_entropy.cu: vocab-parallel softmax cross-entropy: shard stats, combine, loss, backward.
#include "common/kernels/cross_entropy.h"

#include <climits>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // PackBF16, block_reduce_sum, block_reduce_max

namespace replay {
namespace {

constexpr int kRowThreads = 256;    // one block per row of logits
constexpr int kLossThreads = 1024;  // the single block of the loss reduction

// A row of logits is read as a scalar head up to the first 16-byte boundary, a body of 8-wide packs
// and a scalar tail, so any vocabulary width (and any row start) gets 16-byte accesses for the
// bulk.
__device__ __forceinline__ int64_t unaligned_head(const __nv_bfloat16* row, int64_t width) {
  const int64_t past = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16) / 2;
  return past == 0 ? 0 : min(width, 8 - past);
}

// Online softmax statistics: m is the running max, s the sum of exp(x - m).
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_stats_kernel(float* __restrict__ stats, const __nv_bfloat16* __restrict__ logits,
                               const int32_t* __restrict__ targets, int64_t rows, int64_t width,
                               int64_t vocab_start) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const __nv_bfloat16* row = logits + r * width;
  const int64_t head = unaligned_head(row, width);
  const int64_t packs = (width - head) / 8;
  const int64_t tail = head + packs * 8;

  float m = -INFINITY, s = 0.0f;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x)
    online_add(m, s, __bfloat162float(row[i]));
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const PackBF16 x = PackBF16::load(row + head + p * 8);
    float v[8], pack_max = -INFINITY;
    for (int k = 0; k < 8; ++k) {
      v[k] = __bfloat162float(x.v[k]);
      pack_max = fmaxf(pack_max, v[k]);
    }
    const float m_new = fmaxf(m, pack_max);
    s *= expf(m - m_new);  // 0 while m is still -inf
    for (int k = 0; k < 8; ++k) s += expf(v[k] - m_new);
    m = m_new;
  }
  for (int64_t i = tail + threadIdx.x; i < width; i += blockDim.x)
    online_add(m, s, __bfloat162float(row[i]));

  // Combine the threads: the row max first, then each thread's sum rescaled to it.
  const float row_max = block_reduce_max(m, scratch);
  const float row_sum = block_reduce_sum(m == -INFINITY ? 0.0f : s * expf(m - row_max), scratch);
  if (threadIdx.x == 0) {
    const int32_t target = targets[r];
    const int64_t local = static_cast<int64_t>(target) - vocab_start;
    const bool here = target != kCrossEntropyIgnoreIndex && local >= 0 && local < width;
    stats[r] = row_max;
    stats[rows + r] = row_sum;
    stats[2 * rows + r] = here ? __bfloat162float(row[local]) : 0.0f;
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

__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_loss_kernel(float* __restrict__ row_loss, float* __restrict__ mean_loss,
                              int32_t* __restrict__ count, const float* __restrict__ stats,
                              const int32_t* __restrict__ targets, int64_t rows) {
  __shared__ float scratch[32];
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

__global__ void __launch_bounds__(kRowThreads) cross_entropy_backward_kernel(
    __nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* __restrict__ stats,
    const int32_t* __restrict__ targets, const int32_t* __restrict__ count,
    const float* __restrict__ dloss, int64_t rows, int64_t width, int64_t vocab_start) {
  const int64_t r = blockIdx.x;
  const int32_t target = targets[r];
  const int counted = *count;
  const bool ignored = target == kCrossEntropyIgnoreIndex || counted == 0;
  const float scale = ignored ? 0.0f : *dloss / static_cast<float>(counted);
  const float row_max = stats[r], inv_sum = 1.0f / stats[rows + r];
  const int64_t local = static_cast<int64_t>(target) - vocab_start;  // may lie outside this shard
  const __nv_bfloat16* in = logits + r * width;
  __nv_bfloat16* out = dlogits + r * width;
  auto grad = [&](int64_t i, float x) {
    const float p = expf(x - row_max) * inv_sum;
    return ignored ? 0.0f : (p - (i == local ? 1.0f : 0.0f)) * scale;
  };

  const int64_t head = unaligned_head(in, width);
  const int64_t packs = (width - head) / 8;
  const int64_t tail = head + packs * 8;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x)
    out[i] = __float2bfloat16_rn(grad(i, __bfloat162float(in[i])));
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const int64_t i0 = head + p * 8;
    const PackBF16 x = PackBF16::load(in + i0);
    PackBF16 g;
    for (int k = 0; k < 8; ++k)
      g.v[k] = __float2bfloat16_rn(grad(i0 + k, __bfloat162float(x.v[k])));
    g.store(out + i0);
  }
  for (int64_t i = tail + threadIdx.x; i < width; i += blockDim.x)
    out[i] = __float2bfloat16_rn(grad(i, __bfloat162float(in[i])));
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
  cross_entropy_loss_kernel<<<1, kLossThreads, 0, stream>>>(row_loss, mean_loss, count, stats,
                                                            targets, rows);
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
