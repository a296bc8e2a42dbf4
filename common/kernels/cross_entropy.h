// cross_entropy.h: fused softmax cross-entropy over vocab-parallel bf16 logits, split so that
// tensor parallelism slots in between the steps: per-row statistics of this shard, a combine of
// several shards' statistics, the loss (per row and the mean as a device scalar), and the fused
// backward.
//
//   TP = 1:  cross_entropy_stats -> cross_entropy_loss -> ... -> cross_entropy_backward
//   TP = n:  cross_entropy_stats -> all-gather of the stats (outside)
//            -> cross_entropy_combine_stats -> cross_entropy_loss -> ...
//            -> cross_entropy_backward (with the combined stats)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace replay {

// Targets equal to this contribute no loss and no gradient and are not counted in the mean.
constexpr int32_t kCrossEntropyIgnoreIndex = -1;

// Logits [rows, vocab_shard], row-major and contiguous; this rank holds vocabulary columns
// [vocab_start, vocab_start + vocab_shard). Any width is supported (no multiple-of-8 requirement).
struct CrossEntropyShape {
  int64_t rows = 0;
  int64_t vocab_shard = 0;
  int64_t vocab_start = 0;
};

// Row statistics are fp32 structure-of-arrays of 3 * rows floats: the row max [rows], then the sum
// of exp(logit - max) [rows], then the target's logit [rows] (0 where the target is not in this
// shard or is ignored).
constexpr int64_t cross_entropy_stats_floats(int64_t rows) {
  return 3 * rows;
}

// stats: this shard's row statistics. targets: int32 [rows], global vocabulary ids or the ignore
// index.
void cross_entropy_stats(float* stats, const __nv_bfloat16* logits, const int32_t* targets,
                         const CrossEntropyShape& shape, cudaStream_t stream);

// Without tensor parallelism: the statistics, the row losses, their mean and the count from this
// shard's vocabulary alone, bit for bit what cross_entropy_stats then cross_entropy_loss give. The
// statistics kernel also writes each row's loss, so the one-block programmatic dependent that
// sums them reads one float a row rather than the statistics' three.
void cross_entropy_forward(float* stats, float* row_loss, float* mean_loss, int32_t* count,
                           const __nv_bfloat16* logits, const int32_t* targets,
                           const CrossEntropyShape& shape, cudaStream_t stream);

// Combines `shards` stacked statistics [shards][3 * rows] (what an all-gather of every rank's stats
// produces, in rank order) into the statistics of the whole vocabulary [3 * rows]. Fixed order.
void cross_entropy_combine_stats(float* stats, const float* stacked, int shards, int64_t rows,
                                 cudaStream_t stream);

// row_loss[r] = log(sumexp) + max - target_logit (0 for ignored rows); mean_loss[0] = the mean over
// the counted rows (0 when none); count[0] = the number of counted rows. One block, fixed-order
// sums.
void cross_entropy_loss(float* row_loss, float* mean_loss, int32_t* count, const float* stats,
                        const int32_t* targets, int64_t rows, cudaStream_t stream);

// dlogits = (softmax(logits) - onehot(target)) * dloss[0] / count[0], bf16; zero on ignored rows.
// stats are the whole vocabulary's (combined) statistics; dloss is 1 normally, the loss scale under
// fp16. dlogits may alias logits (in place); otherwise both must have the same 16-byte
// misalignment.
void cross_entropy_backward(__nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* stats,
                            const int32_t* targets, const int32_t* count, const float* dloss,
                            const CrossEntropyShape& shape, cudaStream_t stream);

}  // namespace replay
