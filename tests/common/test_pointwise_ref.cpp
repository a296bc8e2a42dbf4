// CPU references of the pointwise and normalization ops: every backward against central finite
// differences of its forward (fp64, random shapes), forward identities, the RoPE frequencies
// against the Llama 3.1 scaling formula, and the dropout mask's statistics.
#include "common/reference/pointwise.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/kernels/dropout.h"
#include "common/philox.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using Vec = std::vector<double>;
using test::dot;
using test::grad_close;
using test::numeric_grad;

Vec normal(size_t n, uint64_t seed, double stddev = 1.0) {
  return test::to_double(test::random_normal(n, seed, 0.0f, static_cast<float>(stddev)));
}

Vec uniform(size_t n, uint64_t seed, double lo, double hi) {
  return test::to_double(
      test::random_uniform(n, seed, static_cast<float>(lo), static_cast<float>(hi)));
}

struct Shape {
  int64_t rows;
  int C;
};

// A few random small shapes per test, different for every seed.
std::vector<Shape> random_shapes(uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<Shape> shapes;
  for (int i = 0; i < 3; ++i)
    shapes.push_back({std::uniform_int_distribution<int64_t>(1, 6)(gen),
                      8 * std::uniform_int_distribution<int>(1, 6)(gen)});
  return shapes;
}

TEST(PointwiseRef, LayerNormGradientsMatchFiniteDifferences) {
  uint64_t seed = 100;
  for (const Shape s : random_shapes(1)) {
    const size_t n = s.rows * s.C;
    Vec x = normal(n, ++seed, 2.0), gamma = normal(s.C, ++seed), beta = normal(s.C, ++seed);
    const Vec w = normal(n, ++seed);
    Vec out(n), mean(s.rows), rstd(s.rows);
    const double eps = 1e-5;
    auto loss = [&] {
      ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), gamma.data(),
                             beta.data(), s.rows, s.C, eps);
      return dot(w, out);
    };
    loss();
    Vec dx(n), dgamma(s.C), dbeta(s.C);
    ref::layernorm_backward(dx.data(), dgamma.data(), dbeta.data(), w.data(), x.data(),
                            gamma.data(), mean.data(), rstd.data(), s.rows, s.C);
    const std::string at = " rows " + std::to_string(s.rows) + " C " + std::to_string(s.C);
    EXPECT_TRUE(grad_close("layernorm dx" + at, dx, numeric_grad(x, loss)));
    EXPECT_TRUE(grad_close("layernorm dgamma" + at, dgamma, numeric_grad(gamma, loss)));
    EXPECT_TRUE(grad_close("layernorm dbeta" + at, dbeta, numeric_grad(beta, loss)));
  }
}

TEST(PointwiseRef, LayerNormForwardNormalizesRows) {
  const int64_t rows = 5;
  const int C = 64;
  const Vec x = normal(rows * C, 7, 3.0);
  const Vec ones(C, 1.0), zeros(C, 0.0);
  Vec out(rows * C), mean(rows), rstd(rows);
  const double eps = 1e-5;
  ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), ones.data(), zeros.data(),
                         rows, C, eps);
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0.0, v = 0.0;
    for (int c = 0; c < C; ++c) m += out[r * C + c] / C;
    for (int c = 0; c < C; ++c) v += (out[r * C + c] - m) * (out[r * C + c] - m) / C;
    const double var_x = 1.0 / (rstd[r] * rstd[r]) - eps;
    EXPECT_NEAR(m, 0.0, 1e-12);
    EXPECT_NEAR(v, var_x / (var_x + eps), 1e-12);
    EXPECT_GT(var_x, 1.0);  // x has stddev 3
  }
}

TEST(PointwiseRef, RmsNormGradientsMatchFiniteDifferences) {
  uint64_t seed = 200;
  for (const Shape s : random_shapes(2)) {
    const size_t n = s.rows * s.C;
    Vec x = normal(n, ++seed, 2.0), gamma = normal(s.C, ++seed);
    const Vec w = normal(n, ++seed);
    Vec out(n), rstd(s.rows);
    auto loss = [&] {
      ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), gamma.data(), s.rows, s.C, 1e-6);
      return dot(w, out);
    };
    loss();
    Vec dx(n), dgamma(s.C);
    ref::rmsnorm_backward(dx.data(), dgamma.data(), w.data(), x.data(), gamma.data(), rstd.data(),
                          s.rows, s.C);
    const std::string at = " rows " + std::to_string(s.rows) + " C " + std::to_string(s.C);
    EXPECT_TRUE(grad_close("rmsnorm dx" + at, dx, numeric_grad(x, loss)));
    EXPECT_TRUE(grad_close("rmsnorm dgamma" + at, dgamma, numeric_grad(gamma, loss)));
  }
}

TEST(PointwiseRef, RmsNormForwardHasUnitMeanSquare) {
  const int64_t rows = 4;
  const int C = 48;
  const Vec x = normal(rows * C, 8, 0.5);
  const Vec ones(C, 1.0);
  Vec out(rows * C), rstd(rows);
  ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), ones.data(), rows, C, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (int c = 0; c < C; ++c) ms += out[r * C + c] * out[r * C + c] / C;
    EXPECT_NEAR(ms, 1.0, 1e-12);
  }
}

TEST(PointwiseRef, SwigluGradientsMatchFiniteDifferences) {
  uint64_t seed = 300;
  for (const Shape s : random_shapes(3)) {
    const int64_t M = s.rows;
    const int F = s.C;
    Vec in = normal(M * 2 * F, ++seed, 2.0);
    const Vec w = normal(M * F, ++seed);
    Vec out(M * F);
    auto loss = [&] {
      ref::swiglu_forward(out.data(), in.data(), M, F);
      return dot(w, out);
    };
    Vec din(M * 2 * F);
    ref::swiglu_backward(din.data(), w.data(), in.data(), M, F);
    EXPECT_TRUE(grad_close("swiglu din M " + std::to_string(M) + " F " + std::to_string(F), din,
                           numeric_grad(in, loss)));
  }
  // Gate first, up second: silu(1) * 2 = 2 / (1 + e^-1).
  const Vec in = {1.0, 2.0};
  Vec out(1);
  ref::swiglu_forward(out.data(), in.data(), 1, 1);
  EXPECT_NEAR(out[0], 1.4621171572600098, 1e-15);
}

TEST(PointwiseRef, GeluGradientsMatchFiniteDifferencesAndKnownValues) {
  for (uint64_t seed : {401, 402}) {
    Vec x = normal(64, seed, 3.0);
    const Vec w = normal(64, seed + 10);
    Vec out(64);
    auto loss = [&] {
      ref::gelu_forward(out.data(), x.data(), 64);
      return dot(w, out);
    };
    Vec dx(64);
    ref::gelu_backward(dx.data(), w.data(), x.data(), 64);
    EXPECT_TRUE(grad_close("gelu dx", dx, numeric_grad(x, loss)));
  }
  const Vec x = {0.0, 1.0, -1.0, 10.0, -10.0};
  Vec y(x.size());
  ref::gelu_forward(y.data(), x.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[0], 0.0);
  EXPECT_NEAR(y[1], 0.8411919906082768, 1e-15);  // tanh approximation (exact GeLU: 0.8413447)
  EXPECT_NEAR(y[2], -1.0 + 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[3], 10.0, 1e-12);
  EXPECT_NEAR(y[4], 0.0, 1e-12);
}

TEST(PointwiseRef, RopeBackwardIsTheTransposeOfTheForward) {
  // Partial rotation inside each head (offset 8, 16 of 40 channels), explicit positions, a token
  // stride wider than the heads (as in a fused QKV output).
  RopeLayout l;
  l.batch = 2;
  l.seq = 3;
  l.heads = 2;
  l.head_dim = 40;
  l.rope_dim = 16;
  l.rope_offset = 8;
  l.token_stride = 3 * 40;
  const std::vector<int32_t> positions = {5, 0, 17, 2, 2, 1000};
  const std::vector<double> freqs = ref::rope_frequencies(l.rope_dim, 10000.0, RopeScaling{});
  const size_t n = l.batch * l.seq * l.token_stride;
  Vec x = normal(n, 500);
  const Vec w = normal(n, 501);
  Vec out(n);
  auto loss = [&] {
    ref::rope_forward(out.data(), x.data(), freqs, positions.data(), l);
    return dot(w, out);
  };
  loss();
  Vec dx(n);
  ref::rope_backward(dx.data(), w.data(), freqs, positions.data(), l);
  // Only the heads' channels are defined outputs; the stride gap is not written.
  Vec an, num;
  const Vec fd = numeric_grad(x, loss);
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(i % l.token_stride) >= l.heads * l.head_dim) continue;
    an.push_back(dx[i]);
    num.push_back(fd[i]);
  }
  EXPECT_TRUE(grad_close("rope dx", an, num));

  // Pass-through channels are copied, rotated pairs keep their norm, backward undoes forward.
  Vec back(n);
  ref::rope_backward(back.data(), out.data(), freqs, positions.data(), l);
  for (int64_t t = 0; t < l.batch * l.seq; ++t)
    for (int h = 0; h < l.heads; ++h) {
      const int64_t base = t * l.token_stride + h * l.head_dim;
      for (int c = 0; c < l.head_dim; ++c) {
        EXPECT_NEAR(back[base + c], x[base + c], 1e-12);
        if (c < l.rope_offset || c >= l.rope_offset + l.rope_dim) {
          EXPECT_EQ(out[base + c], x[base + c]);
        }
      }
      for (int i = 0; i < l.rope_dim / 2; ++i) {
        const int64_t a = base + l.rope_offset + i, b = a + l.rope_dim / 2;
        EXPECT_NEAR(std::hypot(out[a], out[b]), std::hypot(x[a], x[b]), 1e-12);
      }
    }
}

TEST(PointwiseRef, RopeFrequenciesFollowLlama31Scaling) {
  const double theta = 500000.0, kPi = 3.14159265358979323846;
  const int dim = 128;
  const std::vector<double> plain = ref::rope_frequencies(dim, theta, RopeScaling{});
  const std::vector<double> scaled = ref::rope_frequencies(dim, theta, RopeScaling::llama31());
  ASSERT_EQ(plain.size(), 64u);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(plain[i], std::pow(theta, -2.0 * i / dim), 1e-15);
  // With theta 500000 and 128 dims, wavelengths 2 pi / f cross 2048 (= 8192 / 4) after i = 28 and
  // 8192 (= 8192 / 1) after i = 34: i <= 28 keep their frequency, i >= 35 are divided by 8, and
  // i = 29..34 are interpolated with smooth = (8192 / wavelen - 1) / (4 - 1).
  for (int i = 0; i < 64; ++i) {
    if (i <= 28) {
      EXPECT_EQ(scaled[i], plain[i]) << i;
    } else if (i >= 35) {
      EXPECT_NEAR(scaled[i], plain[i] / 8.0, 1e-18) << i;
    } else {
      const double wavelen = 2.0 * kPi / plain[i];
      const double smooth = (8192.0 / wavelen - 1.0) / 3.0;
      EXPECT_GT(smooth, 0.0);
      EXPECT_LT(smooth, 1.0);
      EXPECT_NEAR(scaled[i], (1.0 - smooth) * plain[i] / 8.0 + smooth * plain[i], 1e-15) << i;
      EXPECT_LT(scaled[i], plain[i]);
      EXPECT_GT(scaled[i], plain[i] / 8.0);
    }
  }
  // The table holds cos/sin of pos * f.
  const int positions = 9;
  Vec cs(positions * 64), sn(positions * 64);
  ref::rope_table(cs.data(), sn.data(), positions, dim, theta, RopeScaling::llama31());
  for (int pos = 0; pos < positions; ++pos)
    for (int i = 0; i < 64; ++i) {
      EXPECT_NEAR(cs[pos * 64 + i], std::cos(pos * scaled[i]), 1e-15);
      EXPECT_NEAR(sn[pos * 64 + i], std::sin(pos * scaled[i]), 1e-15);
    }
}

TEST(PointwiseRef, DropoutMaskStatistics) {
  const int64_t n = int64_t{1} << 20;
  for (const float p : {0.1f, 0.3f, 0.5f}) {
    const std::vector<uint8_t> a = ref::dropout_keep_mask(n, p, 1234, 7);
    const std::vector<uint8_t> b = ref::dropout_keep_mask(n, p, 1234, 8);  // next slot offset
    const double sigma = std::sqrt(p * (1.0 - p) / n);
    int64_t kept = 0, agree = 0, kept_even = 0;
    for (int64_t e = 0; e < n; ++e) {
      kept += a[e];
      agree += a[e] == b[e];
      if (e % 2 == 0) kept_even += a[e];
    }
    EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 5 * sigma) << "p " << p;
    EXPECT_NEAR(2.0 * kept_even / n, 1.0 - p, 5 * sigma * std::sqrt(2.0)) << "p " << p;
    // Independent masks agree with probability p^2 + (1 - p)^2.
    const double q = p * p + (1.0 - p) * (1.0 - p);
    EXPECT_NEAR(static_cast<double>(agree) / n, q, 5 * std::sqrt(q * (1 - q) / n)) << "p " << p;
    EXPECT_EQ(a, ref::dropout_keep_mask(n, p, 1234, 7));  // same arguments, same mask
  }
  // Element e is decided by component e % 4 of Philox block e / 4.
  const std::vector<uint8_t> m = ref::dropout_keep_mask(16, 0.5f, 99, 3);
  for (int e = 0; e < 16; ++e) {
    const Philox4 r = philox_block(99, 3, e / 4);
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
    EXPECT_EQ(m[e], words[e % 4] >= 0x80000000u ? 1 : 0) << e;
  }
  const std::vector<uint8_t> none = ref::dropout_keep_mask(1024, 0.0f, 5, 5);
  EXPECT_EQ(std::count(none.begin(), none.end(), 1), 1024);
}

TEST(PointwiseRef, DropoutResidualGradientsMatchFiniteDifferences) {
  uint64_t seed = 600;
  for (const Shape s : random_shapes(6)) {
    const size_t n = s.rows * s.C;
    Vec x = normal(n, ++seed), bias = normal(s.C, ++seed), residual = normal(n, ++seed);
    const Vec w = normal(n, ++seed);
    const float p = 0.25f;
    Vec out(n);
    auto loss = [&] {
      ref::dropout_residual_forward(out.data(), x.data(), bias.data(), residual.data(), s.rows, s.C,
                                    p, 42, 3);
      return dot(w, out);
    };
    Vec dx(n), dbias(s.C);
    ref::dropout_residual_backward(dx.data(), dbias.data(), w.data(), s.rows, s.C, p, 42, 3);
    EXPECT_TRUE(grad_close("dropout dx", dx, numeric_grad(x, loss)));
    EXPECT_TRUE(grad_close("dropout dbias", dbias, numeric_grad(bias, loss)));
    EXPECT_TRUE(grad_close("dropout dresidual (= dout)", w, numeric_grad(residual, loss)));
  }
}

TEST(PointwiseRef, DropoutWithZeroProbabilityIsExactlyTheSum) {
  const int64_t rows = 3;
  const int C = 16;
  const Vec x = uniform(rows * C, 1, -2, 2), bias = uniform(C, 2, -1, 1),
            residual = uniform(rows * C, 3, -2, 2);
  Vec out(rows * C), dx(rows * C), dbias(C);
  ref::dropout_residual_forward(out.data(), x.data(), bias.data(), residual.data(), rows, C, 0.0f,
                                1, 1);
  for (int64_t e = 0; e < rows * C; ++e) EXPECT_EQ(out[e], residual[e] + (x[e] + bias[e % C]));
  ref::dropout_residual_backward(dx.data(), dbias.data(), x.data(), rows, C, 0.0f, 1, 1);
  EXPECT_EQ(dx, x);
}

}  // namespace
}  // namespace replay
