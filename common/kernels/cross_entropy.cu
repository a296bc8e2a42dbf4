// cross_entropy.cu: vocab-parallel softmax cross-entropy: shard stats, combine, loss, backward.
#include "common/kernels/cross_entropy.h"

#include <algorithm>
#include <climits>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // PackBF16, warp and block reductions
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

// Backward: one block per row of logits. A thread takes kChunkPacks 16-byte packs per chunk
// (packs t, t + T, ...), issues all of their loads before it uses any, then works on them: 256
// threads x 8 packs cover 16384 logits, so a GPT-3 shard row (12576 logits, 25 KB) is one chunk,
// and an SM with four such blocks has ~100 KB of loads in flight. Rows wider than a chunk take
// several. The logits are read with streaming loads and the gradient packs written with streaming
// stores, because streaming loads with plain stores are the slowest pairing (measured:
// reports/RESULTS.md, Cache hints for the streaming kernels).
constexpr int kRowThreads = 256;
constexpr int kChunkPacks = 8;
constexpr int kRowBlocksPerSM = 4;  // register cap (64) for four rows in flight per SM

// Statistics: one block per row too, sized to the row: T threads (a multiple of 32, at most 512)
// take kP packs each, T * kP just covering the row. The missing packs are loaded as -inf pairs, so
// the loop has no branch (exp2(-inf) adds 0). kP is 4, 5 or 8, whichever pads least (GPT-3's
// 1572-pack shard row: 5 x 320 threads, 28 padded; Llama's 2004: 8 x 256, 44). At 40 registers
// (kP <= 5) five such blocks share an SM, 1600 threads with up to 125 KB of loads in flight,
// where 256 threads of 8 packs ran four (1024 threads, 100 KB): more loads in flight, and a faster
// kernel for about as many instructions (measured: reports/RESULTS.md, The cross-entropy forward).
constexpr int kStatsMaxThreads = 512;
constexpr int kMeanThreads = 512;  // the single block that sums the row losses

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

// Two bf16 pairs' element-wise max (exact: the max of bf16 values is one of them).
__device__ __forceinline__ uint32_t max_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

constexpr uint32_t kNegInfPair = 0xff80ff80u;  // two bf16 -inf

// Merges the (max, sum of exp(x - max)) pairs of a warp's lanes; every lane receives the result.
// A pair with max -inf (no logits) adds nothing.
__device__ __forceinline__ float2 warp_merge_stats(float m, float s) {
  const float max = warp_reduce_max(m);
  return make_float2(
      max, warp_reduce_sum(max == -INFINITY ? 0.0f : s * exp2_approx((m - max) * kLog2e)));
}

// A row loss: (max - target) first, both large and close; the log-sum is small.
__device__ __forceinline__ float row_loss_of(float max, float sum, float target_logit) {
  return (max - target_logit) + logf(sum);
}

// Logit k (0..7) of a pack.
__device__ __forceinline__ float pack_element(uint4 w, int k) {
  const uint32_t word = k < 4 ? (k < 2 ? w.x : w.y) : (k < 6 ? w.z : w.w);
  return __uint_as_float(k % 2 ? word & 0xffff0000u : word << 16);
}

// Per chunk of kP packs a thread: the max over all of them on bf16 pairs, one rescale of the
// running sum, then exp2(x * log2e - max * log2e) for every logit, independent of each other,
// into four partial sums. Then the row's max and sum, and (if row_loss) the row's loss.
//
// Every thread loads the row's target with its packs (one broadcast a warp), and the thread that
// holds the target's logit in its registers leaves it in shared memory: a separate load of that
// logit must wait for the target, two memory latencies in a row that the block's barrier then
// waits for (measured: reports/RESULTS.md, The cross-entropy forward).
template <int kP>
__global__ void __launch_bounds__(kStatsMaxThreads, kP <= 5 ? 3 : 2)
    cross_entropy_stats_kernel(float* __restrict__ stats, float* __restrict__ row_loss,
                               const __nv_bfloat16* __restrict__ logits,
                               const int32_t* __restrict__ targets, int64_t rows, int64_t width,
                               int64_t vocab_start) {
  __shared__ float2 warp_stats[kStatsMaxThreads / 32];
  __shared__ float target_logit_held;  // written by the one thread that holds it, if any
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x, T = blockDim.x, lane = t % 32, warp = t / 32;
  const __nv_bfloat16* row = logits + r * width;
  const int64_t head = unaligned_head(row, width);
  const int64_t packs = (width - head) / 8;
  const int64_t tail = head + packs * 8;

  const int32_t target = targets[r];
  const int64_t local = static_cast<int64_t>(target) - vocab_start;
  const bool held = target != kCrossEntropyIgnoreIndex && local >= 0 && local < width;
  // The body pack holding the target, if one does (-1 otherwise), and the logit's place in it.
  const int64_t target_pack = held && local >= head && local < tail ? (local - head) / 8 : -1;
  const int target_k = static_cast<int>((local - head) % 8);
  auto take = [&](int64_t i, float x) {
    if (i == local) target_logit_held = x;
  };

  float m = -INFINITY, s = 0.0f;
  for (int64_t i = t; i < head; i += T) {
    const float x = __bfloat162float(row[i]);
    take(i, x);
    online_add(m, s, x);
  }
  const uint4* body = reinterpret_cast<const uint4*>(row + head);
  // Chunks of kP * T packs; base is this thread's first pack of one, base - t the chunk's start.
  for (int64_t base = t; base < packs + t; base += int64_t{kP} * T) {
    uint4 x[kP];
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      const int64_t p = base + i * T;
      x[i] = p < packs ? __ldcs(body + p)
                       : make_uint4(kNegInfPair, kNegInfPair, kNegInfPair, kNegInfPair);
    }
#pragma unroll
    for (int i = 0; i < kP; ++i)
      if (base + i * T == target_pack) target_logit_held = pack_element(x[i], target_k);
    uint32_t pair = kNegInfPair;
#pragma unroll
    for (int i = 0; i < kP; ++i)
      pair = max_bf16x2(pair, max_bf16x2(max_bf16x2(x[i].x, x[i].y), max_bf16x2(x[i].z, x[i].w)));
    const float chunk_max = fmaxf(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
    const float m_new = fmaxf(m, chunk_max);
    if (m_new != m) s *= exp2_approx((m - m_new) * kLog2e);  // s is 0 while m is -inf
    m = m_new;
    const float m_log2 = m == -INFINITY ? 0.0f : m * kLog2e;  // all -inf: every term is 0
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      float v[8];
      unpack(x[i], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sums[k % 4] += exp2_approx(fmaf(v[k], kLog2e, -m_log2));
    }
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
  for (int64_t i = tail + t; i < width; i += T) {
    const float x = __bfloat162float(row[i]);
    take(i, x);
    online_add(m, s, x);
  }

  // Each warp's (max, sum), then warp 0 combines the warps': one barrier.
  const float2 warp_stat = warp_merge_stats(m, s);
  if (lane == 0) warp_stats[warp] = warp_stat;
  __syncthreads();
  if (warp != 0) return;
  const float2 w = lane < T / 32 ? warp_stats[lane] : make_float2(-INFINITY, 0.0f);
  const float2 row_stat = warp_merge_stats(w.x, w.y);
  const float row_max = row_stat.x, row_sum = row_stat.y;
  if (lane == 0) {
    const float target_logit = held ? target_logit_held : 0.0f;  // 0 where another shard holds it
    stats[r] = row_max;
    stats[rows + r] = row_sum;
    stats[2 * rows + r] = target_logit;
    if (row_loss != nullptr)
      row_loss[r] =
          target == kCrossEntropyIgnoreIndex ? 0.0f : row_loss_of(row_max, row_sum, target_logit);
  }
}

// One thread per row; shards combined in rank order.
__global__ void cross_entropy_combine_kernel(float* __restrict__ stats,
                                             const float* __restrict__ stacked, int shards,
                                             int64_t rows) {
  allow_dependent_launch();
  wait_for_previous_grid();
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

// The sum of loss(r) and the count of counted rows over all rows, in a fixed order: thread t adds
// rows t, t + T, t + 2T, t + 3T as a pair of pairs, then the next four, then the block adds the
// threads'. Every row's loads are issued before any is used (one L2 round trip for the lot).
// Both kernels below use it, so the mean of cross_entropy_forward and of cross_entropy_loss have
// the same bits whenever their row losses do.
template <typename RowLoss>
__device__ __forceinline__ void sum_row_losses(float* mean_loss, int32_t* count, int64_t rows,
                                               const int32_t* targets, RowLoss loss) {
  __shared__ float scratch[32];
  constexpr int kU = 4;
  float sum = 0.0f, counted = 0.0f;
  for (int64_t base = threadIdx.x; base < rows; base += kU * kMeanThreads) {
    float l[kU], c[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t r = base + u * kMeanThreads;
      const bool counts = r < rows && targets[r] != kCrossEntropyIgnoreIndex;
      l[u] = r < rows ? loss(r, counts) : 0.0f;
      c[u] = counts ? 1.0f : 0.0f;
    }
    sum += (l[0] + l[1]) + (l[2] + l[3]);
    counted += (c[0] + c[1]) + (c[2] + c[3]);
  }
  sum = block_reduce_sum(sum, scratch);
  counted = block_reduce_sum(counted, scratch);  // exact: rows < 2^24
  if (threadIdx.x == 0) {
    *count = static_cast<int32_t>(counted);
    *mean_loss = counted > 0.0f ? sum / counted : 0.0f;
  }
}

// Programmatic dependents of the kernel before them (the statistics, or their combine): placed
// while that one drains, they wait for it and then cost about one L2 round trip and a block
// reduction. The loss forms each row's loss from the statistics; the mean reads the row losses
// the statistics kernel wrote.
__global__ void __launch_bounds__(kMeanThreads)
    cross_entropy_loss_kernel(float* __restrict__ row_loss, float* __restrict__ mean_loss,
                              int32_t* __restrict__ count, const float* __restrict__ stats,
                              const int32_t* __restrict__ targets, int64_t rows) {
  allow_dependent_launch();
  wait_for_previous_grid();
  sum_row_losses(mean_loss, count, rows, targets, [&](int64_t r, bool counts) {
    const float loss = row_loss_of(stats[r], stats[rows + r], stats[2 * rows + r]);
    row_loss[r] = counts ? loss : 0.0f;
    return counts ? loss : 0.0f;
  });
}

__global__ void __launch_bounds__(kMeanThreads)
    cross_entropy_mean_kernel(float* __restrict__ mean_loss, int32_t* __restrict__ count,
                              const float* __restrict__ row_loss,
                              const int32_t* __restrict__ targets, int64_t rows) {
  allow_dependent_launch();
  wait_for_previous_grid();
  sum_row_losses(mean_loss, count, rows, targets,
                 [&](int64_t r, bool) { return row_loss[r]; });  // 0 where ignored
}

__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSM) cross_entropy_backward_kernel(
    __nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* __restrict__ stats,
    const int32_t* __restrict__ targets, const int32_t* __restrict__ count,
    const float* __restrict__ dloss, int64_t rows, int64_t width, int64_t vocab_start) {
  allow_dependent_launch();
  wait_for_previous_grid();
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
        g.store_cs(dst + u * kRowThreads * 8);
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

void check_rows_for_mean(int64_t rows) {
  REPLAY_REQUIRE(rows > 0 && rows < (int64_t{1} << 24),
                 "rows must be in [1, 2^24) (exact fp32 count): " + std::to_string(rows));
}

// Packs a thread (4, 5 or 8) and threads a block for a row of `packs` 16-byte packs: the choice
// that pads the row least, the larger on a tie. A row wider than 512 * kP packs takes several
// chunks of 512 * kP.
struct StatsLaunch {
  int packs_per_thread, threads;
};

StatsLaunch stats_launch(int64_t packs) {
  StatsLaunch best{0, 0};
  int64_t best_pad = 0;
  for (int kp : {8, 5, 4}) {
    const int64_t threads = std::min<int64_t>(
        kStatsMaxThreads,
        std::max<int64_t>(32, ceil_div<int64_t>(ceil_div<int64_t>(packs, kp), 32) * 32));
    const int64_t covered = threads * kp,
                  chunks = ceil_div<int64_t>(std::max<int64_t>(packs, 1), covered);
    const int64_t pad = chunks * covered - packs;
    if (best.threads == 0 || pad < best_pad) {
      best = {kp, static_cast<int>(threads)};
      best_pad = pad;
    }
  }
  return best;
}

void launch_stats(float* stats, float* row_loss, const __nv_bfloat16* logits,
                  const int32_t* targets, const CrossEntropyShape& shape, cudaStream_t stream) {
  check_shape(shape);
  const StatsLaunch l = stats_launch(shape.vocab_shard / 8);
  const dim3 grid(static_cast<unsigned>(shape.rows)), block(l.threads);
  const auto launch = [&](auto kernel) {
    launch_dependent(kernel, grid, block, stream, stats, row_loss, logits, targets, shape.rows,
                     shape.vocab_shard, shape.vocab_start);
  };
  switch (l.packs_per_thread) {
    case 8:
      launch(cross_entropy_stats_kernel<8>);
      break;
    case 5:
      launch(cross_entropy_stats_kernel<5>);
      break;
    default:
      launch(cross_entropy_stats_kernel<4>);
      break;
  }
  REPLAY_LAUNCH_CHECK();
}

}  // namespace

void cross_entropy_stats(float* stats, const __nv_bfloat16* logits, const int32_t* targets,
                         const CrossEntropyShape& shape, cudaStream_t stream) {
  launch_stats(stats, nullptr, logits, targets, shape, stream);
}

void cross_entropy_forward(float* stats, float* row_loss, float* mean_loss, int32_t* count,
                           const __nv_bfloat16* logits, const int32_t* targets,
                           const CrossEntropyShape& shape, cudaStream_t stream) {
  check_rows_for_mean(shape.rows);
  launch_stats(stats, row_loss, logits, targets, shape, stream);
  launch_dependent(cross_entropy_mean_kernel, dim3(1), dim3(kMeanThreads), stream, mean_loss, count,
                   row_loss, targets, shape.rows);
  REPLAY_LAUNCH_CHECK();
}

void cross_entropy_combine_stats(float* stats, const float* stacked, int shards, int64_t rows,
                                 cudaStream_t stream) {
  REPLAY_REQUIRE(shards > 0 && rows > 0, "empty cross-entropy combine");
  const int64_t blocks = ceil_div<int64_t>(rows, 256);
  REPLAY_REQUIRE(blocks <= INT_MAX, "too many rows");
  launch_dependent(cross_entropy_combine_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256),
                   stream, stats, stacked, shards, rows);
  REPLAY_LAUNCH_CHECK();
}

void cross_entropy_loss(float* row_loss, float* mean_loss, int32_t* count, const float* stats,
                        const int32_t* targets, int64_t rows, cudaStream_t stream) {
  check_rows_for_mean(rows);
  launch_dependent(cross_entropy_loss_kernel, dim3(1), dim3(kMeanThreads), stream, row_loss,
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
  launch_dependent(cross_entropy_backward_kernel, dim3(static_cast<unsigned>(shape.rows)),
                   dim3(kRowThreads), stream, dlogits, logits, stats, targets, count, dloss,
                   shape.rows, shape.vocab_shard, shape.vocab_start);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
