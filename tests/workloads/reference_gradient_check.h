// reference_gradient_check.h: the check the GPT and Llama reference models' tests both run on their
// backward: on seeded weights and tokens, it returns the forward's loss and an input gradient of
// one value per token and hidden unit, and every parameter's gradient agrees with finite
// differences.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/workloads/reference_util.h"

namespace replay::test {

// `backward(d, p, tokens, targets, &grads, &dx0)` returns the loss and fills the gradients;
// `loss(d, p, tokens, targets)` is the forward alone. Params has `t` (the tensors), name(d, i) and
// count(d); random_params(d, seed, stddev) draws them. require_nonzero: see
// expect_gradients_match_finite_differences.
template <typename Params, typename Dims, typename Backward, typename Loss>
void expect_backward_matches_finite_differences(const Dims& d, Backward backward, Loss loss,
                                                bool require_nonzero) {
  Params p = random_params(d, 7, 0.3);
  const auto tokens =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 11);
  const auto targets =
      random_tokens(static_cast<size_t>(d.tokens()), static_cast<int32_t>(d.vocab), 12);
  Params g;
  std::vector<double> dx0;
  const double value = backward(d, p, tokens.data(), targets.data(), &g, &dx0);
  ASSERT_TRUE(std::isfinite(value));
  EXPECT_DOUBLE_EQ(value, loss(d, p, tokens.data(), targets.data()));
  ASSERT_EQ(dx0.size(), static_cast<size_t>(d.tokens() * d.hidden));

  const int checked = expect_gradients_match_finite_differences(
      &p.t, g.t, [&] { return loss(d, p, tokens.data(), targets.data()); },
      [&](int i) { return Params::name(d, i); }, require_nonzero);
  EXPECT_EQ(checked, 5 * Params::count(d));
}

}  // namespace replay::test
