// reference_util.cpp: the pieces the fp64 GPT and Llama reference models and their tests share.
#include "tests/workloads/reference_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/reference/gemm.h"

namespace replay::test {

Vec run_gemm(const GemmDesc& g, const Vec& a, const Vec& b, const double* bias,
             const double* aux_in, double* aux_out, double* bias_grad) {
  Vec d(static_cast<size_t>(g.m * g.n));
  ref::GemmRefArgs args;
  args.a = a.data();
  args.b = b.data();
  args.bias = bias;
  args.aux_in = aux_in;
  args.d = d.data();
  args.aux_out = aux_out;
  args.bias_grad = bias_grad;
  ref::gemm(g, args);
  return d;
}

reference::AttentionShape causal_attention_shape(int64_t batch, int64_t seq, int64_t heads_q,
                                                 int64_t heads_kv, int64_t head_dim) {
  reference::AttentionShape s;
  s.batch = batch;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.seq_q = s.seq_kv = seq;
  s.dim_qk = s.dim_v = head_dim;
  s.causal = true;
  s.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  return s;
}

ref::EmbeddingDims embedding_dims(int64_t batch, int64_t seq, int64_t hidden, int64_t vocab) {
  ref::EmbeddingDims e;
  e.batch = batch;
  e.seq = seq;
  e.channels = hidden;
  e.vocab_start = 0;
  e.vocab_shard = vocab;
  return e;
}

CrossEntropy cross_entropy(const Vec& logits, const int32_t* targets, int64_t rows, int64_t vocab) {
  CrossEntropy ce;
  ce.stats.resize(static_cast<size_t>(rows));
  ref::cross_entropy_stats(ce.stats.data(), logits.data(), targets, rows, vocab, 0);
  Vec row_loss(static_cast<size_t>(rows));
  ce.loss = ref::cross_entropy_loss(row_loss.data(), &ce.count, ce.stats.data(), targets, rows);
  return ce;
}

Vec cross_entropy_dlogits(const CrossEntropy& ce, const Vec& logits, const int32_t* targets,
                          int64_t rows, int64_t vocab) {
  Vec dlogits(logits.size());
  ref::cross_entropy_backward(dlogits.data(), logits.data(), ce.stats.data(), targets, ce.count,
                              1.0, rows, vocab, 0);
  return dlogits;
}

std::vector<Vec> random_tensors(const std::vector<int64_t>& sizes,
                                const std::function<std::string(int)>& name, uint64_t seed,
                                double stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<Vec> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string n = name(static_cast<int>(i));
    const bool norm =
        n.find("ln") != std::string::npos || n.find("final_norm") != std::string::npos;
    const bool is_weight = n.size() >= 6 && n.compare(n.size() - 6, 6, "weight") == 0;
    Vec t(static_cast<size_t>(sizes[i]));
    for (double& x : t) x = (norm && is_weight ? 1.0 : 0.0) + normal(rng);
    tensors.push_back(std::move(t));
  }
  return tensors;
}

std::vector<Vec> zeros_like(const std::vector<Vec>& t) {
  std::vector<Vec> z;
  for (const Vec& x : t) z.emplace_back(x.size(), 0.0);
  return z;
}

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = pick(rng);
  return t;
}

int expect_gradients_match_finite_differences(std::vector<Vec>* params,
                                              const std::vector<Vec>& grads,
                                              const std::function<double()>& loss,
                                              const std::function<std::string(int)>& name,
                                              bool require_nonzero, uint64_t seed) {
  const double h = 1e-5;
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (size_t i = 0; i < params->size(); ++i) {
    Vec& t = (*params)[i];
    const size_t n = t.size();
    // Braced-list elements are evaluated in order: the two draws come first, then second.
    const std::vector<size_t> picks = {0, n / 2, n - 1, rng() % n, rng() % n};
    double largest = 0;
    for (size_t idx : picks) {
      const double saved = t[idx];
      t[idx] = saved + h;
      const double up = loss();
      t[idx] = saved - h;
      const double down = loss();
      t[idx] = saved;
      const double fd = (up - down) / (2 * h);
      const double an = grads.at(i)[idx];
      EXPECT_NEAR(an, fd, 1e-7 + 1e-5 * std::fabs(fd))
          << name(static_cast<int>(i)) << "[" << idx << "]";
      largest = std::max(largest, std::fabs(an));
      ++checked;
    }
    if (require_nonzero) {
      EXPECT_GT(largest, 1e-8) << name(static_cast<int>(i)) << ": a sample of all-zero gradients";
    }
  }
  return checked;
}

}  // namespace replay::test
