// The fp64 CPU reference of the GPT shard (the model the GPU test compares against): its gradients
// agree with central finite differences of its loss for a sample of every parameter tensor
// (two layers, tiny dims, random weights large enough to make every nonlinearity count), and it
// has the invariance attention must have: the key bias has no gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tests/workloads/gpt_reference.h"

namespace replay::test {
namespace {

GptDims tiny_dims() {
  GptDims d;
  d.batch = 2;
  d.seq = 4;
  d.hidden = 8;
  d.heads = 2;
  d.head_dim = 4;
  d.ffn = 16;
  d.vocab = 16;
  d.layers = 2;
  return d;
}

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = pick(rng);
  return t;
}

TEST(GptReference, GradientsMatchFiniteDifferences) {
  const GptDims d = tiny_dims();
  GptParams p = random_params(d, 7, 0.3);
  const auto tokens =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 11);
  const auto targets =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 12);
  GptParams g;
  std::vector<double> dx0;
  const double loss = gpt_backward(d, p, tokens.data(), targets.data(), &g, &dx0);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_DOUBLE_EQ(loss, gpt_loss(d, p, tokens.data(), targets.data()));
  ASSERT_EQ(dx0.size(), static_cast<size_t>(d.tokens() * d.hidden));

  const double h = 1e-5;
  std::mt19937_64 rng(99);
  int checked = 0;
  for (int i = 0; i < GptParams::count(d); ++i) {
    std::vector<double>& t = p.t[static_cast<size_t>(i)];
    const size_t n = t.size();
    std::vector<size_t> picks = {0, n / 2, n - 1, rng() % n, rng() % n};
    for (size_t idx : picks) {
      const double saved = t[idx];
      t[idx] = saved + h;
      const double up = gpt_loss(d, p, tokens.data(), targets.data());
      t[idx] = saved - h;
      const double down = gpt_loss(d, p, tokens.data(), targets.data());
      t[idx] = saved;
      const double fd = (up - down) / (2 * h);
      const double an = g.t[static_cast<size_t>(i)][idx];
      EXPECT_NEAR(an, fd, 1e-7 + 1e-5 * std::fabs(fd))
          << GptParams::name(d, i) << "[" << idx << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 5 * GptParams::count(d));
}

TEST(GptReference, KeyBiasHasNoGradientAndQueryValueBiasesDo) {
  // Adding a vector to every key shifts each query's scores by one constant: softmax ignores it.
  const GptDims d = tiny_dims();
  const GptParams p = random_params(d, 21, 0.3);
  const auto tokens =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 22);
  const auto targets =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 23);
  GptParams g;
  gpt_backward(d, p, tokens.data(), targets.data(), &g, nullptr);
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::vector<double>& db = g.t[static_cast<size_t>(GptParams::layer(l, kQkvB))];
    const int64_t A = d.attn();
    double q = 0, k = 0, v = 0;
    for (int64_t j = 0; j < A; ++j) {
      q = std::max(q, std::fabs(db[j]));
      k = std::max(k, std::fabs(db[A + j]));
      v = std::max(v, std::fabs(db[2 * A + j]));
    }
    EXPECT_LT(k, 1e-12) << "layer " << l;
    EXPECT_GT(q, 1e-6) << "layer " << l;
    EXPECT_GT(v, 1e-6) << "layer " << l;
  }
}

}  // namespace
}  // namespace replay::test
