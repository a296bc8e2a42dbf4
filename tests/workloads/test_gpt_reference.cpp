// The fp64 CPU reference of the GPT shard (the model the GPU test compares against): its gradients
// agree with central finite differences of its loss for a sample of every parameter tensor
// (two layers, tiny dims, random weights large enough to make every nonlinearity count), and it
// has the invariance attention must have: the key bias has no gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "tests/workloads/gpt_reference.h"
#include "tests/workloads/reference_gradient_check.h"
#include "tests/workloads/reference_util.h"

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

TEST(GptReference, GradientsMatchFiniteDifferences) {
  expect_backward_matches_finite_differences<GptParams>(tiny_dims(), gpt_backward, gpt_loss,
                                                        /*require_nonzero=*/false);
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
