// The fp64 attention reference: backward against central finite differences, causal masking (the
// future has no influence, forward or backward), GQA equal to MHA with repeated kv heads, and the
// log-sum-exp.
#include "common/reference/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/support/compare.h"

namespace replay {
namespace {

using reference::AttentionShape;

struct Tensors {
  std::vector<double> q, k, v, d_o;
};

size_t q_size(const AttentionShape& s) {
  return s.batch * s.seq_q * s.heads_q * s.dim_qk;
}
size_t k_size(const AttentionShape& s) {
  return s.batch * s.seq_kv * s.heads_kv * s.dim_qk;
}
size_t v_size(const AttentionShape& s) {
  return s.batch * s.seq_kv * s.heads_kv * s.dim_v;
}
size_t o_size(const AttentionShape& s) {
  return s.batch * s.seq_q * s.heads_q * s.dim_v;
}
size_t lse_size(const AttentionShape& s) {
  return s.batch * s.heads_q * s.seq_q;
}

Tensors random_tensors(const AttentionShape& s, uint64_t seed) {
  return {test::to_double(test::random_normal(q_size(s), seed)),
          test::to_double(test::random_normal(k_size(s), seed + 1)),
          test::to_double(test::random_normal(v_size(s), seed + 2)),
          test::to_double(test::random_normal(o_size(s), seed + 3))};
}

std::vector<double> forward(const AttentionShape& s, const Tensors& t,
                            std::vector<double>* lse = nullptr) {
  std::vector<double> o(o_size(s)), l(lse_size(s));
  reference::attention_forward(s, t.q.data(), t.k.data(), t.v.data(), o.data(), l.data());
  if (lse) *lse = l;
  return o;
}

// The loss whose gradient attention_backward computes: sum(o * d_o).
double loss(const AttentionShape& s, const Tensors& t) {
  const std::vector<double> o = forward(s, t);
  double sum = 0.0;
  for (size_t i = 0; i < o.size(); ++i) sum += o[i] * t.d_o[i];
  return sum;
}

// Central differences of the loss with respect to every element of one input.
std::vector<double> numeric_grad(const AttentionShape& s, Tensors t,
                                 std::vector<double> Tensors::*x) {
  const double h = 1e-5;
  std::vector<double> g((t.*x).size());
  for (size_t i = 0; i < g.size(); ++i) {
    const double keep = (t.*x)[i];
    (t.*x)[i] = keep + h;
    const double up = loss(s, t);
    (t.*x)[i] = keep - h;
    const double down = loss(s, t);
    (t.*x)[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

std::vector<float> to_float(const std::vector<double>& x) {
  return {x.begin(), x.end()};
}

void check_gradients(const AttentionShape& s, uint64_t seed) {
  const Tensors t = random_tensors(s, seed);
  std::vector<double> dq(q_size(s)), dk(k_size(s)), dv(v_size(s));
  reference::attention_backward(s, t.q.data(), t.k.data(), t.v.data(), t.d_o.data(), dq.data(),
                                dk.data(), dv.data());
  // fp64 central differences agree to ~1e-9; float conversion for all_close costs ~1e-7 relative.
  const test::Tolerance tol{1e-6, 1e-5};
  EXPECT_TRUE(test::all_close("dq", to_float(dq), numeric_grad(s, t, &Tensors::q), tol));
  EXPECT_TRUE(test::all_close("dk", to_float(dk), numeric_grad(s, t, &Tensors::k), tol));
  EXPECT_TRUE(test::all_close("dv", to_float(dv), numeric_grad(s, t, &Tensors::v), tol));
}

TEST(AttentionRef, BackwardMatchesFiniteDifferences) {
  check_gradients({2, 2, 2, 5, 5, 8, 8, false, 0.35}, 1);
}

TEST(AttentionRef, BackwardMatchesFiniteDifferencesCausalGqaDifferentDims) {
  // 4 query heads on 2 kv heads, d_qk != d_v, fewer queries than keys (top-left causal).
  check_gradients({1, 4, 2, 4, 6, 6, 4, true, 0.5}, 2);
  // MQA with more queries than keys: the last queries see every key.
  check_gradients({2, 3, 1, 6, 4, 4, 8, true, 0.7}, 3);
}

TEST(AttentionRef, LogSumExpAndSingleKey) {
  AttentionShape s{1, 2, 2, 3, 4, 4, 4, false, 0.25};
  const Tensors t = random_tensors(s, 4);
  std::vector<double> lse;
  forward(s, t, &lse);
  // Row (b=0, h=1, i=2) by hand.
  double sum = 0.0;
  for (int64_t j = 0; j < s.seq_kv; ++j) {
    double dot = 0.0;
    for (int64_t d = 0; d < s.dim_qk; ++d)
      dot += t.q[(2 * s.heads_q + 1) * s.dim_qk + d] * t.k[(j * s.heads_kv + 1) * s.dim_qk + d];
    sum += std::exp(s.scale * dot);
  }
  EXPECT_NEAR(lse[1 * s.seq_q + 2], std::log(sum), 1e-12);

  // Causal row 0 sees key 0 only: o = v_0 and lse = the single score.
  s.causal = true;
  const std::vector<double> o = forward(s, t, &lse);
  for (int64_t h = 0; h < s.heads_q; ++h) {
    double dot = 0.0;
    for (int64_t d = 0; d < s.dim_qk; ++d) dot += t.q[h * s.dim_qk + d] * t.k[h * s.dim_qk + d];
    EXPECT_NEAR(lse[h * s.seq_q], s.scale * dot, 1e-12);
    for (int64_t d = 0; d < s.dim_v; ++d)
      EXPECT_DOUBLE_EQ(o[h * s.dim_v + d], t.v[h * s.dim_v + d]);
  }
}

TEST(AttentionRef, CausalFutureHasNoInfluence) {
  const AttentionShape s{2, 4, 2, 8, 8, 8, 8, true, 0.4};  // dim_qk == dim_v: k and v rows alike
  const int64_t t0 = 5;  // perturb keys and values of tokens >= t0
  Tensors a = random_tensors(s, 5);
  Tensors b = a;
  for (int64_t bb = 0; bb < s.batch; ++bb)
    for (int64_t j = t0; j < s.seq_kv; ++j)
      for (int64_t x = 0; x < s.heads_kv * s.dim_qk; ++x) {
        b.k[(bb * s.seq_kv + j) * s.heads_kv * s.dim_qk + x] += 1.5;
        b.v[(bb * s.seq_kv + j) * s.heads_kv * s.dim_v + x] -= 2.0;
      }
  const std::vector<double> oa = forward(s, a), ob = forward(s, b);
  const int64_t row = s.heads_q * s.dim_v;
  for (int64_t bb = 0; bb < s.batch; ++bb)
    for (int64_t i = 0; i < s.seq_q; ++i) {
      double diff = 0.0;
      for (int64_t x = 0; x < row; ++x)
        diff = std::max(
            diff, std::fabs(oa[(bb * s.seq_q + i) * row + x] - ob[(bb * s.seq_q + i) * row + x]));
      if (i < t0)
        EXPECT_EQ(diff, 0.0) << "batch " << bb << " query " << i << " sees the future";
      else
        EXPECT_GT(diff, 1e-3) << "batch " << bb << " query " << i << " ignores its past";
    }

  // Backward: with d_o zero from t0 on, keys and values at t0 and later get exactly zero gradient.
  for (int64_t bb = 0; bb < s.batch; ++bb)
    for (int64_t i = t0; i < s.seq_q; ++i)
      for (int64_t x = 0; x < row; ++x) a.d_o[(bb * s.seq_q + i) * row + x] = 0.0;
  std::vector<double> dq(q_size(s)), dk(k_size(s)), dv(v_size(s));
  reference::attention_backward(s, a.q.data(), a.k.data(), a.v.data(), a.d_o.data(), dq.data(),
                                dk.data(), dv.data());
  const int64_t krow = s.heads_kv * s.dim_qk;
  for (int64_t bb = 0; bb < s.batch; ++bb)
    for (int64_t j = 0; j < s.seq_kv; ++j) {
      double mag = 0.0;
      for (int64_t x = 0; x < krow; ++x)
        mag = std::max({mag, std::fabs(dk[(bb * s.seq_kv + j) * krow + x]),
                        std::fabs(dv[(bb * s.seq_kv + j) * krow + x])});
      if (j >= t0)
        EXPECT_EQ(mag, 0.0) << "key " << j << " has a gradient from the past";
      else
        EXPECT_GT(mag, 0.0) << "key " << j;
    }
}

TEST(AttentionRef, GqaEqualsMhaWithRepeatedKvHeads) {
  for (bool causal : {false, true}) {
    const AttentionShape gqa{2, 6, 2, 5, 7, 8, 4, causal, 0.3};
    AttentionShape mha = gqa;
    mha.heads_kv = gqa.heads_q;
    const int64_t group = gqa.heads_q / gqa.heads_kv;
    const Tensors t = random_tensors(gqa, 6);
    Tensors r = t;  // k and v with each kv head repeated `group` times
    r.k.assign(k_size(mha), 0.0);
    r.v.assign(v_size(mha), 0.0);
    for (int64_t b = 0; b < gqa.batch; ++b)
      for (int64_t j = 0; j < gqa.seq_kv; ++j)
        for (int64_t h = 0; h < mha.heads_kv; ++h) {
          const int64_t src = (b * gqa.seq_kv + j) * gqa.heads_kv + h / group;
          const int64_t dst = (b * mha.seq_kv + j) * mha.heads_kv + h;
          for (int64_t d = 0; d < gqa.dim_qk; ++d)
            r.k[dst * gqa.dim_qk + d] = t.k[src * gqa.dim_qk + d];
          for (int64_t d = 0; d < gqa.dim_v; ++d)
            r.v[dst * gqa.dim_v + d] = t.v[src * gqa.dim_v + d];
        }
    std::vector<double> lse_g, lse_m;
    const std::vector<double> og = forward(gqa, t, &lse_g), om = forward(mha, r, &lse_m);
    EXPECT_EQ(og, om);
    EXPECT_EQ(lse_g, lse_m);

    std::vector<double> dqg(q_size(gqa)), dkg(k_size(gqa)), dvg(v_size(gqa));
    std::vector<double> dqm(q_size(mha)), dkm(k_size(mha)), dvm(v_size(mha));
    reference::attention_backward(gqa, t.q.data(), t.k.data(), t.v.data(), t.d_o.data(), dqg.data(),
                                  dkg.data(), dvg.data());
    reference::attention_backward(mha, r.q.data(), r.k.data(), r.v.data(), r.d_o.data(), dqm.data(),
                                  dkm.data(), dvm.data());
    EXPECT_EQ(dqg, dqm);
    // A shared kv head's gradient is the sum over the query heads of its group.
    std::vector<double> dk_sum(k_size(gqa), 0.0), dv_sum(v_size(gqa), 0.0);
    for (int64_t b = 0; b < gqa.batch; ++b)
      for (int64_t j = 0; j < gqa.seq_kv; ++j)
        for (int64_t h = 0; h < mha.heads_kv; ++h) {
          const int64_t dst = (b * gqa.seq_kv + j) * gqa.heads_kv + h / group;
          const int64_t src = (b * mha.seq_kv + j) * mha.heads_kv + h;
          for (int64_t d = 0; d < gqa.dim_qk; ++d)
            dk_sum[dst * gqa.dim_qk + d] += dkm[src * gqa.dim_qk + d];
          for (int64_t d = 0; d < gqa.dim_v; ++d)
            dv_sum[dst * gqa.dim_v + d] += dvm[src * gqa.dim_v + d];
        }
    EXPECT_TRUE(test::all_close("gqa dk", to_float(dkg), dk_sum, {1e-6, 1e-6}));
    EXPECT_TRUE(test::all_close("gqa dv", to_float(dvg), dv_sum, {1e-6, 1e-6}));
  }
}

}  // namespace
}  // namespace replay
