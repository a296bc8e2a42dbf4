// training.cpp: fp64 references for embedding, cross-entropy, AdamW and the gradient norm.
#include "common/reference/training.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace replay::ref {

namespace {
// The row of the local table for a token, or -1 when the token is outside this rank's shard.
int64_t local_row(int32_t token, int64_t vocab_start, int64_t vocab_shard) {
  const int64_t local = static_cast<int64_t>(token) - vocab_start;
  return local >= 0 && local < vocab_shard ? local : -1;
}
}  // namespace

void embedding_forward(double* out, const int32_t* tokens, const double* wte, const double* wpe,
                       const EmbeddingDims& d) {
  const int64_t C = d.channels;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t s = 0; s < d.seq; ++s) {
      const int64_t row = b * d.seq + s;
      const int64_t v = local_row(tokens[row], d.vocab_start, d.vocab_shard);
      for (int64_t c = 0; c < C; ++c) {
        double x = v >= 0 ? wte[v * C + c] : 0.0;
        if (wpe != nullptr) x += wpe[s * C + c];
        out[row * C + c] = x;
      }
    }
  }
}

void embedding_backward(double* dwte, double* dwpe, const double* dout, const int32_t* tokens,
                        const EmbeddingDims& d, bool accumulate) {
  const int64_t C = d.channels;
  if (!accumulate) {
    std::fill(dwte, dwte + d.vocab_shard * C, 0.0);
    if (dwpe != nullptr) std::fill(dwpe, dwpe + d.seq * C, 0.0);
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t s = 0; s < d.seq; ++s) {
      const int64_t row = b * d.seq + s;
      const int64_t v = local_row(tokens[row], d.vocab_start, d.vocab_shard);
      for (int64_t c = 0; c < C; ++c) {
        if (v >= 0) dwte[v * C + c] += dout[row * C + c];
        if (dwpe != nullptr) dwpe[s * C + c] += dout[row * C + c];
      }
    }
  }
}

void cross_entropy_stats(CrossEntropyRowStats* stats, const double* logits, const int32_t* targets,
                         int64_t rows, int64_t vocab_shard, int64_t vocab_start) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* x = logits + r * vocab_shard;
    CrossEntropyRowStats st;
    st.max = *std::max_element(x, x + vocab_shard);
    for (int64_t i = 0; i < vocab_shard; ++i) st.sumexp += std::exp(x[i] - st.max);
    if (targets[r] != kIgnoreIndex) {
      const int64_t v = local_row(targets[r], vocab_start, vocab_shard);
      if (v >= 0) st.target = x[v];
    }
    stats[r] = st;
  }
}

void cross_entropy_combine_stats(CrossEntropyRowStats* stats, const CrossEntropyRowStats* stacked,
                                 int shards, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    CrossEntropyRowStats st;
    st.max = -std::numeric_limits<double>::infinity();
    for (int k = 0; k < shards; ++k) st.max = std::max(st.max, stacked[k * rows + r].max);
    for (int k = 0; k < shards; ++k) {
      const CrossEntropyRowStats& sh = stacked[k * rows + r];
      st.sumexp += sh.sumexp * std::exp(sh.max - st.max);
      st.target += sh.target;
    }
    stats[r] = st;
  }
}

double cross_entropy_loss(double* row_loss, int64_t* count, const CrossEntropyRowStats* stats,
                          const int32_t* targets, int64_t rows) {
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    row_loss[r] = 0.0;
    if (targets[r] == kIgnoreIndex) continue;
    row_loss[r] = std::log(stats[r].sumexp) + stats[r].max - stats[r].target;
    sum += row_loss[r];
    ++n;
  }
  *count = n;
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

void cross_entropy_backward(double* dlogits, const double* logits,
                            const CrossEntropyRowStats* stats, const int32_t* targets,
                            int64_t count, double dloss, int64_t rows, int64_t vocab_shard,
                            int64_t vocab_start) {
  for (int64_t r = 0; r < rows; ++r) {
    double* g = dlogits + r * vocab_shard;
    if (targets[r] == kIgnoreIndex || count == 0) {
      std::fill(g, g + vocab_shard, 0.0);
      continue;
    }
    const double scale = dloss / static_cast<double>(count);
    const int64_t v = local_row(targets[r], vocab_start, vocab_shard);
    for (int64_t i = 0; i < vocab_shard; ++i) {
      const double p = std::exp(logits[r * vocab_shard + i] - stats[r].max) / stats[r].sumexp;
      g[i] = (p - (i == v ? 1.0 : 0.0)) * scale;
    }
  }
}

void adamw_step(double* param, double* exp_avg, double* exp_avg_sq, const double* grad, int64_t n,
                double lr, int64_t step, const AdamWConfig& config, bool apply_weight_decay,
                double grad_scale) {
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(config.beta2, t);
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad[i] * grad_scale;
    if (apply_weight_decay) param[i] *= 1.0 - lr * config.weight_decay;
    exp_avg[i] = config.beta1 * exp_avg[i] + (1.0 - config.beta1) * g;
    exp_avg_sq[i] = config.beta2 * exp_avg_sq[i] + (1.0 - config.beta2) * g * g;
    const double denom = std::sqrt(exp_avg_sq[i]) / std::sqrt(bias_correction2) + config.eps;
    param[i] -= lr / bias_correction1 * exp_avg[i] / denom;
  }
}

double global_grad_norm(const std::vector<std::vector<double>>& grads, double loss_scale) {
  double sum = 0.0;
  for (const auto& g : grads)
    for (double x : g) sum += x * x;
  return std::sqrt(sum) / loss_scale;
}

double clip_coefficient(double norm, double max_norm) {
  return max_norm > 0.0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
}

}  // namespace replay::ref
