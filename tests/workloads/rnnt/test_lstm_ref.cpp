// The fp64 LSTM reference on the CPU: one step computed by hand (which pins the gate order i, f,
// g, o), every gradient of a two-layer ragged batch against central finite differences (a sample
// of length 0 included), padding that is never read, samples that do not interact, layers that
// compose; and the host side of lstm.h that needs no GPU: LstmDesc's checks and sizes, and the
// weight layout's names and views.
#include "workloads/rnnt/lstm_reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "workloads/rnnt/lstm.h"

namespace replay::rnnt {
namespace {

using Vec = std::vector<double>;
using ref::LstmLayerWeights;
using ref::LstmShape;

Vec normal(size_t n, std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

std::vector<LstmLayerWeights> random_weights(const LstmShape& s, std::mt19937_64& rng,
                                             double stddev) {
  std::vector<LstmLayerWeights> w = ref::lstm_zero_weights(s);
  for (LstmLayerWeights& l : w) {
    l.w_ih = normal(l.w_ih.size(), rng, stddev);
    l.w_hh = normal(l.w_hh.size(), rng, stddev);
    l.b_ih = normal(l.b_ih.size(), rng, stddev);
    l.b_hh = normal(l.b_hh.size(), rng, stddev);
  }
  return w;
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// I = H = 1, one step: every gate's pre-activation distinct, so a swapped gate shows.
TEST(LstmReference, OneStepByHand) {
  LstmShape s;
  s.input = 1;
  s.hidden = 1;
  std::vector<LstmLayerWeights> w(1);
  w[0].w_ih = {0.3, -0.7, 1.1, 0.5};  // rows i, f, g, o
  w[0].w_hh = {0.2, 0.4, -0.6, 0.9};
  w[0].b_ih = {0.05, 0.9, -0.2, 0.1};
  w[0].b_hh = {-0.15, 0.1, 0.3, -0.4};
  const double x = 0.8, h0 = -0.5, c0 = 0.7;
  const int32_t len = 1;
  double y = 0, hn = 0, cn = 0;
  ref::lstm_forward(s, w, &x, &len, &h0, &c0, &y, &hn, &cn);
  auto pre = [&](int k) {
    return w[0].w_ih[k] * x + w[0].w_hh[k] * h0 + w[0].b_ih[k] + w[0].b_hh[k];
  };
  const double i = sigmoid(pre(0)), f = sigmoid(pre(1)), g = std::tanh(pre(2)), o = sigmoid(pre(3));
  const double c = f * c0 + i * g, h = o * std::tanh(c);
  EXPECT_NEAR(cn, c, 1e-15);
  EXPECT_NEAR(hn, h, 1e-15);
  EXPECT_NEAR(y, h, 1e-15);
}

struct Problem {
  LstmShape s;
  std::vector<LstmLayerWeights> w;
  Vec x, h0, c0, dy, dhn, dcn;
  std::vector<int32_t> lengths;

  // sum(dy * y) + sum(dhn * hn) + sum(dcn * cn): the scalar lstm_backward differentiates (y is
  // zero past the lengths, so dy there adds nothing).
  double loss() const {
    Vec y(s.batch * s.max_seq * s.hidden), hn(s.layers * s.batch * s.hidden), cn(hn.size());
    ref::lstm_forward(s, w, x.data(), lengths.data(), h0.data(), c0.data(), y.data(), hn.data(),
                      cn.data());
    double sum = 0.0;
    for (size_t k = 0; k < y.size(); ++k) sum += dy[k] * y[k];
    for (size_t k = 0; k < hn.size(); ++k) sum += dhn[k] * hn[k] + dcn[k] * cn[k];
    return sum;
  }
};

Problem make_problem(int64_t I, int64_t H, int64_t L, std::vector<int32_t> lengths, int64_t T,
                     uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.s.input = I;
  p.s.hidden = H;
  p.s.layers = L;
  p.s.batch = static_cast<int64_t>(lengths.size());
  p.s.max_seq = T;
  p.lengths = std::move(lengths);
  p.w = random_weights(p.s, rng, 0.5);
  p.x = normal(p.s.batch * T * I, rng, 1.0);
  p.h0 = normal(L * p.s.batch * H, rng, 0.5);
  p.c0 = normal(L * p.s.batch * H, rng, 0.5);
  p.dy = normal(p.s.batch * T * H, rng, 1.0);
  p.dhn = normal(L * p.s.batch * H, rng, 1.0);
  p.dcn = normal(L * p.s.batch * H, rng, 1.0);
  return p;
}

// Central differences of p.loss() in every element of `v` (a vector inside p), against `grad`.
void check_fd(Problem& p, Vec& v, const Vec& grad, const std::string& what,
              const std::function<bool(size_t)>& inside = nullptr) {
  ASSERT_EQ(v.size(), grad.size()) << what;
  const double eps = 1e-5;
  double worst = 0.0;
  for (size_t k = 0; k < v.size(); ++k) {
    double fd = 0.0;
    if (!inside || inside(k)) {
      const double keep = v[k];
      v[k] = keep + eps;
      const double up = p.loss();
      v[k] = keep - eps;
      const double down = p.loss();
      v[k] = keep;
      fd = (up - down) / (2 * eps);
    }
    const double err = std::fabs(fd - grad[k]);
    worst = std::max(worst, err / (1.0 + std::fabs(fd)));
    EXPECT_LE(err, 1e-7 + 1e-6 * std::fabs(fd))
        << what << "[" << k << "]: analytic " << grad[k] << ", finite difference " << fd;
  }
  std::printf("  %-12s %zu elements, worst |analytic - fd| / (1 + |fd|) = %.2e\n", what.c_str(),
              v.size(), worst);
}

// Two layers, a ragged batch with a sample of length 0, nonzero initial states and every output
// gradient: dx, dh0, dc0 and all eight weight tensors against finite differences of the forward.
TEST(LstmReference, GradientsMatchFiniteDifferences) {
  Problem p = make_problem(3, 4, 2, {5, 2, 0, 4}, 5, 11);
  const LstmShape& s = p.s;
  Vec dx(s.batch * s.max_seq * s.input, -1.0), dh0(p.h0.size()), dc0(p.c0.size());
  std::vector<LstmLayerWeights> dw = ref::lstm_zero_weights(s);
  ref::lstm_backward(s, p.w, p.x.data(), p.lengths.data(), p.h0.data(), p.c0.data(), p.dy.data(),
                     p.dhn.data(), p.dcn.data(), dx.data(), dh0.data(), dc0.data(), &dw);

  auto x_inside = [&](size_t k) {
    const int64_t b = static_cast<int64_t>(k) / (s.max_seq * s.input);
    const int64_t t = (static_cast<int64_t>(k) / s.input) % s.max_seq;
    return t < p.lengths[b];
  };
  check_fd(p, p.x, dx, "dx", x_inside);
  check_fd(p, p.h0, dh0, "dh0");
  check_fd(p, p.c0, dc0, "dc0");
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string n = "_l" + std::to_string(l);
    check_fd(p, p.w[l].w_ih, dw[l].w_ih, "weight_ih" + n);
    check_fd(p, p.w[l].w_hh, dw[l].w_hh, "weight_hh" + n);
    check_fd(p, p.w[l].b_ih, dw[l].b_ih, "bias_ih" + n);
    check_fd(p, p.w[l].b_hh, dw[l].b_hh, "bias_hh" + n);
  }
  // The empty sample passes its final-state gradients straight through.
  for (int64_t l = 0; l < s.layers; ++l)
    for (int64_t j = 0; j < s.hidden; ++j) {
      const int64_t at = (l * s.batch + 2) * s.hidden + j;
      EXPECT_EQ(dh0[at], p.dhn[at]);
      EXPECT_EQ(dc0[at], p.dcn[at]);
    }
}

// x and dy past the lengths are NaN: nothing reads them; y and dx are zero there.
TEST(LstmReference, PaddingIsNotRead) {
  Problem p = make_problem(3, 5, 2, {4, 1, 3}, 6, 21);
  const LstmShape& s = p.s;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = p.lengths[b]; t < s.max_seq; ++t) {
      for (int64_t k = 0; k < s.input; ++k) p.x[(b * s.max_seq + t) * s.input + k] = nan;
      for (int64_t k = 0; k < s.hidden; ++k) p.dy[(b * s.max_seq + t) * s.hidden + k] = nan;
    }
  Vec y(s.batch * s.max_seq * s.hidden), hn(p.h0.size()), cn(p.h0.size());
  ref::lstm_forward(s, p.w, p.x.data(), p.lengths.data(), p.h0.data(), p.c0.data(), y.data(),
                    hn.data(), cn.data());
  Vec dx(p.x.size()), dh0(p.h0.size()), dc0(p.h0.size());
  std::vector<LstmLayerWeights> dw = ref::lstm_zero_weights(s);
  ref::lstm_backward(s, p.w, p.x.data(), p.lengths.data(), p.h0.data(), p.c0.data(), p.dy.data(),
                     p.dhn.data(), p.dcn.data(), dx.data(), dh0.data(), dc0.data(), &dw);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.max_seq; ++t) {
      for (int64_t k = 0; k < s.hidden; ++k) {
        const double v = y[(b * s.max_seq + t) * s.hidden + k];
        ASSERT_TRUE(std::isfinite(v)) << b << " " << t;
        if (t >= p.lengths[b]) {
          ASSERT_EQ(v, 0.0);
        }
      }
      for (int64_t k = 0; k < s.input; ++k) {
        const double v = dx[(b * s.max_seq + t) * s.input + k];
        ASSERT_TRUE(std::isfinite(v)) << b << " " << t;
        if (t >= p.lengths[b]) {
          ASSERT_EQ(v, 0.0);
        }
      }
    }
  for (double v : hn) ASSERT_TRUE(std::isfinite(v));
  for (double v : dh0) ASSERT_TRUE(std::isfinite(v));
  for (const LstmLayerWeights& l : dw)
    for (const Vec* g : {&l.w_ih, &l.w_hh, &l.b_ih, &l.b_hh})
      for (double v : *g) ASSERT_TRUE(std::isfinite(v));
}

// The batch is the samples run one at a time, each with its own length as the padding.
TEST(LstmReference, SamplesAreIndependent) {
  Problem p = make_problem(2, 3, 2, {3, 5, 1}, 5, 31);
  const LstmShape& s = p.s;
  Vec y(s.batch * s.max_seq * s.hidden), hn(p.h0.size()), cn(p.h0.size());
  ref::lstm_forward(s, p.w, p.x.data(), p.lengths.data(), p.h0.data(), p.c0.data(), y.data(),
                    hn.data(), cn.data());
  for (int64_t b = 0; b < s.batch; ++b) {
    LstmShape one = s;
    one.batch = 1;
    one.max_seq = p.lengths[b];
    Vec x1(p.x.begin() + b * s.max_seq * s.input,
           p.x.begin() + (b * s.max_seq + one.max_seq) * s.input);
    Vec h1(s.layers * s.hidden), c1(h1.size());
    for (int64_t l = 0; l < s.layers; ++l)
      for (int64_t j = 0; j < s.hidden; ++j) {
        h1[l * s.hidden + j] = p.h0[(l * s.batch + b) * s.hidden + j];
        c1[l * s.hidden + j] = p.c0[(l * s.batch + b) * s.hidden + j];
      }
    Vec y1(one.max_seq * s.hidden), hn1(h1.size()), cn1(h1.size());
    ref::lstm_forward(one, p.w, x1.data(), &p.lengths[b], h1.data(), c1.data(), y1.data(),
                      hn1.data(), cn1.data());
    for (int64_t t = 0; t < one.max_seq; ++t)
      for (int64_t j = 0; j < s.hidden; ++j)
        EXPECT_EQ(y[(b * s.max_seq + t) * s.hidden + j], y1[t * s.hidden + j]);
    for (int64_t l = 0; l < s.layers; ++l)
      for (int64_t j = 0; j < s.hidden; ++j) {
        EXPECT_EQ(hn[(l * s.batch + b) * s.hidden + j], hn1[l * s.hidden + j]);
        EXPECT_EQ(cn[(l * s.batch + b) * s.hidden + j], cn1[l * s.hidden + j]);
      }
  }
}

// Two layers are layer 0 run alone, its output fed to layer 1 run alone; the states stack [L, B,
// H]. Null initial states are zeros.
TEST(LstmReference, LayersCompose) {
  Problem p = make_problem(3, 4, 2, {4, 2}, 4, 41);
  const LstmShape& s = p.s;
  Vec y(s.batch * s.max_seq * s.hidden), hn(p.h0.size()), cn(p.h0.size());
  ref::lstm_forward(s, p.w, p.x.data(), p.lengths.data(), nullptr, nullptr, y.data(), hn.data(),
                    cn.data());
  LstmShape l0 = s, l1 = s;
  l0.layers = l1.layers = 1;
  l1.input = s.hidden;
  const int64_t per_layer = s.batch * s.hidden;
  Vec y0(y.size()), h0n(per_layer), c0n(per_layer), y1(y.size()), h1n(per_layer), c1n(per_layer);
  const Vec zeros(per_layer, 0.0);
  ref::lstm_forward(l0, {p.w[0]}, p.x.data(), p.lengths.data(), zeros.data(), zeros.data(),
                    y0.data(), h0n.data(), c0n.data());
  ref::lstm_forward(l1, {p.w[1]}, y0.data(), p.lengths.data(), nullptr, nullptr, y1.data(),
                    h1n.data(), c1n.data());
  for (size_t k = 0; k < y.size(); ++k) EXPECT_EQ(y[k], y1[k]);
  for (int64_t k = 0; k < per_layer; ++k) {
    EXPECT_EQ(hn[k], h0n[k]);
    EXPECT_EQ(cn[k], c0n[k]);
    EXPECT_EQ(hn[per_layer + k], h1n[k]);
    EXPECT_EQ(cn[per_layer + k], c1n[k]);
  }
}

// ---------------------------------------------------------------------------------------------------
// lstm.h on the host.

LstmDesc mlperf_encoder() {
  LstmDesc d;
  d.input_size = 240;
  d.hidden_size = 1024;
  d.layers = 2;
  d.batch = 192;
  d.max_seq = 410;
  return d;
}

TEST(LstmDesc, SizesAndFlops) {
  const LstmDesc d = mlperf_encoder();
  EXPECT_NO_THROW(d.validate());
  EXPECT_EQ(d.layer_input(0), 240);
  EXPECT_EQ(d.layer_input(1), 1024);
  EXPECT_EQ(d.x_elements(), 410 * 192 * 240);
  EXPECT_EQ(d.y_elements(), 410 * 192 * 1024);
  EXPECT_EQ(d.state_elements(), 2 * 192 * 1024);
  // 2 * 4H * (I_l + H) per step and sample, summed over the layers.
  const double per = 2.0 * 4 * 1024 * (240 + 1024) + 2.0 * 4 * 1024 * (1024 + 1024);
  EXPECT_DOUBLE_EQ(d.flops(), per * 192 * 410);
  EXPECT_EQ(d.describe(), "lstm I=240 H=1024 L=2 B=192 T=410 fp16 seq-major fill 0");
  LstmDesc e = d;
  e.layout = LstmLayout::kBatchMajor;
  e.dtype = DType::kFP32;
  e.dropout = 0.1f;
  e.padding_fill = -1.5f;
  EXPECT_EQ(e.describe(),
            "lstm I=240 H=1024 L=2 B=192 T=410 fp32 batch-major fill -1.5 dropout 0.1");
}

TEST(LstmDesc, RejectsMalformed) {
  auto refuses = [](const std::function<void(LstmDesc&)>& change, const char* field) {
    LstmDesc d = mlperf_encoder();
    change(d);
    try {
      d.validate();
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refuses([](LstmDesc& d) { d.input_size = 0; }, "input_size");
  refuses([](LstmDesc& d) { d.hidden_size = -1; }, "hidden_size");
  refuses([](LstmDesc& d) { d.layers = 0; }, "layers");
  refuses([](LstmDesc& d) { d.batch = 0; }, "batch");
  refuses([](LstmDesc& d) { d.max_seq = int64_t{1} << 31; }, "max_seq");
  refuses([](LstmDesc& d) { d.dtype = DType::kFP8E4M3; }, "storage");
  refuses([](LstmDesc& d) { d.dropout = 1.0f; }, "dropout");
  refuses([](LstmDesc& d) { d.padding_fill = std::numeric_limits<float>::infinity(); },
          "padding_fill");
}

TEST(LstmWeightLayout, FindAndView) {
  LstmWeightLayout layout;
  layout.dtype = DType::kFP16;
  layout.hidden = 4;
  layout.bytes = 1024;
  LstmWeightTensor w;
  w.name = "weight_ih_l0";
  w.rows = 16;
  w.cols = 3;
  w.offset = 8;
  LstmWeightTensor b;
  b.name = "bias_hh_l0";
  b.param = LstmParam::kBiasHH;
  b.rows = 16;
  b.cols = 1;
  b.offset = 200;
  layout.tensors = {w, b};
  EXPECT_EQ(&layout.find("bias_hh_l0"), &layout.tensors[1]);
  try {
    layout.find("weight_hh_l3");
    ADD_FAILURE() << "found a tensor that is not there";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight_ih_l0, bias_hh_l0"), std::string::npos)
        << e.what();
  }
  char space[1024];
  const TensorView vw = layout.view(space, layout.tensors[0]);
  EXPECT_EQ(vw.data, space + 16);
  EXPECT_EQ(vw.ndim, 2);
  EXPECT_EQ(vw.shape[0], 16);
  EXPECT_EQ(vw.shape[1], 3);
  const TensorView vb = layout.view(space, layout.tensors[1]);
  EXPECT_EQ(vb.data, space + 400);
  EXPECT_EQ(vb.ndim, 1);
  EXPECT_EQ(layout.tensors[0].gate_offset(2), 8 + 2 * 4 * 3);  // the g block's first element
  EXPECT_EQ(layout.tensors[1].gate_offset(1), 204);            // the forget block's
}

}  // namespace
}  // namespace replay::rnnt
