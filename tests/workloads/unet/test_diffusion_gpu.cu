// The diffusion objective on the GPU against the fp64 references (diffusion_reference.h): the
// schedule table; the sampling kernel (the same timesteps bit for bit, the noised latent and the
// v-target to fp16/bf16 and fp32 rounding, at a small shape and at SD's 4 x 64 x 64, with a
// first_sample offset); bitwise determinism; a CUDA graph of the sampling step that draws new noise
// at every replay, each replay bit-identical to the eager step it stands for; the MSE loss (per
// sample and mean, deterministic) and its gradient under a loss scale read from the device; and
// the timestep embedding in fp16, bf16 and fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/philox.h"
#include "graphs/graph.h"
#include "graphs/rng.h"
#include "tests/support/compare.h"
#include "workloads/unet/diffusion.h"
#include "workloads/unet/diffusion_reference.h"

namespace replay::unet {
namespace {

using test::DeviceBuffer;
using test::from_bits;
using test::from_storage;
using test::same_bits;
using test::to_bits;
using Vec = std::vector<double>;

// One rounding to the storage type on top of fp32 math: 2^-11 relative for fp16, 2^-8 for bf16;
// atol covers the fp32 error of values near zero (the normals carry about 1e-6 relative).
test::Tolerance storage_tol(DType t) {
  return t == DType::kFP16 ? test::Tolerance{2e-5, 1e-3} : test::Tolerance{2e-5, 8e-3};
}
constexpr test::Tolerance kFp32Tol{2e-5, 2e-5};

// --- the RNG fixture -----------------------------------------------------------------------------

// A tracker with one stream whose diffusion op owns the three positions of a sampling call (after
// another op, so op_offset is not 0).
struct Rng {
  static constexpr uint64_t kSeed = 20260101;
  DeviceBuffer<char> memory{graphs::RngTracker::device_bytes(2)};
  graphs::RngTracker tracker{memory.get(), graphs::RngTracker::device_bytes(2), 2};
  RngArgs args;
  Rng() {
    tracker.add_stream(graphs::kDataParallelRng, kSeed);
    tracker.register_op(graphs::kDataParallelRng, "other.op");
    args =
        tracker.register_op(graphs::kDataParallelRng, "diffusion.sample", kDiffusionRngPositions);
  }
  // The position the op draws at after `steps` advances.
  uint64_t position(uint64_t steps) const {
    return steps * tracker.consumption(graphs::kDataParallelRng) + args.op_offset;
  }
};

// --- problems ------------------------------------------------------------------------------------

// Moments as the data file holds them, fp16 NCHW: means around 0 with the SD latents' spread,
// log-variances around -6, with a few beyond the VAE's clamp on both sides.
std::vector<__half> make_moments(const LatentShape& s, uint64_t seed, Vec* rounded) {
  const int64_t hw = s.pixels(), per = 2 * s.channels * hw;
  const std::vector<float> mean =
      test::random_normal(static_cast<size_t>(s.batch * per), seed, 0.0f, 5.5f);
  const std::vector<float> logvar =
      test::random_normal(static_cast<size_t>(s.batch * per), seed + 1, -6.0f, 2.0f);
  std::vector<__half> m(static_cast<size_t>(s.batch * per));
  rounded->resize(m.size());
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t ch = 0; ch < 2 * s.channels; ++ch)
      for (int64_t p = 0; p < hw; ++p) {
        const size_t i = static_cast<size_t>((n * 2 * s.channels + ch) * hw + p);
        float v = ch < s.channels ? mean[i] : logvar[i];
        if (ch >= s.channels && p == 0) v = n % 2 ? 25.0f : -35.0f;  // clamped to 20 and -30
        m[i] = __float2half_rn(v);
        (*rounded)[i] = static_cast<double>(__half2float(m[i]));
      }
  return m;
}

struct SampleBuffers {
  explicit SampleBuffers(const LatentShape& s, const std::vector<__half>& moments_host)
      : moments(moments_host),
        noisy(static_cast<size_t>(s.elements())),
        v(static_cast<size_t>(s.elements())),
        t(static_cast<size_t>(s.batch)),
        table(kScheduleTableFloats) {}
  DeviceBuffer<__half> moments;
  DeviceBuffer<uint16_t> noisy;
  DeviceBuffer<float> v;
  DeviceBuffer<int32_t> t;
  DeviceBuffer<float> table;
};

void sample(DType dtype, SampleBuffers& b, const LatentShape& s, int64_t first, RngArgs rng,
            cudaStream_t stream) {
  diffusion_sample(dtype, b.noisy.get(), b.v.get(), b.t.get(), b.moments.get(), b.table.get(), s,
                   first, rng, stream);
}

std::string name(const LatentShape& s, DType t) {
  return "N=" + std::to_string(s.batch) + " C=" + std::to_string(s.channels) +
         " H=" + std::to_string(s.height) + " W=" + std::to_string(s.width) + " " + dtype_name(t);
}

// --- schedule ------------------------------------------------------------------------------------

TEST(DiffusionGpu, ScheduleTableMatchesTheReference) {
  graphs::CaptureStream stream;
  DeviceBuffer<float> table(kScheduleTableFloats);
  diffusion_schedule_init(table.get(), stream.get());
  const std::vector<float> got = table.download();
  const Vec acp = ref::alphas_cumprod();
  Vec a(kTrainTimesteps), b(kTrainTimesteps);
  for (int t = 0; t < kTrainTimesteps; ++t) {
    a[static_cast<size_t>(t)] = std::sqrt(acp[static_cast<size_t>(t)]);
    b[static_cast<size_t>(t)] = std::sqrt(1.0 - acp[static_cast<size_t>(t)]);
  }
  // fp64 on both sides, rounded once to fp32: within an ulp or two of fp32.
  const std::vector<float> ga(got.begin(), got.begin() + kTrainTimesteps);
  const std::vector<float> gb(got.begin() + kTrainTimesteps, got.end());
  EXPECT_TRUE(test::all_close("sqrt(acp)", ga, a, {0.0, 2.5e-7}));
  EXPECT_TRUE(test::all_close("sqrt(1 - acp)", gb, b, {0.0, 2.5e-7}));
  EXPECT_NEAR(ga.back(), 0.068265, 5e-7);
}

// --- sampling ------------------------------------------------------------------------------------

// |got - ref| <= atol + rtol * |ref| + stol * scale[i], naming the worst element otherwise. scale
// is the size of the terms a result is the difference of (|a z| + |b x0|): fp32's error follows it,
// not the result, when the two nearly cancel (a clamped log-variance of 20 makes x0 thousands).
::testing::AssertionResult close_scaled(const std::string& what, const std::vector<float>& got,
                                        const Vec& ref, const Vec& scale, test::Tolerance tol,
                                        double stol) {
  size_t failures = 0, worst = 0;
  double worst_excess = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(ref[i]) + stol * scale[i];
    if (!(err <= allowed)) {
      ++failures;
      if (!(err - allowed <= worst_excess)) {
        worst_excess = err - allowed;
        worst = i;
      }
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << failures << " of " << ref.size()
         << " elements out of tolerance; worst [" << worst << "] got " << got[worst] << " ref "
         << ref[worst] << " term scale " << scale[worst];
}

void check_sampling(const LatentShape& s, DType dtype, int64_t first, uint64_t advances) {
  SCOPED_TRACE(name(s, dtype) + " first_sample " + std::to_string(first));
  graphs::CaptureStream stream;
  Rng rng;
  Vec moments_ref;
  SampleBuffers b(s, make_moments(s, 1000 + static_cast<uint64_t>(s.batch), &moments_ref));
  diffusion_schedule_init(b.table.get(), stream.get());
  rng.tracker.initialize(stream.get());
  for (uint64_t k = 0; k < advances; ++k) rng.tracker.advance(stream.get());
  sample(dtype, b, s, first, rng.args, stream.get());

  const int64_t n = s.elements();
  std::vector<int32_t> t_ref(static_cast<size_t>(s.batch));
  Vec noisy_ref(n), v_ref(n), x0(n), z(n);
  ref::diffusion_sample(t_ref.data(), noisy_ref.data(), v_ref.data(), x0.data(), z.data(),
                        moments_ref.data(), s.batch, s.channels, s.height, s.width, first,
                        Rng::kSeed, rng.position(advances));
  EXPECT_EQ(b.t.download(), t_ref);  // integer draws from the same bits: exact
  const Vec acp = ref::alphas_cumprod();
  Vec scale(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double a2 = acp[static_cast<size_t>(t_ref[static_cast<size_t>(i / s.sample_elements())])];
    scale[static_cast<size_t>(i)] = std::sqrt(a2) * std::fabs(z[static_cast<size_t>(i)]) +
                                    std::sqrt(1.0 - a2) * std::fabs(x0[static_cast<size_t>(i)]);
  }
  // fp32 math: a few ulps of the terms; then one rounding to the storage type (noisy) or none (v).
  EXPECT_TRUE(close_scaled("noisy", from_storage(b.noisy.download(), dtype), noisy_ref, scale,
                           storage_tol(dtype), 2e-6));
  EXPECT_TRUE(close_scaled("v_target", b.v.download(), v_ref, scale, kFp32Tol, 2e-6));
}

TEST(DiffusionGpu, SamplingMatchesTheReference) {
  for (DType dtype : {DType::kFP16, DType::kBF16}) {
    check_sampling({3, 4, 4, 6}, dtype, 0, 0);
    check_sampling({5, 4, 8, 8}, dtype, 17, 3);   // a later step, samples 17.. of the global batch
    check_sampling({2, 3, 4, 4}, dtype, 0, 1);    // C = 3: a thread's four elements span pixels
    check_sampling({8, 4, 64, 64}, dtype, 8, 2);  // SD's latents, rank 1 of a data-parallel step
  }
}

TEST(DiffusionGpu, SamplingIsDeterministicAndSplitsByGlobalSample) {
  const LatentShape s{6, 4, 16, 16};
  graphs::CaptureStream stream;
  Rng rng;
  Vec unused;
  const std::vector<__half> moments = make_moments(s, 5, &unused);
  SampleBuffers a(s, moments), b(s, moments);
  diffusion_schedule_init(a.table.get(), stream.get());
  diffusion_schedule_init(b.table.get(), stream.get());
  rng.tracker.initialize(stream.get());
  sample(DType::kFP16, a, s, 0, rng.args, stream.get());
  sample(DType::kFP16, b, s, 0, rng.args, stream.get());
  EXPECT_TRUE(same_bits("noisy twice", a.noisy.download(), b.noisy.download()));
  EXPECT_TRUE(same_bits("v twice", a.v.download(), b.v.download()));
  EXPECT_EQ(a.t.download(), b.t.download());

  // Samples 2..5 alone with first_sample 2 draw what the whole batch drew for them.
  const LatentShape tail{4, 4, 16, 16};
  const std::vector<__half> tail_moments(moments.begin() + 2 * 2 * 4 * 256, moments.end());
  SampleBuffers c(tail, tail_moments);
  diffusion_schedule_init(c.table.get(), stream.get());
  sample(DType::kFP16, c, tail, 2, rng.args, stream.get());
  const std::vector<uint16_t> whole = a.noisy.download(), part = c.noisy.download();
  EXPECT_TRUE(same_bits("samples 2..5",
                        std::vector<uint16_t>(whole.begin() + 2 * 1024, whole.end()), part));
  const std::vector<int32_t> tw = a.t.download(), tp = c.t.download();
  EXPECT_EQ(std::vector<int32_t>(tw.begin() + 2, tw.end()), tp);
}

TEST(DiffusionGpu, GraphReplaysDrawNewNoiseEachStepAndMatchEagerSteps) {
  const LatentShape s{4, 4, 16, 16};
  const int steps = 6;
  graphs::CaptureStream work, capture;
  Rng rng;
  Vec unused;
  SampleBuffers b(s, make_moments(s, 9, &unused));
  diffusion_schedule_init(b.table.get(), work.get());
  auto step = [&](cudaStream_t st) {
    sample(DType::kFP16, b, s, 0, rng.args, st);
    rng.tracker.advance(st);
  };

  rng.tracker.initialize(work.get());
  std::vector<std::vector<uint16_t>> eager_noisy;
  std::vector<std::vector<float>> eager_v;
  std::vector<std::vector<int32_t>> eager_t;
  for (int k = 0; k < steps; ++k) {
    step(work.get());
    eager_noisy.push_back(b.noisy.download());
    eager_v.push_back(b.v.download());
    eager_t.push_back(b.t.download());
  }

  rng.tracker.initialize(work.get());
  graphs::Graph g("diffusion.sample.step");
  g.build(capture.get(), step, work.get());
  for (int k = 0; k < steps; ++k) {
    g.launch(work.get());
    const std::vector<uint16_t> noisy = b.noisy.download();
    const std::string at = "replay " + std::to_string(k);
    ASSERT_TRUE(same_bits(at + " noisy", eager_noisy[static_cast<size_t>(k)], noisy));
    ASSERT_TRUE(same_bits(at + " v", eager_v[static_cast<size_t>(k)], b.v.download()));
    ASSERT_EQ(eager_t[static_cast<size_t>(k)], b.t.download()) << at;
    if (k > 0) {
      // New draws at every replay: (almost) no element repeats the previous step's value.
      const std::vector<uint16_t>& prev = eager_noisy[static_cast<size_t>(k - 1)];
      size_t same = 0;
      for (size_t i = 0; i < noisy.size(); ++i) same += noisy[i] == prev[i];
      ASSERT_LT(same, noisy.size() / 50) << at << " repeated the previous step's noise";
    }
  }
}

// --- loss ----------------------------------------------------------------------------------------

void check_loss(const LatentShape& s, DType dtype) {
  SCOPED_TRACE(name(s, dtype));
  graphs::CaptureStream stream;
  const int64_t n = s.elements();
  const std::vector<float> pred_f = test::random_normal(static_cast<size_t>(n), 31, 0.1f, 1.0f);
  const std::vector<float> target = test::random_normal(static_cast<size_t>(n), 32, 0.0f, 1.0f);
  std::vector<uint16_t> pred_bits(static_cast<size_t>(n));
  Vec pred_ref(n), target_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    pred_bits[static_cast<size_t>(i)] = to_bits(pred_f[static_cast<size_t>(i)], dtype);
    pred_ref[static_cast<size_t>(i)] = from_bits(pred_bits[static_cast<size_t>(i)], dtype);
    target_ref[static_cast<size_t>(i)] = target[static_cast<size_t>(i)];
  }
  DeviceBuffer<uint16_t> pred(pred_bits), dpred(static_cast<size_t>(n));
  DeviceBuffer<float> tgt(target), loss(1), sample_loss(static_cast<size_t>(s.batch)), dloss(1);
  DeviceBuffer<uint8_t> workspace(std::max<size_t>(mse_loss_workspace_bytes(s), 16));
  auto forward = [&] {
    mse_loss_forward(dtype, loss.get(), sample_loss.get(), pred.get(), tgt.get(), s,
                     workspace.get(), workspace.size(), stream.get());
  };
  forward();
  Vec sample_ref(static_cast<size_t>(s.batch));
  const double loss_ref =
      ref::mse_loss(pred_ref.data(), target_ref.data(), n, sample_ref.data(), s.batch);
  EXPECT_TRUE(test::all_close("loss", loss.download(), Vec{loss_ref}, {0.0, 1e-5}));
  EXPECT_TRUE(test::all_close("sample loss", sample_loss.download(), sample_ref, {0.0, 1e-5}));
  const std::vector<float> first = loss.download(), first_samples = sample_loss.download();
  forward();
  EXPECT_TRUE(same_bits("loss twice", first, loss.download()));
  EXPECT_TRUE(same_bits("sample loss twice", first_samples, sample_loss.download()));

  for (float scale : {1.0f, 65536.0f}) {
    dloss.upload({scale});
    mse_loss_backward(dtype, dpred.get(), pred.get(), tgt.get(), dloss.get(), s, stream.get());
    Vec grad_ref(n);
    ref::mse_loss_backward(grad_ref.data(), pred_ref.data(), target_ref.data(), n, scale);
    // Gradients of about 2 * scale / n: atol scaled to the largest. Unscaled fp16 gradients of
    // SD's sizes (about 2e-6) are fp16 subnormals, exact only to half their spacing, 2^-25: what
    // the loss scale is for.
    double largest = 0.0;
    for (double g : grad_ref) largest = std::max(largest, std::fabs(g));
    const test::Tolerance tol = storage_tol(dtype);
    const double subnormal = dtype == DType::kFP16 ? 2.9802322387695312e-8 : 0.0;
    EXPECT_TRUE(test::all_close("dpred scale " + std::to_string(scale),
                                from_storage(dpred.download(), dtype), grad_ref,
                                {1e-4 * largest + subnormal, tol.rtol}));
  }
}

TEST(DiffusionGpu, MseLossAndGradientMatchTheReference) {
  for (DType dtype : {DType::kFP16, DType::kBF16}) {
    check_loss({3, 4, 4, 6}, dtype);
    check_loss({2, 4, 40, 40}, dtype);   // a tile with a short tail (6400 = 4096 + 2304)
    check_loss({32, 4, 64, 64}, dtype);  // sd2-b32
  }
}

TEST(DiffusionGpu, LossGradientFollowsTheDeviceScaleInsideAGraph) {
  const LatentShape s{2, 4, 8, 8};
  graphs::CaptureStream work, capture;
  const int64_t n = s.elements();
  const std::vector<float> pred_f = test::random_normal(static_cast<size_t>(n), 41);
  std::vector<uint16_t> pred_bits(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    pred_bits[static_cast<size_t>(i)] = to_bits(pred_f[static_cast<size_t>(i)], DType::kFP16);
  DeviceBuffer<uint16_t> pred(pred_bits), dpred(static_cast<size_t>(n));
  DeviceBuffer<float> tgt(test::random_normal(static_cast<size_t>(n), 42)), dloss(1);
  dloss.upload({1.0f});
  graphs::Graph g("mse.backward");
  g.build(
      capture.get(),
      [&](cudaStream_t st) {
        mse_loss_backward(DType::kFP16, dpred.get(), pred.get(), tgt.get(), dloss.get(), s, st);
      },
      work.get());
  Vec pred_ref(static_cast<size_t>(n)), target_ref(static_cast<size_t>(n));
  const std::vector<float> target = tgt.download();
  for (int64_t i = 0; i < n; ++i) {
    pred_ref[static_cast<size_t>(i)] = from_bits(pred_bits[static_cast<size_t>(i)], DType::kFP16);
    target_ref[static_cast<size_t>(i)] = target[static_cast<size_t>(i)];
  }
  for (float scale : {1.0f, 8.0f, 1024.0f}) {
    dloss.upload({scale});  // the loss scale changed between steps: the same graph follows it
    g.launch(work.get());
    Vec want(static_cast<size_t>(n));
    ref::mse_loss_backward(want.data(), pred_ref.data(), target_ref.data(), n, scale);
    double largest = 0.0;
    for (double w : want) largest = std::max(largest, std::fabs(w));
    EXPECT_TRUE(test::all_close("graphed dpred, scale " + std::to_string(scale),
                                from_storage(dpred.download(), DType::kFP16), want,
                                {1e-4 * largest + 2.9802322387695312e-8, 1e-3}));
  }
}

// --- timestep embedding --------------------------------------------------------------------------

TEST(DiffusionGpu, TimestepEmbeddingMatchesTheReference) {
  graphs::CaptureStream stream;
  std::vector<int32_t> t = {0, 1, 2, 17, 250, 499, 500, 998, 999};
  for (int k = 0; k < 23; ++k) t.push_back((k * 389 + 11) % 1000);
  const auto batch = static_cast<int64_t>(t.size());
  DeviceBuffer<int32_t> steps(t);
  for (bool flip : {true, false}) {
    TimestepEmbeddingConfig config;
    config.flip_sin_to_cos = flip;
    Vec want(static_cast<size_t>(batch * config.channels));
    ref::timestep_embedding(want.data(), t.data(), batch, config.channels, flip);
    // The argument t * freq is rounded to fp32 as in diffusers: up to about 1e-4 absolute at
    // t = 999 before the output's own rounding.
    DeviceBuffer<float> out32(want.size());
    timestep_embedding(DType::kFP32, out32.get(), steps.get(), batch, config, stream.get());
    EXPECT_TRUE(test::all_close("fp32", out32.download(), want, {2e-4, 0.0}));
    for (DType dtype : {DType::kFP16, DType::kBF16}) {
      DeviceBuffer<uint16_t> out(want.size());
      timestep_embedding(dtype, out.get(), steps.get(), batch, config, stream.get());
      const test::Tolerance tol = storage_tol(dtype);
      EXPECT_TRUE(test::all_close(std::string(dtype_name(dtype)) + (flip ? " flip" : ""),
                                  from_storage(out.download(), dtype), want, {2e-4, tol.rtol}));
    }
  }
}

}  // namespace
}  // namespace replay::unet
