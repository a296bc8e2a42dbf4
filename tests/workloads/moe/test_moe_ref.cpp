// The fp64 references of the MoE router and dispatch (workloads/moe/moe_reference.h) on the CPU:
// routing on hand-made cases (exact ties, group limiting, a bias that changes the selection but
// not the weights), the router backward and the auxiliary loss's gradient against central finite
// differences, the bias update's signs, the auxiliary loss's value where it is known in closed
// form, the dispatch's stable order, its capacity drops in the documented order and its padding,
// gather/combine round trips and adjoints, and the host-side helpers of the ops library
// (capacity, shape checks, workspace sizes, the expert GEMM descriptors); MLA's fp64 reference
// (the attention block of replay-moe's model) against finite differences, plain and with YaRN;
// DeepSeek-V3's YaRN frequencies, table and softmax scale (yarn.h) against the reference's
// rendering of DeepSeek's code and the values known in closed form.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/check.h"
#include "workloads/moe/dispatch.h"
#include "workloads/moe/expert_gemm.h"
#include "workloads/moe/moe_reference.h"
#include "tests/support/compare.h"
#include "workloads/moe/router.h"
#include "workloads/moe/yarn.h"

namespace replay::moe {
namespace {

// The logit whose sigmoid is p.
double logit(double p) {
  return std::log(p / (1.0 - p));
}

RouterShape router_shape(int64_t tokens, int E, int G, int topk_groups, int topk,
                         float scale = 1.0f) {
  RouterShape s;
  s.tokens = tokens;
  s.experts = E;
  s.groups = G;
  s.topk_groups = topk_groups;
  s.topk = topk;
  s.route_scale = scale;
  return s;
}

std::vector<double> normal(size_t n, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, stddev);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<int32_t> select(const std::vector<double>& logits, const std::vector<double>* bias,
                            const RouterShape& s, std::vector<double>* margin = nullptr) {
  std::vector<int32_t> idx(s.tokens * s.topk);
  if (margin) margin->resize(s.tokens);
  ref::router_select(idx.data(), margin ? margin->data() : nullptr, logits.data(),
                     bias ? bias->data() : nullptr, s);
  return idx;
}

TEST(MoeRouterRef, TopkWithoutGroupsBreaksTiesByLowerIndex) {
  // Scores 0.3 0.8 0.5 0.8 0.1 0.8 0.2 0.4: three experts tie at the top.
  const std::vector<double> p = {0.3, 0.8, 0.5, 0.8, 0.1, 0.8, 0.2, 0.4};
  std::vector<double> x(p.size());
  for (size_t i = 0; i < p.size(); ++i) x[i] = logit(p[i]);
  const RouterShape s = router_shape(1, 8, 1, 1, 2, 2.5f);
  std::vector<double> margin;
  const auto idx = select(x, nullptr, s, &margin);
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(margin[0], 0.0);  // the decision rests on exact ties
  std::vector<double> w(2);
  ref::router_weights(w.data(), x.data(), idx.data(), s);
  EXPECT_NEAR(w[0], 2.5 * 0.5, 1e-12);  // 2.5 * 0.8 / 1.6
  EXPECT_NEAR(w[1], 2.5 * 0.5, 1e-12);
}

TEST(MoeRouterRef, GroupLimitingKeepsTheBestGroupsByTopTwoSum) {
  // 4 groups of 2. Expert 0 has the best single score, but its group sums 1.0; groups 1 (1.2) and
  // 2 (1.1) are kept, so the top 2 come from experts 2..5: 2 and 3 tie at 0.6 (lower first).
  const std::vector<double> p = {0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2};
  std::vector<double> x(p.size());
  for (size_t i = 0; i < p.size(); ++i) x[i] = logit(p[i]);
  EXPECT_EQ(select(x, nullptr, router_shape(1, 8, 4, 2, 2)), (std::vector<int32_t>{2, 3}));
  // Three experts from two kept groups: 2, 3, then 4 (0.55 ties 5, the lower wins).
  EXPECT_EQ(select(x, nullptr, router_shape(1, 8, 4, 2, 3)), (std::vector<int32_t>{2, 3, 4}));
  // Without groups expert 0 wins.
  EXPECT_EQ(select(x, nullptr, router_shape(1, 8, 1, 1, 2)), (std::vector<int32_t>{0, 2}));
  // Equal group sums (the same two scores in either order, so the sums are equal bit for bit):
  // with topk_groups 1 the lower group (1) stays.
  const std::vector<double> q = {0.1, 0.1, 0.7, 0.5, 0.5, 0.7, 0.2, 0.2};
  for (size_t i = 0; i < q.size(); ++i) x[i] = logit(q[i]);
  std::vector<double> margin;
  EXPECT_EQ(select(x, nullptr, router_shape(1, 8, 4, 1, 2), &margin), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(margin[0], 0.0);
}

TEST(MoeRouterRef, BiasSelectsButWeightsComeFromScores) {
  const std::vector<double> p = {0.3, 0.8, 0.5, 0.7, 0.1, 0.6, 0.2, 0.4};
  std::vector<double> x(p.size());
  for (size_t i = 0; i < p.size(); ++i) x[i] = logit(p[i]);
  std::vector<double> bias(8, 0.0);
  bias[6] = 0.65;  // 0.2 + 0.65 = 0.85 ranks first
  const RouterShape s = router_shape(1, 8, 1, 1, 2, 2.5f);
  const auto idx = select(x, &bias, s);
  EXPECT_EQ(idx, (std::vector<int32_t>{6, 1}));
  std::vector<double> w(2);
  ref::router_weights(w.data(), x.data(), idx.data(), s);
  EXPECT_NEAR(w[0], 2.5 * 0.2 / 1.0, 1e-12);
  EXPECT_NEAR(w[1], 2.5 * 0.8 / 1.0, 1e-12);
}

TEST(MoeRouterRef, BackwardMatchesFiniteDifferences) {
  const RouterShape s = router_shape(6, 16, 4, 2, 4, 2.5f);
  const auto x = normal(s.tokens * s.experts, 11);
  const auto bias = normal(s.experts, 12, 0.05);
  std::vector<double> margin;
  const auto idx = select(x, &bias, s, &margin);
  for (double m : margin) ASSERT_GT(m, 1e-4) << "pick a seed without near ties";
  const auto c = normal(s.tokens * s.topk, 13);  // L = sum c * w
  auto loss = [&](const std::vector<double>& xs) {
    EXPECT_EQ(select(xs, &bias, s), idx);  // the selection must not move under the step
    std::vector<double> w(s.tokens * s.topk);
    ref::router_weights(w.data(), xs.data(), idx.data(), s);
    return std::inner_product(c.begin(), c.end(), w.begin(), 0.0);
  };
  std::vector<double> grad(x.size());
  ref::router_backward(grad.data(), c.data(), x.data(), idx.data(), s);
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    auto xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd = (loss(xp) - loss(xm)) / (2 * h);
    EXPECT_NEAR(grad[i], fd, 1e-8) << "logit " << i;
  }
}

TEST(MoeRouterRef, BiasUpdateMovesTowardTheMeanLoad) {
  std::vector<double> bias = {0.0, 0.0, 0.5, -0.5, 1.0};
  ref::bias_update(bias.data(), {5, 1, 3, 3, 3}, 1e-3);  // mean 3
  EXPECT_DOUBLE_EQ(bias[0], -1e-3);
  EXPECT_DOUBLE_EQ(bias[1], 1e-3);
  EXPECT_DOUBLE_EQ(bias[2], 0.5);
  EXPECT_DOUBLE_EQ(bias[3], -0.5);
  EXPECT_DOUBLE_EQ(bias[4], 1.0);
  const std::vector<int32_t> idx = {0, 1, 1, 2, 7, 1, 9, -1};  // 9 and -1 are not experts of 8
  EXPECT_EQ(ref::count_experts(idx.data(), 4, 2, 8),
            (std::vector<int64_t>{1, 3, 1, 0, 0, 0, 0, 1}));
}

TEST(MoeAuxLossRef, UniformScoresGiveTheCoefficient) {
  // All scores equal: q = 1/E, so sum_i f_i P_i = (1/E) sum_i f_i = (1/E) * E = 1 per sequence,
  // whatever the routing; the loss is coeff.
  AuxLossShape s;
  s.tokens = 12;
  s.seq_len = 4;
  s.experts = 8;
  s.topk = 2;
  s.coeff = 0.01f;
  const std::vector<double> x(s.tokens * s.experts, 0.0);
  std::vector<int32_t> idx(s.tokens * s.topk);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>((i * 3) % 8);
  EXPECT_NEAR(ref::aux_loss(x.data(), idx.data(), s), static_cast<double>(s.coeff), 1e-12);
}

TEST(MoeAuxLossRef, GradientMatchesFiniteDifferences) {
  AuxLossShape s;
  s.tokens = 6;
  s.seq_len = 3;
  s.experts = 8;
  s.topk = 2;
  s.coeff = 0.01f;
  const auto x = normal(s.tokens * s.experts, 21);
  const RouterShape rs = router_shape(s.tokens, s.experts, 2, 1, s.topk);
  const auto idx = select(x, nullptr, rs);
  std::vector<double> grad(x.size());
  const double dloss = 3.0;
  ref::aux_loss(x.data(), idx.data(), s, grad.data(), dloss);
  const double h = 1e-5;
  for (size_t i = 0; i < x.size(); ++i) {
    auto xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd =
        dloss *
        (ref::aux_loss(xp.data(), idx.data(), s) - ref::aux_loss(xm.data(), idx.data(), s)) /
        (2 * h);
    EXPECT_NEAR(grad[i], fd, 1e-10) << "logit " << i;
  }
}

// ---------------------------------------------------------------------------------------------------
// Dispatch.

DispatchShape dispatch_shape(int64_t tokens, int E, int topk, DispatchMode mode,
                             int64_t capacity = 0) {
  DispatchShape s;
  s.tokens = tokens;
  s.experts = E;
  s.topk = topk;
  s.mode = mode;
  s.capacity = capacity;
  return s;
}

// Distinct random experts per token.
std::vector<int32_t> random_routes(int64_t tokens, int E, int topk, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    idx.insert(idx.end(), perm.begin(), perm.begin() + topk);
  }
  return idx;
}

TEST(MoeDispatchRef, CapacityDropsTheLaterAssignments) {
  // One slot per token; expert 0 is chosen by tokens 0, 1, 3, 4 and expert 1 by 2, 5.
  const std::vector<int32_t> idx = {0, 0, 1, 0, 0, 1};
  auto d = ref::dispatch_index(idx.data(), dispatch_shape(6, 2, 1, DispatchMode::kCapacity, 2));
  EXPECT_EQ(d.routed_counts, (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(d.expert_counts, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(d.expert_offsets, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(d.slot_row, (std::vector<int32_t>{0, 1, 2, -1, -1, 3}));
  EXPECT_EQ(d.row_source, (std::vector<int32_t>{0, 1, 2, 5}));
  EXPECT_EQ(d.dropped, 2);
  // Capacity 3: token 4 is expert 0's fourth and is dropped; expert 1's third row is padding.
  d = ref::dispatch_index(idx.data(), dispatch_shape(6, 2, 1, DispatchMode::kCapacity, 3));
  EXPECT_EQ(d.slot_row, (std::vector<int32_t>{0, 1, 3, 2, -1, 4}));
  EXPECT_EQ(d.row_source, (std::vector<int32_t>{0, 1, 3, 2, 5, -1}));
  EXPECT_EQ(d.expert_counts, (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(d.dropped, 1);
  // Dropless: compact rows, offsets the exclusive sum.
  d = ref::dispatch_index(idx.data(), dispatch_shape(6, 2, 1, DispatchMode::kDropless));
  EXPECT_EQ(d.expert_offsets, (std::vector<int32_t>{0, 4, 6}));
  EXPECT_EQ(d.row_source, (std::vector<int32_t>{0, 1, 3, 4, 2, 5}));
  EXPECT_EQ(d.dropped, 0);
}

TEST(MoeDispatchRef, StableOrderAndInversePermutation) {
  const auto s = dispatch_shape(37, 8, 3, DispatchMode::kDropless);
  const auto idx = random_routes(s.tokens, s.experts, s.topk, 5);
  const auto d = ref::dispatch_index(idx.data(), s);
  for (int e = 0; e < s.experts; ++e) {
    int32_t previous = -1;
    for (int32_t row = d.expert_offsets[e]; row < d.expert_offsets[e + 1]; ++row) {
      const int32_t a = d.row_source[row];
      EXPECT_EQ(idx[a], e);
      EXPECT_GT(a, previous) << "rows of an expert follow (token, slot) order";
      previous = a;
      EXPECT_EQ(d.slot_row[a], row);
    }
  }
  EXPECT_EQ(d.expert_offsets[s.experts], s.assignments());
}

TEST(MoeDispatchRef, GatherCombineRoundTripsAndAdjoints) {
  const int64_t H = 16;
  for (const auto mode : {DispatchMode::kDropless, DispatchMode::kCapacity}) {
    const auto s = dispatch_shape(29, 8, 2, mode, 6);  // capacity 6 < 29 * 2 / 8: some drops
    const auto idx = random_routes(s.tokens, s.experts, s.topk, 7);
    const auto d = ref::dispatch_index(idx.data(), s);
    const auto x = normal(s.tokens * H, 8);
    const auto w = normal(s.assignments(), 9);
    std::vector<double> xs(s.rows() * H), out(s.tokens * H), back(s.tokens * H);
    ref::gather(xs.data(), x.data(), d, s, H);
    // combine(gather(x)) = (sum of the kept weights) x.
    ref::combine(out.data(), xs.data(), w.data(), d, s, H);
    for (int64_t t = 0; t < s.tokens; ++t) {
      double wsum = 0.0;
      for (int j = 0; j < s.topk; ++j)
        if (d.slot_row[t * s.topk + j] >= 0) wsum += w[t * s.topk + j];
      for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(out[t * H + h], wsum * x[t * H + h], 1e-12);
    }
    // <gather(x), g> = <x, gather_backward(g)>.
    const auto g = normal(s.rows() * H, 10);
    ref::gather_backward(back.data(), g.data(), d, s, H);
    EXPECT_NEAR(std::inner_product(xs.begin(), xs.end(), g.begin(), 0.0),
                std::inner_product(x.begin(), x.end(), back.begin(), 0.0), 1e-9);
    // combine_backward is combine's derivative (combine is bilinear, so differences are exact up
    // to rounding): dL/dy and dL/dw for L = <dout, combine(y, w)>.
    const auto y = normal(s.rows() * H, 11);
    const auto dout = normal(s.tokens * H, 12);
    std::vector<double> dy(s.rows() * H), dw(s.assignments());
    ref::combine_backward(dy.data(), dw.data(), dout.data(), y.data(), w.data(), d, s, H);
    auto loss = [&](const std::vector<double>& ys, const std::vector<double>& ws) {
      std::vector<double> o(s.tokens * H);
      ref::combine(o.data(), ys.data(), ws.data(), d, s, H);
      return std::inner_product(o.begin(), o.end(), dout.begin(), 0.0);
    };
    for (int64_t a = 0; a < s.assignments(); ++a) {
      auto wp = w, wm = w;
      wp[a] += 0.5;
      wm[a] -= 0.5;
      EXPECT_NEAR(dw[a], loss(y, wp) - loss(y, wm), 1e-9) << "weight " << a;
    }
    for (int64_t i = 0; i < s.rows() * H; i += 7) {
      auto yp = y, ym = y;
      yp[i] += 0.5;
      ym[i] -= 0.5;
      EXPECT_NEAR(dy[i], loss(yp, w) - loss(ym, w), 1e-9) << "row element " << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Host-side helpers of the ops library.

TEST(MoeHost, Capacity) {
  EXPECT_EQ(moe_capacity(1.0, 4096, 8, 256), 128);
  EXPECT_EQ(moe_capacity(1.25, 4096, 8, 256), 160);
  EXPECT_EQ(moe_capacity(1.1, 4096, 8, 256), 141);  // 140.8 rounds up
  EXPECT_EQ(moe_capacity(0.5, 4096, 8, 256), 64);
  EXPECT_EQ(moe_capacity(100.0, 10, 2, 8), 10);  // never more than one row per token
  EXPECT_EQ(moe_capacity(0.01, 10, 2, 8), 1);
  EXPECT_THROW(moe_capacity(0.0, 10, 2, 8), Error);
}

TEST(MoeHost, ShapeChecks) {
  EXPECT_NO_THROW(check_router_shape(router_shape(4096, 256, 8, 4, 8, 2.5f)));
  EXPECT_NO_THROW(check_router_shape(router_shape(16, 8, 1, 1, 2)));
  EXPECT_NO_THROW(check_router_shape(router_shape(16, 8, 2, 1, 2)));
  EXPECT_THROW(check_router_shape(router_shape(16, 10, 4, 2, 2)), Error);  // 4 does not divide 10
  EXPECT_THROW(check_router_shape(router_shape(16, 8, 8, 2, 2)), Error);   // groups of one
  EXPECT_THROW(check_router_shape(router_shape(16, 8, 4, 1, 3)), Error);   // 3 > 1 group of 2
  EXPECT_THROW(check_router_shape(router_shape(16, 1024, 8, 4, 8)), Error);
  EXPECT_THROW(check_dispatch_shape(dispatch_shape(16, 8, 2, DispatchMode::kCapacity, 0)), Error);
  EXPECT_GT(moe_dispatch_workspace_bytes(dispatch_shape(4096, 256, 8, DispatchMode::kDropless)),
            0u);
  AuxLossShape a;
  a.tokens = 4096;
  a.seq_len = 4096;
  a.experts = 256;
  a.topk = 8;
  EXPECT_GT(router_aux_loss_workspace_bytes(a), 4096u * 4);
}

TEST(MoeHost, ExpertGemmsAreStridedBatchesOfLinearLayers) {
  const LinearGemms g = expert_linear_gemms(8, 4096, 7168, 4096, true);
  const GemmDesc f = g.forward.normalized(), dg = g.dgrad.normalized(), wg = g.wgrad.normalized();
  EXPECT_EQ(f.batch, 8);
  EXPECT_EQ(f.m, 4096);
  EXPECT_EQ(f.n, 4096);
  EXPECT_EQ(f.k, 7168);
  EXPECT_TRUE(f.trans_b);
  EXPECT_EQ(f.stride_a, 4096 * 7168);  // X_e: C rows of `in`
  EXPECT_EQ(f.stride_b, 4096 * 7168);  // W_e: out x in
  EXPECT_EQ(f.stride_d, 4096 * 4096);  // Y_e: C rows of `out`
  EXPECT_EQ(dg.stride_d, 4096 * 7168);
  EXPECT_EQ(wg.d_type, DType::kFP32);
  EXPECT_EQ(wg.beta, 1.0f);
  EXPECT_EQ(wg.k, 4096);
  EXPECT_EQ(wg.stride_d, 4096 * 7168);
  EXPECT_NO_THROW(validate(f));
  EXPECT_NO_THROW(validate(dg));
  EXPECT_NO_THROW(validate(wg));
}

// MLA's fp64 reference (the attention block of replay-moe's model): every weight's gradient and
// the input's against central differences of L = <out, g>, at a shape with two sequences, causal
// attention over 5 positions, two heads, LoRA ranks 8 and 4 RoPE channels per head.
void check_mla_gradients(const YarnScaling& yarn) {
  ref::MlaRefDims d;
  d.batch = 2, d.seq = 5, d.hidden = 16, d.heads = 2, d.q_lora = 8, d.kv_lora = 8;
  d.nope = 8, d.rope = 4, d.v = 8, d.theta = 100.0;
  d.yarn = yarn;
  std::mt19937 gen(7);
  std::normal_distribution<double> n(0.0, 1.0);
  ref::MlaRefWeights w = ref::MlaRefWeights::zeros(d);
  for (std::vector<double>* t : w.all()) {
    const bool norm = t == &w.norm1 || t == &w.qnorm || t == &w.kvnorm;
    for (double& v : *t) v = norm ? 1.0 + 0.1 * n(gen) : 0.3 * n(gen);
  }
  std::vector<double> x(static_cast<size_t>(d.tokens() * d.hidden)), g(x.size());
  for (double& v : x) v = n(gen);
  for (double& v : g) v = n(gen);
  std::vector<double> out, dx;
  ref::MlaRefWeights dw;
  ref::mla_block(d, w, x, &out, &g, &dw, &dx);
  auto loss = [&] {
    std::vector<double> o;
    ref::mla_block(d, w, x, &o);
    return test::dot(o, g);
  };
  const char* names[] = {"norm1",     "q_a",    "q_a_norm", "q_b", "kv_a",
                         "kv_a_norm", "k_rope", "kv_b",     "o"};
  const std::vector<std::vector<double>*> ws = w.all(), dws = dw.all();
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::vector<double> num = test::numeric_grad(*ws[i], loss);
    EXPECT_TRUE(test::grad_close(names[i], *dws[i], num, 1e-6));
  }
  EXPECT_TRUE(test::grad_close("x", dx, test::numeric_grad(x, loss), 1e-6));
  // Causality: the first position of a sequence sees only itself, so changing a later token's
  // input leaves its output alone.
  std::vector<double> x2 = x, out2;
  x2[static_cast<size_t>(3 * d.hidden)] += 1.0;  // token 3 of sequence 0
  ref::mla_block(d, w, x2, &out2);
  for (int64_t c = 0; c < d.hidden; ++c)
    EXPECT_EQ(out2[static_cast<size_t>(c)], out[static_cast<size_t>(c)])
        << "token 0, channel " << c;
}

TEST(MlaRef, BackwardMatchesFiniteDifferences) {
  check_mla_gradients(YarnScaling{});
}

// With YaRN at a scale where it matters at 4 rotated channels over 5 positions: factor 4 over 2
// original positions (channel pair 0 keeps its frequency, pair 1 is divided by 4), and mscale 0.7
// against mscale_all_dim 1.3, so cos and sin carry an amplitude (0.957) and the softmax scale a
// factor (1.169^2).
TEST(MlaRef, BackwardWithYarnMatchesFiniteDifferences) {
  YarnScaling y = YarnScaling::deepseek_v3();
  y.factor = 4.0, y.original_max_position = 2.0, y.beta_fast = 0.5, y.beta_slow = 0.05;
  y.mscale = 0.7, y.mscale_all_dim = 1.3;
  EXPECT_EQ(ref::rope_frequency(0, 4, 100.0, y), 1.0);
  EXPECT_DOUBLE_EQ(ref::rope_frequency(1, 4, 100.0, y), 0.1 / 4.0);
  check_mla_gradients(y);
}

// The MoE feed-forward part's fp64 reference (router, fold onto local experts, capacity dispatch
// with drops, SwiGLU experts, combine, shared expert): every weight's gradient and the input's
// against central differences of L = <out, g>, the selection held fixed (every token's routing
// margin is far above the step). 12 tokens route top-2 of 8 experts in 4 groups (keep 2), folded
// onto 4 local experts of 5 rows each: 24 assignments for 20 rows, so some are dropped.
TEST(MoeLayerRef, BackwardMatchesFiniteDifferences) {
  ref::MoeLayerRefDims d;
  d.tokens = 12, d.hidden = 8, d.experts = 8, d.local_experts = 4, d.groups = 4;
  d.topk_groups = 2, d.topk = 2, d.expert_ffn = 4, d.shared_ffn = 4, d.capacity = 5;
  d.route_scale = 2.5;
  std::mt19937 gen(11);
  std::normal_distribution<double> n(0.0, 1.0);
  ref::MoeLayerRefWeights w = ref::MoeLayerRefWeights::zeros(d);
  for (std::vector<double>* t : w.differentiable())
    for (double& v : *t) v = 0.5 * n(gen);
  for (double& v : w.bias) v = 0.05 * n(gen);
  std::vector<double> h(static_cast<size_t>(d.tokens * d.hidden)), g(h.size());
  for (double& v : h) v = n(gen);
  for (double& v : g) v = n(gen);
  std::vector<double> out, dh, margin;
  ref::MoeLayerRefWeights dw;
  int32_t dropped = -1;
  ref::moe_layer(d, w, h, &out, &g, &dw, &dh, &dropped, &margin);
  EXPECT_GT(dropped, 0) << "the capacity must drop some assignments";
  EXPECT_LE(dropped, 24 - 20 + 5 * 4);
  ASSERT_GT(*std::min_element(margin.begin(), margin.end()), 1e-4)
      << "a token's routing is too close to a tie for finite differences";
  auto loss = [&] {
    std::vector<double> o;
    ref::moe_layer(d, w, h, &o);
    return test::dot(o, g);
  };
  const char* names[] = {"router", "experts.gate_up", "experts.down", "shared.gate_up",
                         "shared.down"};
  const std::vector<std::vector<double>*> ws = w.differentiable(), dws = dw.differentiable();
  for (size_t i = 0; i < ws.size(); ++i)
    EXPECT_TRUE(test::grad_close(names[i], *dws[i], test::numeric_grad(*ws[i], loss), 1e-6));
  EXPECT_TRUE(test::grad_close("h", dh, test::numeric_grad(h, loss), 1e-6));
  // A dropped assignment contributes nothing: with every row kept (capacity 24) the output differs.
  ref::MoeLayerRefDims all = d;
  all.capacity = 24;
  std::vector<double> out_all;
  int32_t none = -1;
  ref::moe_layer(all, w, h, &out_all, nullptr, nullptr, nullptr, &none);
  EXPECT_EQ(none, 0);
  EXPECT_NE(out_all, out);
}

// DeepSeek-V3's YaRN (factor 40 over 4096 positions, beta 32 / 1, theta 10000, 64 RoPE channels):
// the correction range is pairs 10 to 23 (d(32) = 10.47, d(1) = 22.51), so pairs 0..10 keep
// theta^(-2i / 64), pairs 23..31 are divided by 40, and the ones between are on the ramp; the
// library's frequencies equal the reference's (written from DeepSeek's code), the table holds
// (cos, sin)(p f_i) with amplitude 1 (both mscales 1), and the softmax scale is
// 192^-0.5 (1 + 0.1 ln 40)^2.
TEST(YarnRef, DeepSeekV3FrequenciesTableAndScale) {
  const YarnScaling y = YarnScaling::deepseek_v3();
  const std::vector<double> f = rope_frequencies(64, 10000.0, y);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double plain = std::pow(10000.0, -2.0 * i / 64.0);
    EXPECT_NEAR(f[static_cast<size_t>(i)], ref::rope_frequency(i, 64, 10000.0, y), 1e-15 * plain)
        << "pair " << i;
    if (i <= 10) {
      EXPECT_NEAR(f[static_cast<size_t>(i)], plain, 1e-15 * plain) << "pair " << i;
    }
    if (i >= 23) {
      EXPECT_NEAR(f[static_cast<size_t>(i)], plain / 40.0, 1e-15 * plain) << "pair " << i;
    }
    if (i > 10 && i < 23) {
      const double ramp = (i - 10.0) / 13.0;
      EXPECT_NEAR(f[static_cast<size_t>(i)], plain / 40.0 * ramp + plain * (1.0 - ramp),
                  1e-15 * plain);
    }
  }
  const std::vector<double> plain = rope_frequencies(64, 10000.0, YarnScaling{});
  for (int i = 0; i < 32; ++i)
    EXPECT_NEAR(plain[static_cast<size_t>(i)], ref::rope_frequency(i, 64, 10000.0, YarnScaling{}),
                1e-15 * plain[static_cast<size_t>(i)]);
  EXPECT_EQ(yarn_rope_amplitude(y), 1.0);
  const double m = 1.0 + 0.1 * std::log(40.0);
  EXPECT_NEAR(mla_softmax_scale(192, y), m * m / std::sqrt(192.0), 1e-15);
  EXPECT_EQ(mla_softmax_scale(192, YarnScaling{}), 1.0 / std::sqrt(192.0));
  ref::MlaRefDims d;
  d.nope = 128, d.rope = 64, d.yarn = y;
  EXPECT_NEAR(ref::mla_scale(d), mla_softmax_scale(192, y), 1e-15);
  const std::vector<float> table = yarn_rope_table(4096, 64, 10000.0, y);
  ASSERT_EQ(table.size(), 4096u * 64u);
  for (int p : {0, 1, 77, 4095})
    for (int i : {0, 15, 31}) {
      const double a = p * f[static_cast<size_t>(i)];
      const size_t k = (static_cast<size_t>(p) * 32 + static_cast<size_t>(i)) * 2;
      EXPECT_EQ(table[k], static_cast<float>(std::cos(a))) << p << ", " << i;
      EXPECT_EQ(table[k + 1], static_cast<float>(std::sin(a))) << p << ", " << i;
    }
  // An amplitude: mscale 2 against mscale_all_dim 1.
  YarnScaling a = y;
  a.mscale = 2.0;
  const double amp = (1.0 + 0.2 * std::log(40.0)) / m;
  EXPECT_NEAR(yarn_rope_amplitude(a), amp, 1e-15);
  const std::vector<float> ta = yarn_rope_table(8, 64, 10000.0, a);
  EXPECT_EQ(ta[0], static_cast<float>(amp));  // cos 0 x amplitude
  // Out-of-range settings are refused.
  YarnScaling bad = y;
  bad.beta_fast = 0.5;  // below beta_slow
  EXPECT_THROW(check_yarn(bad), Error);
  bad = y;
  bad.factor = 0.5;
  EXPECT_THROW(check_yarn(bad), Error);
}

}  // namespace
}  // namespace replay::moe
