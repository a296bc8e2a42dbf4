// Tests of the fp64 GEMM reference: hand-computed products in every layout, leading dimensions,
// batch, alpha and beta; GeLU values and its derivative against finite differences; bias gradients
// against explicit sums; and the linear-layer descs (linear_gemms) as a whole: the backward GEMMs
// of a GeLU MLP against finite differences of its loss.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "common/reference/gemm.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using Matrix = std::vector<double>;

Matrix random_matrix(size_t n, uint64_t seed) {
  return test::to_double(test::random_uniform(n, seed));
}

GemmDesc desc_of(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b) {
  GemmDesc d;
  d.m = m, d.n = n, d.k = k, d.trans_a = trans_a, d.trans_b = trans_b;
  return d;
}

// A = [[1,2,3],[4,5,6]], B = [[7,8],[9,10],[11,12]]: AB = [[58,64],[139,154]].
const Matrix kA = {1, 2, 3, 4, 5, 6};
const Matrix kAt = {1, 4, 2, 5, 3, 6};  // A stored transposed, [3,2]
const Matrix kB = {7, 8, 9, 10, 11, 12};
const Matrix kBt = {7, 9, 11, 8, 10, 12};  // B stored transposed, [2,3]
const Matrix kAB = {58, 64, 139, 154};

TEST(GemmRef, HandComputedEveryLayout) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Matrix d(4);
      ref::GemmRefArgs args;
      args.a = (ta ? kAt : kA).data();
      args.b = (tb ? kBt : kB).data();
      args.d = d.data();
      ref::gemm(desc_of(2, 2, 3, ta, tb), args);
      EXPECT_EQ(d, kAB) << "trans_a " << ta << " trans_b " << tb;
    }
  }
}

TEST(GemmRef, LeadingDimensionsBatchAlphaBeta) {
  // Two batches; A rows padded to 4 (lda), D rows padded to 3 (ldd); padding must be ignored and
  // kept.
  const double x = 1000.0;
  const Matrix a = {1, 2, 3, x, 4, 5, 6, x, /*batch 1 = 2A*/ 2, 4, 6, x, 8, 10, 12, x};
  const Matrix b = {7, 8, 9, 10, 11, 12, /*batch 1 = B*/ 7, 8, 9, 10, 11, 12};
  const Matrix c = {1, 1, x, 1, 1, x, 2, 2, x, 2, 2, x};
  GemmDesc g = desc_of(2, 2, 3, false, false);
  g.lda = 4, g.ldd = 3, g.batch = 2, g.alpha = 0.5f, g.beta = 1.0f;
  Matrix d(12, -7.0);
  ref::GemmRefArgs args;
  args.a = a.data(), args.b = b.data(), args.c = c.data(), args.d = d.data();
  ref::gemm(g, args);
  // batch 0: 0.5 AB + 1; batch 1: 0.5 (2A) B + 2 = AB + 2. Padding untouched.
  const Matrix expect = {30, 33, -7, 70.5, 78, -7, 60, 66, -7, 141, 156, -7};
  EXPECT_EQ(d, expect);
}

TEST(GemmRef, BiasAndGelu) {
  const Matrix bias = {10, 20};
  Matrix d(4), aux(4);
  ref::GemmRefArgs args;
  args.a = kA.data(), args.b = kB.data(), args.d = d.data(), args.bias = bias.data();
  GemmDesc g = desc_of(2, 2, 3, false, false);
  g.epilogue = Epilogue::kBias;
  ref::gemm(g, args);
  EXPECT_EQ(d, (Matrix{68, 84, 149, 174}));

  // Known values of the tanh GeLU.
  EXPECT_DOUBLE_EQ(ref::gelu_tanh(0.0), 0.0);
  EXPECT_NEAR(ref::gelu_tanh(1.0), 0.8411919906082768, 1e-15);
  EXPECT_NEAR(ref::gelu_tanh(-1.0), -0.15880800939172324, 1e-15);
  EXPECT_NEAR(ref::gelu_tanh(3.0), 2.996362607918227, 1e-15);

  // 1x1x1: Z = 2 * 0.5 = 1; with bias 0.5 the pre-activation is 1.5.
  const Matrix one_a = {2}, one_b = {0.5}, half = {0.5};
  ref::GemmRefArgs s;
  s.a = one_a.data(), s.b = one_b.data(), s.d = d.data(), s.aux_out = aux.data();
  GemmDesc g1 = desc_of(1, 1, 1, false, false);
  g1.epilogue = Epilogue::kGeluAux;
  ref::gemm(g1, s);
  EXPECT_DOUBLE_EQ(aux[0], 1.0);
  EXPECT_NEAR(d[0], 0.8411919906082768, 1e-15);
  g1.epilogue = Epilogue::kBiasGeluAux;
  s.bias = half.data();
  ref::gemm(g1, s);
  EXPECT_DOUBLE_EQ(aux[0], 1.5);
  EXPECT_NEAR(d[0], 1.3995715769802328, 1e-15);
  g1.epilogue = Epilogue::kBiasGelu;
  s.aux_out = nullptr;
  ref::gemm(g1, s);
  EXPECT_NEAR(d[0], 1.3995715769802328, 1e-15);
}

TEST(GemmRef, GeluDerivativeMatchesFiniteDifferences) {
  const double h = 1e-5;
  for (double x = -6.0; x <= 6.0; x += 0.125) {
    const double fd = (ref::gelu_tanh(x + h) - ref::gelu_tanh(x - h)) / (2 * h);
    EXPECT_NEAR(ref::gelu_tanh_grad(x), fd, 1e-9) << "x = " << x;
  }
}

TEST(GemmRef, DGeluIsProductTimesGeluDerivative) {
  const int64_t m = 6, n = 8, k = 5;
  const Matrix a = random_matrix(m * k, 1), b = random_matrix(k * n, 2);
  Matrix pre = random_matrix(m * n, 3);
  for (double& v : pre) v *= 4.0;  // cover the curved part of GeLU
  Matrix z(m * n), d(m * n), db(n);
  ref::GemmRefArgs args;
  args.a = a.data(), args.b = b.data(), args.d = z.data();
  ref::gemm(desc_of(m, n, k, false, false), args);
  GemmDesc g = desc_of(m, n, k, false, false);
  g.epilogue = Epilogue::kDGeluBGrad;
  args.d = d.data(), args.aux_in = pre.data(), args.bias_grad = db.data();
  ref::gemm(g, args);
  const double h = 1e-6;
  for (int64_t i = 0; i < m * n; ++i) {
    const double fd = (ref::gelu_tanh(pre[i] + h) - ref::gelu_tanh(pre[i] - h)) / (2 * h);
    EXPECT_NEAR(d[i], z[i] * fd, 1e-8) << "element " << i;
  }
  for (int64_t j = 0; j < n; ++j) {
    double s = 0.0;
    for (int64_t i = 0; i < m; ++i) s += d[i * n + j];
    EXPECT_NEAR(db[j], s, 1e-12) << "column " << j;
  }
}

TEST(GemmRef, BiasGradientsAreSumsOverK) {
  const int64_t m = 5, n = 6, k = 7;
  const Matrix a = random_matrix(m * k, 4), b = random_matrix(k * n, 5);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Matrix d(m * n), dba(m), dbb(n);
      GemmDesc g = desc_of(m, n, k, ta, tb);
      ref::GemmRefArgs args;
      args.a = a.data(), args.b = b.data(), args.d = d.data();
      g.epilogue = Epilogue::kBGradA;
      args.bias_grad = dba.data();
      ref::gemm(g, args);
      g.epilogue = Epilogue::kBGradB;
      args.bias_grad = dbb.data();
      ref::gemm(g, args);
      // op(A) row i is stored as row i of A, or column i of A stored [k,m]; likewise for op(B)
      // columns.
      for (int64_t i = 0; i < m; ++i) {
        double s = 0.0;
        for (int64_t kk = 0; kk < k; ++kk) s += ta ? a[kk * m + i] : a[i * k + kk];
        EXPECT_NEAR(dba[i], s, 1e-12) << "trans_a " << ta << " row " << i;
      }
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int64_t kk = 0; kk < k; ++kk) s += tb ? b[j * k + kk] : b[kk * n + j];
        EXPECT_NEAR(dbb[j], s, 1e-12) << "trans_b " << tb << " column " << j;
      }
    }
  }
}

TEST(GemmRef, LinearGemmsDescribeNnLinear) {
  const LinearGemms g = linear_gemms(/*tokens=*/32, /*in=*/16, /*out=*/24, /*bias=*/true,
                                     /*accumulate_wgrad=*/true);
  EXPECT_EQ(g.forward.m, 32);
  EXPECT_EQ(g.forward.n, 24);
  EXPECT_EQ(g.forward.k, 16);
  EXPECT_TRUE(!g.forward.trans_a && g.forward.trans_b);
  EXPECT_EQ(g.forward.epilogue, Epilogue::kBias);
  EXPECT_TRUE(!g.dgrad.trans_a && !g.dgrad.trans_b);
  EXPECT_EQ(g.dgrad.n, 16);
  EXPECT_EQ(g.dgrad.k, 24);
  EXPECT_TRUE(g.wgrad.trans_a && !g.wgrad.trans_b);
  EXPECT_EQ(g.wgrad.m, 24);
  EXPECT_EQ(g.wgrad.k, 32);
  EXPECT_EQ(g.wgrad.d_type, DType::kFP32);
  EXPECT_EQ(g.wgrad.beta, 1.0f);
  EXPECT_EQ(g.wgrad.epilogue, Epilogue::kBGradA);
  EXPECT_EQ(g.wgrad.normalized().lda, 24);  // dY stored [tokens, out]
  EXPECT_EQ(linear_gemms(32, 16, 24, false, false).wgrad.beta, 0.0f);
}

// A GeLU MLP, Y = gelu(X W1^T + b1) W2^T + b2, loss L = sum(G * Y). The backward runs the descs
// that linear_gemms produces, with the fused epilogues a workload uses; every gradient must match
// central finite differences of L.
TEST(GemmRef, MlpBackwardMatchesFiniteDifferences) {
  const int64_t T = 3, in = 4, hid = 8, out = 5;
  Matrix x = random_matrix(T * in, 10), w1 = random_matrix(hid * in, 11),
         b1 = random_matrix(hid, 12);
  Matrix w2 = random_matrix(out * hid, 13), b2 = random_matrix(out, 14),
         gy = random_matrix(T * out, 15);
  for (double& v : w1) v *= 2.0;  // pre-activations across GeLU's curved region

  LinearGemms fc1 = linear_gemms(T, in, hid, true, false);
  LinearGemms fc2 = linear_gemms(T, hid, out, true, false);
  fc1.forward.epilogue = Epilogue::kBiasGeluAux;
  fc2.dgrad.epilogue = Epilogue::kDGeluBGrad;  // yields fc1's bias gradient
  fc1.wgrad.epilogue = Epilogue::kNone;

  Matrix h(T * hid), pre(T * hid), y(T * out);
  auto forward = [&]() {
    ref::GemmRefArgs f1;
    f1.a = x.data(), f1.b = w1.data(), f1.bias = b1.data(), f1.d = h.data(),
    f1.aux_out = pre.data();
    ref::gemm(fc1.forward, f1);
    ref::GemmRefArgs f2;
    f2.a = h.data(), f2.b = w2.data(), f2.bias = b2.data(), f2.d = y.data();
    ref::gemm(fc2.forward, f2);
    double loss = 0.0;
    for (int64_t i = 0; i < T * out; ++i) loss += gy[i] * y[i];
    return loss;
  };
  forward();

  Matrix dw2(out * hid), db2(out), dpre(T * hid), db1(hid), dw1(hid * in), dx(T * in);
  ref::GemmRefArgs a;
  a.a = gy.data(), a.b = h.data(), a.d = dw2.data(), a.bias_grad = db2.data();
  ref::gemm(fc2.wgrad, a);
  a = {};
  a.a = gy.data(), a.b = w2.data(), a.d = dpre.data(), a.aux_in = pre.data(),
  a.bias_grad = db1.data();
  ref::gemm(fc2.dgrad, a);
  a = {};
  a.a = dpre.data(), a.b = x.data(), a.d = dw1.data();
  ref::gemm(fc1.wgrad, a);
  a = {};
  a.a = dpre.data(), a.b = w1.data(), a.d = dx.data();
  ref::gemm(fc1.dgrad, a);

  const double step = 1e-6;
  auto check = [&](const char* name, Matrix& param, const Matrix& grad) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double saved = param[i];
      param[i] = saved + step;
      const double up = forward();
      param[i] = saved - step;
      const double down = forward();
      param[i] = saved;
      EXPECT_NEAR(grad[i], (up - down) / (2 * step), 1e-7) << name << "[" << i << "]";
    }
  };
  check("x", x, dx);
  check("w1", w1, dw1);
  check("b1", b1, db1);
  check("w2", w2, dw2);
  check("b2", b2, db2);
}

TEST(GemmRef, WgradAccumulatesWithBetaOne) {
  const int64_t T = 4, in = 3, out = 2;
  const Matrix dy = random_matrix(T * out, 20), x = random_matrix(T * in, 21);
  const LinearGemms g = linear_gemms(T, in, out, false, true);
  Matrix fresh(out * in), acc = random_matrix(out * in, 22);
  const Matrix before = acc;
  ref::GemmRefArgs a;
  a.a = dy.data(), a.b = x.data(), a.d = fresh.data();
  GemmDesc once = g.wgrad;
  once.beta = 0.0f;
  ref::gemm(once, a);
  a.d = acc.data(), a.c = before.data();
  ref::gemm(g.wgrad, a);
  for (size_t i = 0; i < acc.size(); ++i) EXPECT_NEAR(acc[i], before[i] + fresh[i], 1e-14);
}

TEST(GemmRef, MissingOperandsAreRejected) {
  Matrix d(4);
  ref::GemmRefArgs args;
  args.a = kA.data(), args.b = kB.data(), args.d = d.data();
  GemmDesc g = desc_of(2, 2, 3, false, false);
  g.epilogue = Epilogue::kBias;
  EXPECT_THROW(ref::gemm(g, args), Error);
  g.epilogue = Epilogue::kNone;
  g.beta = 1.0f;
  EXPECT_THROW(ref::gemm(g, args), Error);
}

}  // namespace
}  // namespace replay
