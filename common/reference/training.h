// training.h: fp64 CPU references for the training kernels: token + position embedding (forward and
// backward), vocab-parallel cross-entropy (shard statistics, combine, loss, gradient), one AdamW
// step and the global gradient norm with its clip coefficient. Plain loops, written for clarity,
// not speed.
#pragma once

#include <cstdint>
#include <vector>

namespace replay::ref {

// ---- embedding: this rank holds token rows [vocab_start, vocab_start + vocab_shard) ----------

struct EmbeddingDims {
  int64_t batch = 0, seq = 0, channels = 0;
  int64_t vocab_start = 0, vocab_shard = 0;
};

// out[b, s, :] = wte[tokens[b, s] - vocab_start] (zero outside the shard) + wpe[s] (wpe nullable).
void embedding_forward(double* out, const int32_t* tokens, const double* wte, const double* wpe,
                       const EmbeddingDims& d);

// dwte[v, :] (+)= sum of dout over the positions holding token vocab_start + v; dwpe[s, :] (+)= sum
// of dout[:, s, :] over the batch (dwpe may be null). accumulate = false overwrites.
void embedding_backward(double* dwte, double* dwpe, const double* dout, const int32_t* tokens,
                        const EmbeddingDims& d, bool accumulate);

// ---- cross-entropy over logits [rows, vocab_shard] of columns [vocab_start, +vocab_shard) ----

constexpr int32_t kIgnoreIndex = -1;

struct CrossEntropyRowStats {
  double max = 0.0;     // max logit of the row (in this shard)
  double sumexp = 0.0;  // sum of exp(logit - max)
  double target = 0.0;  // the target's logit when it lies in this shard, else 0
};

void cross_entropy_stats(CrossEntropyRowStats* stats, const double* logits, const int32_t* targets,
                         int64_t rows, int64_t vocab_shard, int64_t vocab_start);

// stacked: [shards][rows] statistics of disjoint shards covering the vocabulary.
void cross_entropy_combine_stats(CrossEntropyRowStats* stats, const CrossEntropyRowStats* stacked,
                                 int shards, int64_t rows);

// Writes each row's loss (0 for ignored rows) and the number of counted rows; returns the mean loss
// over counted rows (0 when none).
double cross_entropy_loss(double* row_loss, int64_t* count, const CrossEntropyRowStats* stats,
                          const int32_t* targets, int64_t rows);

// dlogits = (softmax - onehot(target)) * dloss / count, zero on ignored rows; stats of the whole
// vocabulary.
void cross_entropy_backward(double* dlogits, const double* logits,
                            const CrossEntropyRowStats* stats, const int32_t* targets,
                            int64_t count, double dloss, int64_t rows, int64_t vocab_shard,
                            int64_t vocab_start);

// ---- optimizer -------------------------------------------------------------------------------

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

// One torch.optim.AdamW step (t = step >= 1) on n elements; grad is multiplied by grad_scale first.
void adamw_step(double* param, double* exp_avg, double* exp_avg_sq, const double* grad, int64_t n,
                double lr, int64_t step, const AdamWConfig& config, bool apply_weight_decay,
                double grad_scale);

// sqrt(sum of squares over every tensor) / loss_scale.
double global_grad_norm(const std::vector<std::vector<double>>& grads, double loss_scale = 1.0);

// min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; 1 when max_norm <= 0.
double clip_coefficient(double norm, double max_norm);

}  // namespace replay::ref
