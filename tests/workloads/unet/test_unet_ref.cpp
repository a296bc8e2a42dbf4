// The UNet ops on the CPU: the fp64 GroupNorm(+SiLU) and convolution references against central
// finite differences of their forwards and against identities (normalized groups, a delta filter,
// a 1x1 convolution as a matrix product), and the host-side contracts of the GPU ops that need no
// GPU: GroupNorm splits and workspaces, the convolution desc's checks, the bias workspace.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "tests/support/compare.h"
#include "workloads/unet/conv.h"
#include "workloads/unet/group_norm.h"
#include "workloads/unet/layer_norm.h"
#include "workloads/unet/unet_reference.h"

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
// GroupNorm reference

struct GnCase {
  int64_t N, HW;
  int C, G;
};

// Groups of 1, 2, 3, 8 and all channels; single pixels; more than one sample.
const GnCase kGnCases[] = {
    {1, 5, 8, 2}, {2, 3, 12, 4}, {2, 4, 16, 1}, {1, 1, 24, 3}, {3, 2, 16, 16}};

TEST(UnetRef, GroupNormForwardNormalizesEachGroup) {
  const int64_t N = 2, HW = 6;
  const int C = 24, G = 4, Cg = C / G;
  const Vec x = normal(N * HW * C, 1, 3.0, 2.0);  // offset mean: the statistics must remove it
  const Vec ones(C, 1.0), zeros(C, 0.0);
  Vec out(x.size()), mean(N * G), rstd(N * G);
  const double eps = 1e-5;
  ref::group_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), ones.data(), zeros.data(),
                          N, HW, C, G, eps, false);
  for (int64_t n = 0; n < N; ++n)
    for (int g = 0; g < G; ++g) {
      double m = 0.0, v = 0.0;
      const double count = static_cast<double>(HW * Cg);
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) m += out[(n * HW + p) * C + g * Cg + j] / count;
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) {
          const double d = out[(n * HW + p) * C + g * Cg + j] - m;
          v += d * d / count;
        }
      const double var_x = 1.0 / (rstd[n * G + g] * rstd[n * G + g]) - eps;
      EXPECT_NEAR(m, 0.0, 1e-12);
      EXPECT_NEAR(v, var_x / (var_x + eps), 1e-12);
      EXPECT_NEAR(mean[n * G + g], 3.0, 1.5);  // near the drawn mean
    }
}

TEST(UnetRef, GroupNormSiluIsSiluOfGroupNorm) {
  const int64_t N = 1, HW = 4;
  const int C = 16, G = 2;
  const Vec x = normal(N * HW * C, 2), gamma = normal(C, 3, 1.0, 0.5), beta = normal(C, 4);
  Vec y(x.size()), out(x.size()), mean(N * G), rstd(N * G);
  ref::group_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(),
                          N, HW, C, G, 1e-5, false);
  ref::group_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(),
                          N, HW, C, G, 1e-5, true);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(out[i], y[i] / (1.0 + std::exp(-y[i])), 1e-14);
}

TEST(UnetRef, GroupNormGradientsMatchFiniteDifferences) {
  uint64_t seed = 100;
  for (const bool silu : {false, true}) {
    for (const GnCase& s : kGnCases) {
      const size_t n = s.N * s.HW * s.C;
      Vec x = normal(n, ++seed, 0.5, 2.0), gamma = normal(s.C, ++seed, 1.0, 0.5),
          beta = normal(s.C, ++seed, 0.0, 0.5);
      const Vec w = normal(n, ++seed);
      Vec out(n), mean(s.N * s.G), rstd(s.N * s.G);
      const double eps = 1e-5;
      auto loss = [&] {
        ref::group_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), gamma.data(),
                                beta.data(), s.N, s.HW, s.C, s.G, eps, silu);
        return dot(w, out);
      };
      loss();
      Vec dx(n), dgamma(s.C), dbeta(s.C);
      ref::group_norm_backward(dx.data(), dgamma.data(), dbeta.data(), w.data(), x.data(),
                               gamma.data(), beta.data(), mean.data(), rstd.data(), s.N, s.HW, s.C,
                               s.G, silu);
      const std::string at = std::string(silu ? " silu" : "") + " N " + std::to_string(s.N) +
                             " HW " + std::to_string(s.HW) + " C " + std::to_string(s.C) + " G " +
                             std::to_string(s.G);
      EXPECT_TRUE(grad_close("group norm dx" + at, dx, numeric_grad(x, loss)));
      EXPECT_TRUE(grad_close("group norm dgamma" + at, dgamma, numeric_grad(gamma, loss)));
      EXPECT_TRUE(grad_close("group norm dbeta" + at, dbeta, numeric_grad(beta, loss)));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Convolution reference

// 3x3 stride 1 and 2 (even and odd sizes, so the last row and column have padding on one side
// only), 1x1, the UNet's 4-channel first and last layers.
const ref::ConvShape kConvCases[] = {{2, 5, 4, 3, 2, 3, 1, 1},
                                     {1, 6, 6, 2, 3, 3, 2, 1},
                                     {1, 5, 7, 2, 2, 3, 2, 1},
                                     {2, 3, 4, 5, 3, 1, 1, 0},
                                     {1, 4, 4, 4, 2, 3, 1, 1}};

std::string conv_name(const ref::ConvShape& s) {
  return " N " + std::to_string(s.n) + " " + std::to_string(s.h) + "x" + std::to_string(s.w) +
         " C " + std::to_string(s.c) + " K " + std::to_string(s.k) + " " +
         std::to_string(s.kernel) + "x" + std::to_string(s.kernel) + " s" +
         std::to_string(s.stride);
}

TEST(UnetRef, ConvolutionGradientsMatchFiniteDifferences) {
  uint64_t seed = 500;
  for (const ref::ConvShape& s : kConvCases) {
    Vec x = normal(s.n * s.h * s.w * s.c, ++seed),
        w = normal(s.k * s.kernel * s.kernel * s.c, ++seed), b = normal(s.k, ++seed);
    const Vec wy = normal(s.n * s.p() * s.q() * s.k, ++seed);
    Vec y(wy.size());
    auto loss = [&] {
      ref::conv2d_forward(y.data(), x.data(), w.data(), b.data(), s);
      return dot(wy, y);
    };
    Vec dx(x.size()), dw(w.size()), db(b.size());
    ref::conv2d_dgrad(dx.data(), wy.data(), w.data(), s);
    ref::conv2d_wgrad(dw.data(), wy.data(), x.data(), s);
    ref::bias_grad(db.data(), wy.data(), s.n * s.p() * s.q(), s.k);
    const std::string at = conv_name(s);
    EXPECT_TRUE(grad_close("conv dgrad" + at, dx, numeric_grad(x, loss)));
    EXPECT_TRUE(grad_close("conv wgrad" + at, dw, numeric_grad(w, loss)));
    EXPECT_TRUE(grad_close("conv bias grad" + at, db, numeric_grad(b, loss)));
  }
}

TEST(UnetRef, ConvolutionForwardIdentities) {
  // A 3x3 filter that is the identity at its centre copies x (padding 1 keeps the size).
  const ref::ConvShape s3{2, 5, 6, 4, 4, 3, 1, 1};
  const Vec x = normal(s3.n * s3.h * s3.w * s3.c, 7);
  Vec w(s3.k * 9 * s3.c, 0.0), y(s3.n * s3.p() * s3.q() * s3.k);
  for (int64_t k = 0; k < s3.k; ++k) w[(k * 9 + 4) * s3.c + k] = 1.0;
  ref::conv2d_forward(y.data(), x.data(), w.data(), nullptr, s3);
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_DOUBLE_EQ(y[i], x[i]);

  // Stride 2 with the same filter samples every other pixel: y[p, q] = x[2p, 2q].
  const ref::ConvShape s2{1, 7, 6, 4, 4, 3, 2, 1};
  Vec y2(s2.n * s2.p() * s2.q() * s2.k);
  const Vec x2 = normal(s2.h * s2.w * s2.c, 8);
  ref::conv2d_forward(y2.data(), x2.data(), w.data(), nullptr, s2);
  EXPECT_EQ(s2.p(), 4);
  EXPECT_EQ(s2.q(), 3);
  for (int64_t p = 0; p < s2.p(); ++p)
    for (int64_t q = 0; q < s2.q(); ++q)
      for (int64_t k = 0; k < s2.k; ++k)
        EXPECT_DOUBLE_EQ(y2[(p * s2.q() + q) * s2.k + k], x2[((2 * p) * s2.w + 2 * q) * s2.c + k]);

  // A 1x1 convolution is the matrix product [pixels, C] x [C, K] plus the bias.
  const ref::ConvShape s1{2, 3, 3, 5, 3, 1, 1, 0};
  const Vec x1 = normal(s1.n * s1.h * s1.w * s1.c, 9), w1 = normal(s1.k * s1.c, 10),
            b1 = normal(s1.k, 11);
  Vec y1(s1.n * s1.h * s1.w * s1.k);
  ref::conv2d_forward(y1.data(), x1.data(), w1.data(), b1.data(), s1);
  for (int64_t i = 0; i < s1.n * s1.h * s1.w; ++i)
    for (int64_t k = 0; k < s1.k; ++k) {
      double acc = b1[k];
      for (int64_t c = 0; c < s1.c; ++c) acc += x1[i * s1.c + c] * w1[k * s1.c + c];
      EXPECT_NEAR(y1[i * s1.k + k], acc, 1e-12);
    }
}

// ---------------------------------------------------------------------------------------------------
// Host contracts of the GPU ops

// The UNet's GroupNorm shapes (issue 28): every resolution with its widths, the concatenated skip
// widths included, at the batch sizes of the presets and the batch sweep.
TEST(UnetHost, GroupNormSplitsCoverEveryPixelOnce) {
  struct Res {
    int64_t hw;
    std::vector<int> widths;
  };
  const Res resolutions[] = {{64 * 64, {320, 640, 960}},
                             {32 * 32, {320, 640, 960, 1280, 1920}},
                             {16 * 16, {640, 1280, 1920, 2560}},
                             {8 * 8, {1280, 2560}}};
  for (const int64_t N : {1, 2, 8, 32, 64})
    for (const Res& r : resolutions)
      for (const int C : r.widths)
        for (const int G : {16, 32}) {
          const GroupNormShape s{N, r.hw, C, G};
          const GroupNormSplit split = group_norm_split(s);
          const std::string at = "N " + std::to_string(N) + " HW " + std::to_string(r.hw) + " C " +
                                 std::to_string(C) + " G " + std::to_string(G);
          EXPECT_EQ(split.threads % 32, 0) << at;
          EXPECT_LE(split.threads, 512) << at;
          EXPECT_GE(split.threads, C / 8 * split.lanes) << at;
          EXPECT_GE(split.pixels_per_block * split.blocks_per_sample, r.hw) << at;
          EXPECT_LT((split.blocks_per_sample - 1) * split.pixels_per_block, r.hw) << at;
          // Enough blocks to fill an H100 whenever the tensor has the pixels for it.
          const int64_t blocks = N * split.blocks_per_sample;
          if (N * r.hw >= 132 * 4 * split.lanes) {
            EXPECT_GE(blocks, 132) << at;
          }
          EXPECT_LE(blocks, 2048) << at;
          const size_t partials = static_cast<size_t>(blocks) * G * 8;  // (mean, M2) a tile
          EXPECT_GE(group_norm_forward_workspace_bytes(s), partials) << at;
          EXPECT_LT(group_norm_forward_workspace_bytes(s), partials + 256) << at;
          EXPECT_GE(group_norm_backward_workspace_bytes(s),
                    static_cast<size_t>(blocks) * (2 * C * 4 + G * 8) + N * G * 8)
              << at;
        }
  // The split, hence the order of every sum, depends on the shape alone.
  const GroupNormShape s{32, 4096, 320, 16};
  const GroupNormSplit a = group_norm_split(s), b = group_norm_split(s);
  EXPECT_EQ(a.pixels_per_block, b.pixels_per_block);
  EXPECT_EQ(a.blocks_per_sample, b.blocks_per_sample);
  EXPECT_EQ(a.threads, 160);
  EXPECT_EQ(a.blocks_per_sample * 32, 1024);
}

TEST(UnetHost, GroupNormRejectsBadShapes) {
  EXPECT_THROW(group_norm_split({1, 16, 12, 4}), Error);     // C not a multiple of 8
  EXPECT_THROW(group_norm_split({1, 16, 64, 3}), Error);     // G does not divide C
  EXPECT_THROW(group_norm_split({1, 16, 512, 256}), Error);  // G > 128
  EXPECT_THROW(group_norm_split({1, 16, 8192, 16}), Error);  // C > 4096
  EXPECT_THROW(group_norm_split({0, 16, 64, 4}), Error);
  EXPECT_THROW(group_norm_split({1, 0, 64, 4}), Error);
  EXPECT_NO_THROW(group_norm_split({1, 1, 8, 1}));
  EXPECT_NO_THROW(group_norm_split({1, 7, 4096, 128}));
}

TEST(UnetHost, ConvDescShapesAndChecks) {
  ConvDesc d;
  d.batch = 32, d.height = 64, d.width = 64, d.in_channels = 320, d.out_channels = 320;
  EXPECT_NO_THROW(d.validate());
  EXPECT_EQ(d.out_height(), 64);
  EXPECT_DOUBLE_EQ(d.flops(), 2.0 * 32 * 64 * 64 * 320 * 320 * 9);
  d.stride = 2;  // the UNet's downsampling
  EXPECT_EQ(d.out_height(), 32);
  EXPECT_EQ(d.out_width(), 32);
  d.kernel = 1, d.padding = 0, d.stride = 1;
  EXPECT_EQ(d.out_height(), 64);
  EXPECT_NE(d.describe().find("C=320 -> K=320 1x1 s1 p0 fp16"), std::string::npos) << d.describe();

  ConvDesc bad = d;
  bad.in_channels = 3;  // pixel rows must be 8-byte aligned
  EXPECT_THROW(bad.validate(), Error);
  bad = d;
  bad.kernel = 2;
  EXPECT_THROW(bad.validate(), Error);
  bad = d;
  bad.dtype = DType::kFP32;
  EXPECT_THROW(bad.validate(), Error);
  bad = d;
  bad.height = 0;
  EXPECT_THROW(bad.validate(), Error);

  ConvDesc other = d;
  other.bias = true;
  EXPECT_TRUE(d < other || other < d);  // bias is part of the key
}

TEST(UnetHost, BiasGradientWorkspace) {
  EXPECT_GE(conv_bias_grad_workspace_bytes(32 * 4096, 320), size_t{320 * 4});
  EXPECT_EQ(conv_bias_grad_workspace_bytes(1000, 4), conv_bias_grad_workspace_bytes(1000, 4));
  EXPECT_THROW(conv_bias_grad_workspace_bytes(1000, 6), Error);  // not a multiple of 4
  EXPECT_THROW(conv_bias_grad_workspace_bytes(0, 8), Error);
}

// The LayerNorm backward's grid and workspace are the shape's alone: a warp takes at least 4 rows,
// at most 528 blocks of 8 warps, 2 partial rows of C floats a block.
TEST(UnetHost, LayerNormBackwardSplitAndWorkspace) {
  EXPECT_EQ(layer_norm_backward_blocks(1), 1);
  EXPECT_EQ(layer_norm_backward_blocks(32), 1);
  EXPECT_EQ(layer_norm_backward_blocks(33), 2);
  EXPECT_EQ(layer_norm_backward_blocks(2500), 79);
  EXPECT_EQ(layer_norm_backward_blocks(32 * 16 * 16), 256);  // SD2 at 16x16, 32 images
  EXPECT_EQ(layer_norm_backward_blocks(32 * 64 * 64), 528);  // at 64x64
  EXPECT_EQ(layer_norm_backward_workspace_bytes(32 * 64 * 64, 320), 2u * 528 * 320 * 4);
  EXPECT_EQ(layer_norm_backward_workspace_bytes(2048, 1280), 2u * 64 * 1280 * 4);
  EXPECT_NO_THROW(check_layer_norm_shape(1, 8));
  EXPECT_NO_THROW(check_layer_norm_shape(131072, kLayerNormMaxChannels));
  EXPECT_THROW(check_layer_norm_shape(0, 320), Error);
  EXPECT_THROW(check_layer_norm_shape(10, 12), Error);
  EXPECT_THROW(check_layer_norm_shape(10, 0), Error);
  EXPECT_THROW(check_layer_norm_shape(10, kLayerNormMaxChannels + 8), Error);
  EXPECT_THROW(check_layer_norm_shape(int64_t{1} << 31, 320), Error);
}

}  // namespace
}  // namespace replay::unet
