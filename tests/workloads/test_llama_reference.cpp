// The fp64 CPU reference of the Llama shard (the model the GPU test compares against): its
// gradients agree with central finite differences of its loss for a sample of every parameter
// tensor (two layers, GQA with 4 query heads on 2 KV heads, RoPE with the Llama 3.1 scaling, random
// weights large enough to make every nonlinearity count), and grouped-query attention is what it
// must be: the same function as multi-head attention with each KV head repeated for its group,
// with each shared k and v weight row's gradient the sum over the query heads it serves.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/workloads/llama_reference.h"
#include "tests/workloads/reference_gradient_check.h"
#include "tests/workloads/reference_util.h"

namespace replay::test {
namespace {

LlamaDims tiny_dims() {
  LlamaDims d;
  d.batch = 2;
  d.seq = 4;
  d.hidden = 16;
  d.heads = 4;
  d.heads_kv = 2;
  d.head_dim = 16;
  d.ffn = 16;
  d.vocab = 16;
  d.layers = 2;
  d.rope_theta = 100.0;  // frequencies that turn visibly over 4 positions
  return d;
}

TEST(LlamaReference, GradientsMatchFiniteDifferences) {
  expect_backward_matches_finite_differences<LlamaParams>(tiny_dims(), llama_backward, llama_loss,
                                                          /*require_nonzero=*/true);
}

TEST(LlamaReference, GqaKeyValueGradientsGatherBothQueryHeadsOfTheirGroup) {
  // The k and v rows of the fused QKV weight each serve two query heads: their gradient is the sum
  // over both. Compare with a model where each query head has its own copy of the KV head.
  LlamaDims gqa = tiny_dims();
  gqa.layers = 1;
  LlamaDims mha = gqa;
  mha.heads_kv = mha.heads;
  const LlamaParams pg = random_params(gqa, 31, 0.3);
  // The MHA model: every tensor as in the GQA one, except the QKV weight whose k and v parts repeat
  // each KV head for its group of query heads (query head h reads KV head h / 2).
  LlamaParams pm = random_params(mha, 31, 0.3);
  for (int i = 0; i < LlamaParams::count(gqa); ++i)
    if (i != LlamaParams::layer(0, kLlamaQkvW))
      pm.t[static_cast<size_t>(i)] = pg.t[static_cast<size_t>(i)];
  const int64_t C = gqa.hidden, D = gqa.head_dim, A = gqa.attn(), K = gqa.kv();
  const std::vector<double>& wg = pg.t[static_cast<size_t>(LlamaParams::layer(0, kLlamaQkvW))];
  std::vector<double>& wm = pm.t[static_cast<size_t>(LlamaParams::layer(0, kLlamaQkvW))];
  auto copy_rows = [&](int64_t dst_row, int64_t src_row) {
    for (int64_t c = 0; c < C; ++c) wm[dst_row * C + c] = wg[src_row * C + c];
  };
  for (int64_t r = 0; r < A; ++r) copy_rows(r, r);
  for (int64_t h = 0; h < mha.heads; ++h)
    for (int64_t j = 0; j < D; ++j) {
      const int64_t kv = h / (gqa.heads / gqa.heads_kv);
      copy_rows(A + h * D + j, A + kv * D + j);          // k
      copy_rows(2 * A + h * D + j, A + K + kv * D + j);  // v
    }
  const auto tokens = random_tokens(static_cast<size_t>(gqa.tokens()), 16, 32);
  const auto targets = random_tokens(static_cast<size_t>(gqa.tokens()), 16, 33);
  LlamaParams gg, gm;
  const double lg = llama_backward(gqa, pg, tokens.data(), targets.data(), &gg, nullptr);
  const double lm = llama_backward(mha, pm, tokens.data(), targets.data(), &gm, nullptr);
  EXPECT_NEAR(lg, lm, 1e-12) << "the repeated-KV model is the same function";
  const std::vector<double>& dg = gg.t[static_cast<size_t>(LlamaParams::layer(0, kLlamaQkvW))];
  const std::vector<double>& dm = gm.t[static_cast<size_t>(LlamaParams::layer(0, kLlamaQkvW))];
  for (int64_t kv = 0; kv < gqa.heads_kv; ++kv)
    for (int64_t j = 0; j < D; ++j)
      for (int64_t c = 0; c < C; c += 5) {
        const int64_t h0 = 2 * kv, h1 = 2 * kv + 1;
        const double k_sum = dm[(A + h0 * D + j) * C + c] + dm[(A + h1 * D + j) * C + c];
        const double v_sum = dm[(2 * A + h0 * D + j) * C + c] + dm[(2 * A + h1 * D + j) * C + c];
        EXPECT_NEAR(dg[(A + kv * D + j) * C + c], k_sum, 1e-12);
        EXPECT_NEAR(dg[(A + K + kv * D + j) * C + c], v_sum, 1e-12);
      }
}

}  // namespace
}  // namespace replay::test
