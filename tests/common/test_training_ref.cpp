// CPU checks of the training references: cross-entropy and embedding gradients against finite
// differences, vocab-parallel statistics combined equal to the unsharded loss, AdamW against a step
// worked by hand and against torch.optim.AdamW's update written out, and the gradient norm and
// clip.
#include "common/reference/training.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/support/compare.h"

namespace replay {
namespace {

using test::random_normal;
using test::to_double;

// Mean cross-entropy of unsharded logits [rows, vocab].
double mean_loss(const std::vector<double>& logits, const std::vector<int32_t>& targets,
                 int64_t rows, int64_t vocab) {
  std::vector<ref::CrossEntropyRowStats> stats(rows);
  std::vector<double> row_loss(rows);
  int64_t count = 0;
  ref::cross_entropy_stats(stats.data(), logits.data(), targets.data(), rows, vocab, 0);
  return ref::cross_entropy_loss(row_loss.data(), &count, stats.data(), targets.data(), rows);
}

TEST(CrossEntropyRef, GradientMatchesFiniteDifferences) {
  const int64_t rows = 5, vocab = 11;
  std::vector<double> logits = to_double(random_normal(rows * vocab, 1, 0.0f, 2.0f));
  const std::vector<int32_t> targets = {3, ref::kIgnoreIndex, 0, 10, 7};
  const double dloss = 1.7;

  std::vector<ref::CrossEntropyRowStats> stats(rows);
  std::vector<double> row_loss(rows), grad(rows * vocab);
  int64_t count = 0;
  ref::cross_entropy_stats(stats.data(), logits.data(), targets.data(), rows, vocab, 0);
  ref::cross_entropy_loss(row_loss.data(), &count, stats.data(), targets.data(), rows);
  EXPECT_EQ(count, 4);
  ref::cross_entropy_backward(grad.data(), logits.data(), stats.data(), targets.data(), count,
                              dloss, rows, vocab, 0);

  const double h = 1e-5;
  for (int64_t i = 0; i < rows * vocab; ++i) {
    const double x = logits[i];
    logits[i] = x + h;
    const double up = mean_loss(logits, targets, rows, vocab);
    logits[i] = x - h;
    const double down = mean_loss(logits, targets, rows, vocab);
    logits[i] = x;
    const double fd = dloss * (up - down) / (2 * h);
    EXPECT_NEAR(grad[i], fd, 1e-8) << "logit " << i;
  }
  for (int64_t i = 0; i < vocab; ++i) EXPECT_EQ(grad[1 * vocab + i], 0.0);  // the ignored row
}

TEST(CrossEntropyRef, AllRowsIgnoredGivesZeroLossAndGradient) {
  const int64_t rows = 3, vocab = 4;
  const std::vector<double> logits = to_double(random_normal(rows * vocab, 2));
  const std::vector<int32_t> targets(rows, ref::kIgnoreIndex);
  std::vector<ref::CrossEntropyRowStats> stats(rows);
  std::vector<double> row_loss(rows), grad(rows * vocab, 1.0);
  int64_t count = -1;
  ref::cross_entropy_stats(stats.data(), logits.data(), targets.data(), rows, vocab, 0);
  EXPECT_EQ(ref::cross_entropy_loss(row_loss.data(), &count, stats.data(), targets.data(), rows),
            0.0);
  EXPECT_EQ(count, 0);
  ref::cross_entropy_backward(grad.data(), logits.data(), stats.data(), targets.data(), count, 1.0,
                              rows, vocab, 0);
  for (double g : grad) EXPECT_EQ(g, 0.0);
}

// Shards of uneven widths, each given only its own columns, combine to the unsharded statistics,
// loss and gradient.
TEST(CrossEntropyRef, VocabParallelCombineEqualsUnsharded) {
  const int64_t rows = 9, vocab = 50;
  const std::vector<double> logits = to_double(random_normal(rows * vocab, 3, 0.0f, 3.0f));
  const std::vector<int32_t> targets = {0, 12, 13, 25, 49, ref::kIgnoreIndex, 37, 24, 30};

  std::vector<ref::CrossEntropyRowStats> full(rows);
  std::vector<double> full_loss(rows), full_grad(rows * vocab);
  int64_t full_count = 0;
  ref::cross_entropy_stats(full.data(), logits.data(), targets.data(), rows, vocab, 0);
  const double full_mean =
      ref::cross_entropy_loss(full_loss.data(), &full_count, full.data(), targets.data(), rows);
  ref::cross_entropy_backward(full_grad.data(), logits.data(), full.data(), targets.data(),
                              full_count, 1.0, rows, vocab, 0);

  for (const std::vector<int64_t>& widths :
       {std::vector<int64_t>{25, 25}, std::vector<int64_t>{13, 12, 13, 12},
        std::vector<int64_t>{13, 20, 17}}) {
    const int shards = static_cast<int>(widths.size());
    std::vector<ref::CrossEntropyRowStats> stacked(shards * rows), combined(rows);
    std::vector<std::vector<double>> shard_logits(shards);
    std::vector<int64_t> starts(shards, 0);
    for (int k = 1; k < shards; ++k) starts[k] = starts[k - 1] + widths[k - 1];
    for (int k = 0; k < shards; ++k) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < widths[k]; ++i)
          shard_logits[k].push_back(logits[r * vocab + starts[k] + i]);
      ref::cross_entropy_stats(stacked.data() + k * rows, shard_logits[k].data(), targets.data(),
                               rows, widths[k], starts[k]);
    }
    ref::cross_entropy_combine_stats(combined.data(), stacked.data(), shards, rows);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(combined[r].max, full[r].max) << "row " << r;
      EXPECT_NEAR(combined[r].sumexp, full[r].sumexp, 1e-12 * full[r].sumexp) << "row " << r;
      EXPECT_EQ(combined[r].target, full[r].target) << "row " << r;
    }
    std::vector<double> row_loss(rows);
    int64_t count = 0;
    const double mean =
        ref::cross_entropy_loss(row_loss.data(), &count, combined.data(), targets.data(), rows);
    EXPECT_EQ(count, full_count);
    EXPECT_NEAR(mean, full_mean, 1e-12) << shards << " shards";

    for (int k = 0; k < shards; ++k) {
      std::vector<double> grad(rows * widths[k]);
      ref::cross_entropy_backward(grad.data(), shard_logits[k].data(), combined.data(),
                                  targets.data(), count, 1.0, rows, widths[k], starts[k]);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < widths[k]; ++i)
          EXPECT_NEAR(grad[r * widths[k] + i], full_grad[r * vocab + starts[k] + i], 1e-14);
    }
  }
}

TEST(EmbeddingRef, ForwardGathersShardRowsAndAddsPositions) {
  const ref::EmbeddingDims d{1, 3, 2, 10, 4};  // shard holds tokens 10..13
  const std::vector<int32_t> tokens = {11, 3, 13};
  const std::vector<double> wte = {0, 1, 10, 11, 20, 21, 30, 31};
  const std::vector<double> wpe = {0.5, 0.25, 1.5, 1.25, 2.5, 2.25};
  std::vector<double> out(6);
  ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), d);
  EXPECT_EQ(out, (std::vector<double>{10.5, 11.25, 1.5, 1.25, 32.5, 33.25}));
  ref::embedding_forward(out.data(), tokens.data(), wte.data(), nullptr, d);
  EXPECT_EQ(out, (std::vector<double>{10, 11, 0, 0, 30, 31}));
}

// J = sum(out * R): the backward with dout = R must equal dJ/dwte and dJ/dwpe by central
// differences.
TEST(EmbeddingRef, BackwardMatchesFiniteDifferences) {
  const ref::EmbeddingDims d{2, 5, 3, 4, 6};  // shard holds tokens 4..9
  const std::vector<int32_t> tokens = {4, 9, 2, 4, 7, 5, 4, 12, 9, 0};
  std::vector<double> wte = to_double(random_normal(d.vocab_shard * d.channels, 4));
  std::vector<double> wpe = to_double(random_normal(d.seq * d.channels, 5));
  const std::vector<double> r = to_double(random_normal(d.batch * d.seq * d.channels, 6));
  auto objective = [&]() {
    std::vector<double> out(r.size());
    ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), d);
    double j = 0.0;
    for (size_t i = 0; i < out.size(); ++i) j += out[i] * r[i];
    return j;
  };
  std::vector<double> dwte(wte.size()), dwpe(wpe.size());
  ref::embedding_backward(dwte.data(), dwpe.data(), r.data(), tokens.data(), d, false);

  const double h = 1e-4;
  for (std::vector<double>* table : {&wte, &wpe}) {
    const std::vector<double>& grad = table == &wte ? dwte : dwpe;
    for (size_t i = 0; i < table->size(); ++i) {
      const double x = (*table)[i];
      (*table)[i] = x + h;
      const double up = objective();
      (*table)[i] = x - h;
      const double down = objective();
      (*table)[i] = x;
      EXPECT_NEAR(grad[i], (up - down) / (2 * h), 1e-9) << (table == &wte ? "wte " : "wpe ") << i;
    }
  }
  // Tokens 6 and 8 do not occur: their rows are zero, not left as they were.
  for (int64_t c = 0; c < d.channels; ++c) {
    EXPECT_EQ(dwte[2 * d.channels + c], 0.0);
    EXPECT_EQ(dwte[4 * d.channels + c], 0.0);
  }

  // accumulate = true adds onto what is there (tied embeddings).
  std::vector<double> acc_wte = to_double(random_normal(wte.size(), 7)), acc_wpe(wpe.size(), 0.5);
  const std::vector<double> before = acc_wte;
  ref::embedding_backward(acc_wte.data(), acc_wpe.data(), r.data(), tokens.data(), d, true);
  for (size_t i = 0; i < acc_wte.size(); ++i) EXPECT_NEAR(acc_wte[i], before[i] + dwte[i], 1e-14);
  for (size_t i = 0; i < acc_wpe.size(); ++i) EXPECT_NEAR(acc_wpe[i], 0.5 + dwpe[i], 1e-14);
}

// One parameter, two steps, every number worked by hand:
//   step 1: g = 1.0 * 0.5 (grad scale); p = 1 * (1 - 0.1 * 0.01) = 0.999; m = 0.05; v = 0.00025;
//           step size = 0.1 / (1 - 0.9) = 1;
//           denom = sqrt(0.00025) / sqrt(0.001) + 1e-8 = 0.5 + 1e-8;
//           p = 0.999 - 0.05 / (0.5 + 1e-8) = 0.899000002
//   step 2 (no weight decay): g = -0.25; m = 0.045 - 0.025 = 0.02; v = 0.00024975 + 0.0000625 =
//           0.00031225; step size = 0.1 / 0.19; denom = sqrt(0.00031225 / 0.001999) + 1e-8;
//           p = 0.899000002 - 0.02 * (0.1 / 0.19) / denom = 0.8723662987078463
TEST(AdamWRef, HandComputedSteps) {
  const ref::AdamWConfig config{0.9, 0.999, 1e-8, 0.01};
  double p = 1.0, m = 0.0, v = 0.0;
  const double g1 = 1.0, g2 = -0.25;
  ref::adamw_step(&p, &m, &v, &g1, 1, 0.1, 1, config, true, 0.5);
  EXPECT_NEAR(m, 0.05, 1e-16);
  EXPECT_NEAR(v, 0.00025, 1e-18);
  EXPECT_NEAR(p, 0.899000002, 1e-15);
  ref::adamw_step(&p, &m, &v, &g2, 1, 0.1, 2, config, false, 1.0);
  EXPECT_NEAR(m, 0.02, 1e-16);
  EXPECT_NEAR(v, 0.00031225, 1e-18);
  EXPECT_NEAR(p, 0.8723662987078463, 1e-14);
}

// torch.optim.AdamW's single-tensor update, line for line:
//   param.mul_(1 - lr * weight_decay)
//   exp_avg.lerp_(grad, 1 - beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   step_size = lr / (1 - beta1 ** step)
//   denom = (exp_avg_sq.sqrt() / sqrt(1 - beta2 ** step)).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)
// and Megatron/apex's form: p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p).
TEST(AdamWRef, MatchesTorchAndApexFormsOverSteps) {
  const int64_t n = 64;
  const double lr = 3e-4;
  const ref::AdamWConfig config{0.9, 0.95, 1e-8, 0.1};
  for (bool decay : {true, false}) {
    std::vector<double> p = to_double(random_normal(n, 8)), m(n, 0.0), v(n, 0.0);
    std::vector<double> tp = p, tm = m, tv = v;  // torch form
    std::vector<double> ap = p, am = m, av = v;  // apex form
    for (int64_t step = 1; step <= 6; ++step) {
      const std::vector<double> grad = to_double(random_normal(n, 100 + step));
      ref::adamw_step(p.data(), m.data(), v.data(), grad.data(), n, lr, step, config, decay, 1.0);
      const double wd = decay ? config.weight_decay : 0.0;
      for (int64_t i = 0; i < n; ++i) {
        tp[i] *= 1 - lr * wd;
        tm[i] += (grad[i] - tm[i]) * (1 - config.beta1);
        tv[i] = tv[i] * config.beta2 + (1 - config.beta2) * grad[i] * grad[i];
        const double step_size = lr / (1 - std::pow(config.beta1, step));
        const double denom =
            std::sqrt(tv[i]) / std::sqrt(1 - std::pow(config.beta2, step)) + config.eps;
        tp[i] += -step_size * tm[i] / denom;

        am[i] = config.beta1 * am[i] + (1 - config.beta1) * grad[i];
        av[i] = config.beta2 * av[i] + (1 - config.beta2) * grad[i] * grad[i];
        const double m_hat = am[i] / (1 - std::pow(config.beta1, step));
        const double v_hat = av[i] / (1 - std::pow(config.beta2, step));
        ap[i] -= lr * (m_hat / (std::sqrt(v_hat) + config.eps) + wd * ap[i]);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(p[i], tp[i], 1e-13) << i;
      EXPECT_NEAR(m[i], tm[i], 1e-14) << i;
      EXPECT_NEAR(v[i], tv[i], 1e-14) << i;
      EXPECT_NEAR(p[i], ap[i], 1e-12) << i;  // equal in exact arithmetic, rounded differently
    }
  }
}

TEST(GradNormRef, KnownNormsAndClip) {
  EXPECT_DOUBLE_EQ(ref::global_grad_norm({{3.0, 4.0}, {12.0}}), 13.0);
  // The same gradients scaled by a loss scale of 4: the norm is of the unscaled gradients.
  EXPECT_DOUBLE_EQ(ref::global_grad_norm({{12.0, 16.0}, {48.0}}, 4.0), 13.0);
  EXPECT_DOUBLE_EQ(ref::clip_coefficient(13.0, 1.0), 1.0 / (13.0 + 1e-6));
  EXPECT_DOUBLE_EQ(ref::clip_coefficient(13.0, 100.0), 1.0);
  EXPECT_DOUBLE_EQ(ref::clip_coefficient(13.0, 0.0), 1.0);  // clipping off
}

}  // namespace
}  // namespace replay
