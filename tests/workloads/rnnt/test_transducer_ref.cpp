// The fp64 transducer-loss reference on the CPU: the loss against a brute-force sum over every
// alignment on tiny lattices, the gradient against central finite differences on random ragged
// shapes, the gradient's identities, empty slots and clamped lengths; and the host side of the
// kernels' launcher that needs no GPU: 64-bit row offsets past 2^31, the workspace size, and the
// refusal of shapes the kernels do not support.
#include "workloads/rnnt/transducer_reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "tests/support/compare.h"
#include "workloads/rnnt/transducer.h"

namespace replay::rnnt {
namespace {

using Vec = std::vector<double>;
using test::dot;
using test::grad_close;
using test::numeric_grad;

Vec normal(size_t n, uint64_t seed, double stddev) {
  return test::to_double(test::random_normal(n, seed, 0.0f, static_cast<float>(stddev)));
}

TransducerShape make_shape(int64_t B, int64_t T, int64_t U, int64_t V, int blank) {
  TransducerShape s;
  s.batch = B;
  s.max_frames = T;
  s.max_labels = U;
  s.vocab = V;
  s.blank = blank;
  return s;
}

// -log P(y|x) by enumerating every path through the lattice from (0, 0): at (t, u) either the
// blank (to t + 1; at t = T_b - 1 it ends the path, which counts only if u = U_b) or the next
// label (to u + 1). Probabilities are multiplied and summed in linear space, independently of
// the reference's log-space recursion. paths counts the complete alignments.
double brute_force_loss(const Vec& logits, const std::vector<int32_t>& labels, int64_t b,
                        int64_t Tb, int64_t Ub, const TransducerShape& s, int64_t* paths) {
  auto prob = [&](int64_t t, int64_t u, int64_t v) {
    const double* z =
        logits.data() + transducer_row(b, t, u, s.max_frames, s.positions()) * s.vocab;
    double sum = 0.0;
    for (int64_t k = 0; k < s.vocab; ++k) sum += std::exp(z[k]);
    return std::exp(z[v]) / sum;
  };
  double total = 0.0;
  std::function<void(int64_t, int64_t, double)> walk = [&](int64_t t, int64_t u, double p) {
    if (t == Tb) {  // emitted the blank at the last frame
      if (u == Ub) {
        total += p;
        ++*paths;
      }
      return;
    }
    walk(t + 1, u, p * prob(t, u, s.blank));
    if (u < Ub) walk(t, u + 1, p * prob(t, u, labels[b * s.max_labels + u]));
  };
  walk(0, 0, 1.0);
  return -std::log(total);
}

int64_t binomial(int64_t n, int64_t k) {
  int64_t r = 1;
  for (int64_t i = 1; i <= k; ++i) r = r * (n - k + i) / i;
  return r;
}

// T = 3, U = 2, V = 3, with the blank first and last: the full utterance (C(4, 2) = 6 alignments)
// and a shorter one inside the same padding (T_b = 2, U_b = 1).
TEST(TransducerReference, LossMatchesBruteForceOverAlignments) {
  for (int blank : {0, 2}) {
    const TransducerShape s = make_shape(2, 3, 2, 3, blank);
    const Vec logits = normal(s.elements(), 11 + blank, 1.5);
    const int32_t other = blank == 0 ? 1 : 0;
    const std::vector<int32_t> labels = {other, 2 - blank / 2, other, other};
    const std::vector<int32_t> frames = {3, 2}, label_lengths = {2, 1};
    Vec loss(2);
    ref::transducer_loss(loss.data(), nullptr, logits.data(), labels.data(), frames.data(),
                         label_lengths.data(), s);
    for (int64_t b = 0; b < 2; ++b) {
      int64_t paths = 0;
      const double expect =
          brute_force_loss(logits, labels, b, frames[b], label_lengths[b], s, &paths);
      EXPECT_EQ(paths, binomial(frames[b] + label_lengths[b] - 1, label_lengths[b]));
      EXPECT_NEAR(loss[b], expect, 1e-12 * std::fabs(expect))
          << "blank " << blank << ", utterance " << b;
    }
  }
}

struct Ragged {
  TransducerShape shape;
  std::vector<int32_t> labels, frames, label_lengths;
};

// Random lengths (utterance 0 at the full padding), labels anywhere but the blank, and padding
// labels out of range (they must never be read).
Ragged ragged(int64_t B, int64_t T, int64_t U, int64_t V, int blank, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Ragged r{make_shape(B, T, U, V, blank), {}, {}, {}};
  for (int64_t b = 0; b < B; ++b) {
    r.frames.push_back(b == 0 ? T : 1 + static_cast<int32_t>(rng() % T));
    r.label_lengths.push_back(b == 0 ? U : static_cast<int32_t>(rng() % (U + 1)));
    for (int64_t u = 0; u < U; ++u) {
      int32_t y = static_cast<int32_t>(rng() % (V - 1));
      if (y >= blank) ++y;
      r.labels.push_back(u < r.label_lengths.back() ? y : static_cast<int32_t>(V + 100));
    }
  }
  return r;
}

TEST(TransducerReference, GradientMatchesFiniteDifferences) {
  struct Case {
    int64_t B, T, U, V;
    int blank;
  };
  const Case cases[] = {
      {1, 1, 0, 2, 0}, {1, 3, 2, 3, 2}, {3, 4, 3, 5, 0}, {2, 5, 4, 6, 5}, {3, 2, 5, 4, 1}};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    const Ragged r = ragged(c.B, c.T, c.U, c.V, c.blank, ++seed);
    const TransducerShape& s = r.shape;
    Vec logits = normal(s.elements(), ++seed, 2.0);
    const double scale = 0.75;
    Vec loss(s.batch), grad(s.elements());
    ref::transducer_loss(loss.data(), grad.data(), logits.data(), r.labels.data(), r.frames.data(),
                         r.label_lengths.data(), s, scale);
    auto objective = [&] {
      Vec l(s.batch);
      ref::transducer_loss(l.data(), nullptr, logits.data(), r.labels.data(), r.frames.data(),
                           r.label_lengths.data(), s);
      double sum = 0.0;
      for (double x : l) sum += x;
      return scale * sum;
    };
    Vec numeric(s.elements());
    const double h = 1e-6;
    for (int64_t i = 0; i < s.elements(); ++i) {
      const double saved = logits[i];
      logits[i] = saved + h;
      const double up = objective();
      logits[i] = saved - h;
      const double down = objective();
      logits[i] = saved;
      numeric[i] = (up - down) / (2.0 * h);
    }
    const std::string what = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " U" +
                             std::to_string(c.U) + " V" + std::to_string(c.V);
    EXPECT_TRUE(grad_close(what, grad, numeric, 1e-6));
  }
}

// Every row's gradient sums to zero over the vocabulary (log_softmax ignores a shift of the row),
// rows past the lengths are exactly zero, and the loss is unchanged by such a shift.
TEST(TransducerReference, GradientIdentitiesAndPadding) {
  const Ragged r = ragged(4, 6, 4, 7, 3, 7);
  const TransducerShape& s = r.shape;
  Vec logits = normal(s.elements(), 8, 2.0);
  Vec loss(s.batch), grad(s.elements());
  ref::transducer_loss(loss.data(), grad.data(), logits.data(), r.labels.data(), r.frames.data(),
                       r.label_lengths.data(), s);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.max_frames; ++t)
      for (int64_t u = 0; u < s.positions(); ++u) {
        const double* g = grad.data() + transducer_row(b, t, u, s.max_frames, s.positions()) * 7;
        double sum = 0.0, mag = 0.0;
        for (int v = 0; v < 7; ++v) {
          sum += g[v];
          mag += std::fabs(g[v]);
        }
        if (t < r.frames[b] && u <= r.label_lengths[b]) {
          EXPECT_NEAR(sum, 0.0, 1e-14) << b << " " << t << " " << u;
        } else {
          EXPECT_EQ(mag, 0.0) << "gradient past the lengths at " << b << " " << t << " " << u;
        }
      }
  for (int64_t i = 0; i < 7; ++i) logits[i] += 3.0;  // shifts row (0, 0, 0)
  Vec shifted(s.batch);
  ref::transducer_loss(shifted.data(), nullptr, logits.data(), r.labels.data(), r.frames.data(),
                       r.label_lengths.data(), s);
  EXPECT_NEAR(shifted[0], loss[0], 1e-12 * std::fabs(loss[0]));
}

// Frame length 0 is an empty slot; lengths past the padding are clamped to it; U = 0 (blanks
// only) needs no labels. With V = 1 every probability is 1: the loss is 0.
TEST(TransducerReference, EmptySlotsClampedLengthsAndNoLabels) {
  const Ragged r = ragged(3, 4, 2, 5, 4, 21);
  const TransducerShape& s = r.shape;
  const Vec logits = normal(s.elements(), 22, 1.0);
  std::vector<int32_t> frames = r.frames, label_lengths = r.label_lengths;
  Vec loss(3), grad(s.elements());
  ref::transducer_loss(loss.data(), grad.data(), logits.data(), r.labels.data(), frames.data(),
                       label_lengths.data(), s);
  frames[1] = 0;
  frames[0] = 1000;  // clamped to T = 4 (utterance 0 is already full)
  label_lengths[0] = 99;
  Vec loss2(3), grad2(s.elements());
  ref::transducer_loss(loss2.data(), grad2.data(), logits.data(), r.labels.data(), frames.data(),
                       label_lengths.data(), s);
  EXPECT_EQ(loss2[0], loss[0]);
  EXPECT_EQ(loss2[1], 0.0);
  EXPECT_EQ(loss2[2], loss[2]);
  const int64_t per_utterance = s.max_frames * s.positions() * s.vocab;
  for (int64_t i = 0; i < per_utterance; ++i) EXPECT_EQ(grad2[per_utterance + i], 0.0);

  const TransducerShape blanks_only = make_shape(2, 5, 0, 1, 0);
  const Vec z = normal(blanks_only.elements(), 23, 1.0);
  const std::vector<int32_t> f = {5, 3}, l = {0, 0};
  Vec lb(2), gb(blanks_only.elements());
  ref::transducer_loss(lb.data(), gb.data(), z.data(), nullptr, f.data(), l.data(), blanks_only);
  EXPECT_EQ(lb[0], 0.0);
  EXPECT_EQ(lb[1], 0.0);
  for (double g : gb) EXPECT_EQ(g, 0.0);
}

// NVIDIA's MLPerf padding (192 utterances, 205 frames, 72 label positions, V = 1024) holds 2.9e9
// logits: the last rows' offsets need 64 bits, and the helper must not wrap on the way.
TEST(TransducerIndex, RowOffsetsPast2To31) {
  const TransducerShape s = make_shape(192, 205, 71, 1024, 1023);
  EXPECT_EQ(s.rows(), int64_t{192} * 205 * 72);
  EXPECT_EQ(s.elements(), int64_t{2901934080});
  EXPECT_GT(s.elements(), int64_t{INT_MAX});
  const int64_t last = transducer_row(191, 204, 71, 205, 72);
  EXPECT_EQ(last, s.rows() - 1);
  EXPECT_EQ(last * s.vocab + 1023, s.elements() - 1);
  // The utterance that straddles 2^31: its first row is below, its last row above.
  const int64_t b = (int64_t{1} << 31) / (205 * 72 * 1024);
  EXPECT_EQ(b, 142);
  EXPECT_LT(transducer_row(b, 0, 0, 205, 72) * 1024, int64_t{1} << 31);
  EXPECT_GT(transducer_row(b, 204, 71, 205, 72) * 1024, int64_t{1} << 31);
  // Every row is its predecessor plus one, across the boundary.
  for (int64_t t = 0; t < 205; ++t)
    for (int64_t u = 0; u < 72; ++u)
      ASSERT_EQ(transducer_row(b, t, u, 205, 72), transducer_row(b, 0, 0, 205, 72) + t * 72 + u);
  static_assert(transducer_row(191, 204, 71, 205, 72) * 1024 == int64_t{2901934080} - 1024,
                "constexpr on the host");
}

TEST(TransducerLauncher, WorkspaceSize) {
  const TransducerShape s = make_shape(192, 205, 71, 1024, 1023);
  const size_t cells = static_cast<size_t>(s.rows()) * sizeof(float);
  const size_t bytes = transducer_workspace_bytes(s);
  EXPECT_GE(bytes, 5 * cells + 192 * sizeof(float) + sizeof(int32_t));
  EXPECT_LE(bytes, 5 * cells + 192 * sizeof(float) + 7 * 256);
  EXPECT_EQ(bytes % 256, 0u);
}

// The launcher checks its arguments before any CUDA call, so these run without a GPU.
TEST(TransducerLauncher, RefusesUnsupportedShapes) {
  alignas(16) static unsigned char workspace[1 << 16];
  int32_t dummy[4] = {};
  float loss[4];
  TransducerInputs in;
  in.logits = workspace;
  in.labels = dummy;
  in.frame_lengths = dummy;
  in.label_lengths = dummy;
  auto refused = [&](const TransducerShape& s, DType dtype = DType::kFP16) {
    in.dtype = dtype;
    try {
      transducer_forward(loss, nullptr, in, s, workspace, sizeof(workspace), nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refused(make_shape(2, 4, 512, 8, 0)).find("max_labels + 1"), std::string::npos);
  EXPECT_NE(refused(make_shape(2, 4, 3, 8, 8)).find("blank in [0, V)"), std::string::npos);
  EXPECT_NE(refused(make_shape(70000, 1, 1, 8, 0)).find("batch"), std::string::npos);
  EXPECT_NE(refused(make_shape(2, 4, 3, 8, 0), DType::kINT32).find("fp16, bf16 or fp32"),
            std::string::npos);
  EXPECT_NE(refused(make_shape(64, 256, 127, 1024, 0)).find("workspace too small"),
            std::string::npos);
}

}  // namespace
}  // namespace replay::rnnt
