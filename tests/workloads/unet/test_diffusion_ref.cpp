// The diffusion objective and the UNet's pointwise ops on the CPU: the schedule against Stable
// Diffusion's published numbers, the Philox draws (timesteps, normals), the fp64 sampling reference
// against the identities that tie the noised latent and the v-target together, the loss floor
// against a Monte Carlo estimate, the MSE, GEGLU, upsampling and concatenation references against
// finite differences or their adjoints, the timestep embedding against its definition, and the
// host fp16 conversion against cuda_fp16.h's.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/philox.h"
#include "tests/support/compare.h"
#include "workloads/unet/diffusion.h"
#include "workloads/unet/diffusion_reference.h"
#include "workloads/unet/fp16_bits.h"
#include "workloads/unet/pointwise_reference.h"

namespace replay::unet {
namespace {

using Vec = std::vector<double>;
using test::dot;
using test::grad_close;
using test::numeric_grad;

Vec normal(size_t n, uint64_t seed, double mean = 0.0, double stddev = 1.0) {
  return test::to_double(
      test::random_normal(n, seed, static_cast<float>(mean), static_cast<float>(stddev)));
}

// ---------------------------------------------------------------------------------------------------
// fp16 bits

TEST(Fp16Bits, EveryHalfConvertsExactlyAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float mine = half_bits_to_float(h);
    const float cuda = __half2float(__ushort_as_half(h));
    if (std::isnan(cuda)) {
      ASSERT_TRUE(std::isnan(mine)) << "bits " << b;
      ASSERT_FALSE(half_bits_finite(h));
      continue;
    }
    ASSERT_EQ(float_bits(mine), float_bits(cuda)) << "bits " << b;
    ASSERT_EQ(float_to_half_bits(mine), h) << "bits " << b;
    ASSERT_EQ(half_bits_finite(h), std::isfinite(cuda)) << "bits " << b;
  }
}

TEST(Fp16Bits, FloatsRoundToNearestEvenAsCudaDoes) {
  std::vector<float> values = {
      0.0f,   -0.0f,          1.0f,           65504.0f, 65519.996f,    65520.0f,      65536.0f,
      1e30f,  -1e30f,         6.1035156e-5f,  6.0e-5f,  2.9802322e-8f, 2.9802326e-8f, 5.9604645e-8f,
      1e-10f, 1.00048828125f, 1.00146484375f, INFINITY, -INFINITY};
  // Halfway cases between neighbouring halves and their neighbours, over the whole range.
  for (uint32_t b = 0; b < 0x7c00u; b += 7) {
    const float lo = half_bits_to_float(static_cast<uint16_t>(b));
    const float hi = half_bits_to_float(static_cast<uint16_t>(b + 1));
    const float mid = 0.5f * (lo + hi);
    values.push_back(mid);
    values.push_back(std::nextafter(mid, 0.0f));
    values.push_back(std::nextafter(mid, INFINITY));
    values.push_back(-mid);
  }
  for (float v : test::random_normal(20000, 7, 0.0f, 300.0f)) values.push_back(v);
  for (float v : values) {
    const uint16_t cuda = __half_as_ushort(__float2half_rn(v));
    EXPECT_EQ(float_to_half_bits(v), cuda) << "value " << v;
  }
  EXPECT_FALSE(half_bits_finite(float_to_half_bits(NAN)));
}

// ---------------------------------------------------------------------------------------------------
// Schedule

TEST(DiffusionSchedule, MatchesStableDiffusionsPublishedValues) {
  const Vec b = ref::betas();
  const Vec acp = ref::alphas_cumprod();
  ASSERT_EQ(b.size(), 1000u);
  EXPECT_NEAR(b.front(), 0.00085, 1e-16);
  EXPECT_NEAR(b.back(), 0.012, 1e-16);
  // Linear in sqrt(beta) (diffusers' scaled_linear), not in beta: the midpoint of the square roots.
  EXPECT_NEAR(std::sqrt(b[500]) - std::sqrt(b[499]), std::sqrt(b[1]) - std::sqrt(b[0]), 1e-15);
  EXPECT_GT(b[500] - b[499], b[1] - b[0]);
  EXPECT_NEAR(acp.front(), 0.99915, 1e-15);
  // Lin et al. 2023 (Common Diffusion Noise Schedules and Sample Steps are Flawed), section 3.1:
  // SD's last step keeps x_1000 = 0.068265 x_0 + 0.997667 eps.
  EXPECT_NEAR(std::sqrt(acp.back()), 0.068265, 5e-7);
  EXPECT_NEAR(std::sqrt(1.0 - acp.back()), 0.997667, 5e-7);
  // diffusers' LMS/Euler schedulers start SD's sampling at init_noise_sigma 14.6146.
  EXPECT_NEAR(std::sqrt((1.0 - acp.back()) / acp.back()), 14.6146, 5e-5);
  for (size_t t = 1; t < acp.size(); ++t) ASSERT_LT(acp[t], acp[t - 1]);
}

TEST(DiffusionDraws, TimestepsCoverTheScheduleUniformly) {
  EXPECT_EQ(diffusion_timestep_from_bits(0), 0);
  EXPECT_EQ(diffusion_timestep_from_bits(0xffffffffu), 999);
  // floor(bits * 1000 / 2^32): t starts at bits = ceil(t * 2^32 / 1000).
  for (int t : {1, 2, 500, 998, 999}) {
    const uint64_t first = (static_cast<uint64_t>(t) * (uint64_t{1} << 32) + 999) / 1000;
    EXPECT_EQ(diffusion_timestep_from_bits(static_cast<uint32_t>(first)), t);
    EXPECT_EQ(diffusion_timestep_from_bits(static_cast<uint32_t>(first - 1)), t - 1);
  }
  // 200,000 samples: each of 10 deciles of [0, 1000) within 5 standard deviations of 20,000.
  std::vector<int> deciles(10, 0);
  const int n = 200000;
  for (int g = 0; g < n; ++g)
    ++deciles[static_cast<size_t>(ref::diffusion_timestep(42, 7, g) / 100)];
  const double sd = std::sqrt(n * 0.1 * 0.9);
  for (int d = 0; d < 10; ++d) EXPECT_NEAR(deciles[static_cast<size_t>(d)], n / 10, 5 * sd) << d;
  // Sample g's timestep is the first word of Philox block g.
  EXPECT_EQ(ref::diffusion_timestep(42, 7, 12345),
            diffusion_timestep_from_bits(philox_block(42, 7, 12345).x));
}

TEST(DiffusionDraws, NormalsAreStandardAndFollowTheCounterLayout) {
  const int n = 400000;
  double s1 = 0.0, s2 = 0.0, s4 = 0.0;
  for (int e = 0; e < n; ++e) {
    const double x = ref::diffusion_normal(9, 3, e);
    s1 += x;
    s2 += x * x;
    s4 += x * x * x * x;
  }
  EXPECT_NEAR(s1 / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(s2 / n, 1.0, 5.0 * std::sqrt(2.0 / n));
  EXPECT_NEAR(s4 / n, 3.0, 5.0 * std::sqrt(96.0 / n));
  // Element e is component e % 4 of block e / 4: the Box-Muller pairs (x, y) and (z, w).
  const Philox4 p = philox_block(9, 3, 25);
  const double r0 = std::sqrt(-2.0 * std::log(static_cast<double>(philox_uniform(p.x))));
  const double a0 = 2.0 * M_PI * static_cast<double>(philox_uniform(p.y));
  const double r1 = std::sqrt(-2.0 * std::log(static_cast<double>(philox_uniform(p.z))));
  const double a1 = 2.0 * M_PI * static_cast<double>(philox_uniform(p.w));
  EXPECT_DOUBLE_EQ(ref::diffusion_normal(9, 3, 100), r0 * std::cos(a0));
  EXPECT_DOUBLE_EQ(ref::diffusion_normal(9, 3, 101), r0 * std::sin(a0));
  EXPECT_DOUBLE_EQ(ref::diffusion_normal(9, 3, 102), r1 * std::cos(a1));
  EXPECT_DOUBLE_EQ(ref::diffusion_normal(9, 3, 103), r1 * std::sin(a1));
}

// ---------------------------------------------------------------------------------------------------
// Sampling

struct SampleCase {
  int64_t N = 3;
  int C = 4;
  int64_t H = 4, W = 6;
  Vec moments;  // [N, 2C, H, W]
};

SampleCase make_case(uint64_t seed) {
  SampleCase c;
  const int64_t hw = c.H * c.W;
  c.moments.resize(static_cast<size_t>(c.N * 2 * c.C * hw));
  const Vec mean = normal(c.moments.size(), seed, 0.0, 5.0);
  const Vec logvar = normal(c.moments.size(), seed + 1, -6.0, 1.0);
  for (int64_t n = 0; n < c.N; ++n)
    for (int ch = 0; ch < 2 * c.C; ++ch)
      for (int64_t p = 0; p < hw; ++p) {
        const size_t i = static_cast<size_t>((n * 2 * c.C + ch) * hw + p);
        c.moments[i] = ch < c.C ? mean[i] : logvar[i];
      }
  return c;
}

TEST(DiffusionSampleRef, NoisedLatentAndVTargetSatisfyTheirIdentities) {
  const SampleCase c = make_case(3);
  const int64_t n = c.N * c.C * c.H * c.W;
  std::vector<int32_t> t(static_cast<size_t>(c.N));
  Vec noisy(n), v(n), x0(n), z(n);
  ref::diffusion_sample(t.data(), noisy.data(), v.data(), x0.data(), z.data(), c.moments.data(),
                        c.N, c.C, c.H, c.W, 5, 77, 1000);
  const Vec acp = ref::alphas_cumprod();
  for (int64_t s = 0; s < c.N; ++s) {
    EXPECT_EQ(t[static_cast<size_t>(s)], ref::diffusion_timestep(77, 1000, 5 + s));
    const double a = std::sqrt(acp[static_cast<size_t>(t[static_cast<size_t>(s)])]);
    const double b = std::sqrt(1.0 - acp[static_cast<size_t>(t[static_cast<size_t>(s)])]);
    for (int64_t p = 0; p < c.H * c.W; ++p) {
      for (int ch = 0; ch < c.C; ++ch) {
        const size_t i = static_cast<size_t>((s * c.H * c.W + p) * c.C + ch);  // NHWC
        // a^2 + b^2 = 1: the v-target and the noisy latent are a rotation of (x0, noise).
        EXPECT_NEAR(a * noisy[i] - b * v[i], x0[i], 1e-12);
        EXPECT_NEAR(b * noisy[i] + a * v[i], z[i], 1e-12);
        const uint64_t e = static_cast<uint64_t>((5 + s) * c.C * c.H * c.W + p * c.C + ch);
        EXPECT_DOUBLE_EQ(z[i], ref::diffusion_normal(77, 1002, e));
        const double mean = c.moments[static_cast<size_t>((s * 2 * c.C + ch) * c.H * c.W + p)];
        const double logvar =
            c.moments[static_cast<size_t>((s * 2 * c.C + c.C + ch) * c.H * c.W + p)];
        const double eps1 = ref::diffusion_normal(77, 1001, e);
        EXPECT_NEAR(x0[i], (mean + std::exp(0.5 * logvar) * eps1) * 0.18215,
                    1e-7 * std::fabs(x0[i]));
      }
    }
  }
}

TEST(DiffusionSampleRef, DrawsDependOnTheGlobalSampleNotOnTheSplit) {
  const SampleCase c = make_case(5);
  const int64_t per = c.C * c.H * c.W, per_m = 2 * per;
  std::vector<int32_t> t_all(3), t_a(1), t_b(2);
  Vec all(3 * per), v_all(3 * per), a(per), v_a(per), b(2 * per), v_b(2 * per);
  ref::diffusion_sample(t_all.data(), all.data(), v_all.data(), nullptr, nullptr, c.moments.data(),
                        3, c.C, c.H, c.W, 10, 1, 0);
  ref::diffusion_sample(t_a.data(), a.data(), v_a.data(), nullptr, nullptr, c.moments.data(), 1,
                        c.C, c.H, c.W, 10, 1, 0);
  ref::diffusion_sample(t_b.data(), b.data(), v_b.data(), nullptr, nullptr,
                        c.moments.data() + per_m, 2, c.C, c.H, c.W, 11, 1, 0);
  EXPECT_EQ(t_all[0], t_a[0]);
  EXPECT_EQ(t_all[1], t_b[0]);
  EXPECT_EQ(t_all[2], t_b[1]);
  for (int64_t i = 0; i < per; ++i)
    EXPECT_EQ(all[static_cast<size_t>(i)], a[static_cast<size_t>(i)]);
  for (int64_t i = 0; i < 2 * per; ++i)
    EXPECT_EQ(all[static_cast<size_t>(per + i)], b[static_cast<size_t>(i)]);
}

TEST(DiffusionSampleRef, LogVarianceIsClampedAsTheVaeDoes) {
  SampleCase c = make_case(8);
  c.N = 1;
  const int64_t per = c.C * c.H * c.W;
  c.moments.resize(static_cast<size_t>(2 * per));
  auto latent = [&](double logvar) {
    std::fill(c.moments.begin() + per, c.moments.end(), logvar);
    std::vector<int32_t> t(1);
    Vec noisy(per), v(per), x0(per);
    ref::diffusion_sample(t.data(), noisy.data(), v.data(), x0.data(), nullptr, c.moments.data(), 1,
                          c.C, c.H, c.W, 0, 3, 0);
    return x0;
  };
  EXPECT_EQ(latent(100.0), latent(20.0));
  EXPECT_EQ(latent(-100.0), latent(-30.0));
  EXPECT_NE(latent(10.0), latent(20.0));
}

TEST(DiffusionLossFloor, MatchesMonteCarloOfTheBestLinearDenoiser) {
  // With nothing known and unit variance the best predictor of v is 0 and scores exactly 1.
  EXPECT_NEAR(ref::gaussian_v_loss_floor(1.0), 1.0, 1e-12);
  EXPECT_NEAR(ref::gaussian_v_loss_floor(0.5), 0.6454884084412565, 1e-12);
  EXPECT_NEAR(ref::gaussian_v_loss_floor(0.0), 0.0, 1e-15);
  // At one t: x0 ~ N(0, tau2), the best predictor E[v | z] = cov(v, z) / var(z) * z leaves
  // tau2 / (a^2 tau2 + b^2).
  const Vec acp = ref::alphas_cumprod();
  const double tau2 = 0.3;
  for (int t : {0, 300, 999}) {
    const double a = std::sqrt(acp[static_cast<size_t>(t)]), b = std::sqrt(1.0 - acp[t]);
    const double k = a * b * (1.0 - tau2) / (a * a * tau2 + b * b);
    double sum = 0.0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
      const double x0 = std::sqrt(tau2) * ref::diffusion_normal(1, 0, i);
      const double noise = ref::diffusion_normal(1, 1, i);
      const double z = a * x0 + b * noise, v = a * noise - b * x0;
      sum += (v - k * z) * (v - k * z);
    }
    const double expected = tau2 / (a * a * tau2 + b * b);
    EXPECT_NEAR(sum / n, expected, 5.0 * expected * std::sqrt(2.0 / n)) << "t " << t;
  }
}

// ---------------------------------------------------------------------------------------------------
// MSE

TEST(MseRef, GradientMatchesFiniteDifferencesAndSamplesAverage) {
  const int64_t batch = 3, per = 8, n = batch * per;
  Vec pred = normal(n, 11), target = normal(n, 12);
  Vec sample_loss(batch);
  const double loss = ref::mse_loss(pred.data(), target.data(), n, sample_loss.data(), batch);
  EXPECT_NEAR(loss, (sample_loss[0] + sample_loss[1] + sample_loss[2]) / 3.0, 1e-15);
  Vec analytic(n);
  ref::mse_loss_backward(analytic.data(), pred.data(), target.data(), n, 1.0);
  const Vec numeric =
      numeric_grad(pred, [&] { return ref::mse_loss(pred.data(), target.data(), n); });
  EXPECT_TRUE(grad_close("mse dpred", analytic, numeric));
  Vec scaled(n);
  ref::mse_loss_backward(scaled.data(), pred.data(), target.data(), n, 1024.0);
  for (int64_t i = 0; i < n; ++i) EXPECT_DOUBLE_EQ(scaled[i], 1024.0 * analytic[i]);
}

// ---------------------------------------------------------------------------------------------------
// Timestep embedding

TEST(TimestepEmbeddingRef, FollowsDiffusersDefinitionWithSd2Settings) {
  const std::vector<int32_t> t = {0, 1, 500, 999};
  const int C = 320, half = 160;
  Vec out(t.size() * C);
  ref::timestep_embedding(out.data(), t.data(), static_cast<int64_t>(t.size()), C);
  for (int i = 0; i < half; ++i) {
    EXPECT_EQ(out[static_cast<size_t>(i)], 1.0);         // cos(0): flip_sin_to_cos puts cos first
    EXPECT_EQ(out[static_cast<size_t>(half + i)], 0.0);  // sin(0)
  }
  for (size_t n = 0; n < t.size(); ++n) {
    EXPECT_NEAR(out[n * C], std::cos(t[n]), 1e-15);  // channel 0: frequency 1
    EXPECT_NEAR(out[n * C + half], std::sin(t[n]), 1e-15);
    // The last frequency is 10000^(-159/160) (freq_shift 0: the denominator is half).
    const double f = std::pow(10000.0, -159.0 / 160.0);
    EXPECT_NEAR(out[n * C + half - 1], std::cos(t[n] * f), 1e-12);
    EXPECT_NEAR(out[n * C + C - 1], std::sin(t[n] * f), 1e-12);
  }
  // flip_sin_to_cos = false swaps the halves; freq_shift = 1 divides by half - 1.
  Vec plain(t.size() * C), shifted(t.size() * C);
  ref::timestep_embedding(plain.data(), t.data(), 4, C, false);
  ref::timestep_embedding(shifted.data(), t.data(), 4, C, true, 1.0);
  for (size_t n = 0; n < t.size(); ++n) {
    for (int i = 0; i < half; ++i) {
      EXPECT_EQ(plain[n * C + i], out[n * C + half + i]);
      EXPECT_EQ(plain[n * C + half + i], out[n * C + i]);
    }
    EXPECT_NEAR(shifted[n * C + half - 1], std::cos(t[n] * std::pow(10000.0, -159.0 / 159.0)),
                1e-12);
  }
}

// ---------------------------------------------------------------------------------------------------
// GEGLU, upsampling, concatenation

TEST(GegluRef, GeluIsTheErfFormAndGradientsMatchFiniteDifferences) {
  EXPECT_NEAR(ref::gelu(1.0), 0.8413447460685429, 1e-15);  // 1 * Phi(1)
  EXPECT_NEAR(ref::gelu(-1.0), -0.15865525393145707, 1e-15);
  EXPECT_NEAR(ref::gelu_grad(0.0), 0.5, 1e-15);
  const int64_t rows = 3, F = 5;
  Vec in = normal(rows * 2 * F, 21, 0.0, 1.5), dout = normal(rows * F, 22);
  Vec out(rows * F), din(rows * 2 * F);
  ref::geglu_forward(out.data(), in.data(), rows, F);
  // The first half is the value, the second the gate: out = a * gelu(b).
  EXPECT_NEAR(out[1], in[1] * ref::gelu(in[F + 1]), 1e-15);
  ref::geglu_backward(din.data(), dout.data(), in.data(), rows, F);
  const Vec numeric = numeric_grad(in, [&] {
    Vec o(rows * F);
    ref::geglu_forward(o.data(), in.data(), rows, F);
    return dot(o, dout);
  });
  EXPECT_TRUE(grad_close("geglu din", din, numeric));
}

TEST(UpsampleRef, BackwardIsTheAdjointAndMatchesFiniteDifferences) {
  const int64_t N = 2, H = 3, W = 2, C = 4;
  const Vec x = normal(N * H * W * C, 31), dy = normal(N * 4 * H * W * C, 32);
  Vec y(dy.size()), dx(x.size());
  ref::upsample_nearest2x_forward(y.data(), x.data(), N, H, W, C);
  ref::upsample_nearest2x_backward(dx.data(), dy.data(), N, H, W, C);
  EXPECT_NEAR(dot(y, dy), dot(x, dx), 1e-12);
  Vec xv = x;
  const Vec numeric = numeric_grad(xv, [&] {
    Vec out(dy.size());
    ref::upsample_nearest2x_forward(out.data(), xv.data(), N, H, W, C);
    return dot(out, dy);
  });
  EXPECT_TRUE(grad_close("upsample dx", dx, numeric));
  // y[n, 2h + i, 2w + j, c] = x[n, h, w, c].
  EXPECT_EQ(y[((1 * 2 * H + 5) * 2 * W + 2) * C + 3], x[((1 * H + 2) * W + 1) * C + 3]);
  // dx sums the four.
  const int64_t n = 1, h = 1, w = 0, c = 2;
  double s = 0.0;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) s += dy[((n * 2 * H + 2 * h + i) * 2 * W + 2 * w + j) * C + c];
  EXPECT_NEAR(dx[((n * H + h) * W + w) * C + c], s, 1e-15);
}

TEST(ConcatRef, BackwardIsTheForwardsAdjoint) {
  const int64_t rows = 5, Ca = 3, Cb = 4;
  const Vec a = normal(rows * Ca, 41), b = normal(rows * Cb, 42), dy = normal(rows * (Ca + Cb), 43);
  Vec y(dy.size()), da(a.size()), db(b.size());
  ref::concat_channels_forward(y.data(), a.data(), Ca, b.data(), Cb, rows);
  ref::concat_channels_backward(da.data(), db.data(), dy.data(), Ca, Cb, rows);
  EXPECT_NEAR(dot(y, dy), dot(a, da) + dot(b, db), 1e-12);
  EXPECT_EQ(y[2 * (Ca + Cb) + 1], a[2 * Ca + 1]);       // the up path's channels first
  EXPECT_EQ(y[2 * (Ca + Cb) + Ca + 2], b[2 * Cb + 2]);  // then the skip's
}

}  // namespace
}  // namespace replay::unet
