// The convolution plans on the GPU against the fp64 reference: 3x3 stride 1 and 2 (even and odd
// sizes), 1x1, the UNet's 4-channel first and last layers and its 320/640 widths, fp16 and bf16,
// the bias fused in the cuDNN graph and added by the kernel, its gradient; bitwise determinism at
// the UNet's sizes (engines chosen without the nondeterministic ones); a CUDA graph of the three
// directions captured after the plans were built, equal to the eager calls; a sealed cache and bad
// arguments refused; and, printed, not asserted, the time of the UNet's 64x64 320 -> 320 3x3
// convolution at 32 images.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudnn_graph.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/context.h"
#include "tests/support/compare.h"
#include "workloads/unet/conv.h"
#include "workloads/unet/unet_reference.h"

namespace replay::unet {
namespace {

using test::DeviceBuffer;
using test::same_bits;
using Vec = std::vector<double>;

// Tolerances against the fp64 reference fed the same rounded inputs: atol is a fraction of the
// tensor's largest |ref| (outputs are sums of C * R * S products, or N * P * Q for dw), rtol per
// element. One rounding to fp16 (2^-11) or bf16 (2^-8) after fp32 accumulation, with room for the
// transforms of Winograd or FFT engines, which cuDNN may pick for fp16.
struct Tol {
  double atol, rtol;
};
Tol tol(DType t) {
  return t == DType::kFP16 ? Tol{2e-3, 4e-3} : Tol{8e-3, 1.6e-2};
}
constexpr Tol kFp32Tol{1e-3, 1e-3};  // fp32 dw: fp32 accumulation only
constexpr Tol kBiasTol{1e-4, 1e-4};  // the fp32 bias gradient

using test::from_bits;
using test::from_storage;
using test::to_bits;
using test::to_storage;
std::vector<float> draw(size_t n, uint64_t seed, float stddev, DType t) {
  return from_storage(to_storage(test::random_normal(n, seed, 0.0f, stddev), t), t);
}

::testing::AssertionResult close(const std::string& what, const std::vector<float>& got,
                                 const Vec& ref, Tol tl) {
  double largest = 0.0;
  for (double r : ref) largest = std::max(largest, std::fabs(r));
  return test::all_close(what, got, ref, {tl.atol * largest, tl.rtol});
}

ConvDesc make_desc(int64_t n, int64_t h, int64_t w, int64_t c, int64_t k, int64_t kernel,
                   int64_t stride, DType t, bool bias = true) {
  ConvDesc d;
  d.batch = n, d.height = h, d.width = w, d.in_channels = c, d.out_channels = k;
  d.kernel = kernel, d.stride = stride, d.padding = kernel / 2;
  d.dtype = t;
  d.bias = bias;
  return d;
}

ref::ConvShape ref_shape(const ConvDesc& d) {
  return {d.batch, d.height, d.width, d.in_channels, d.out_channels, d.kernel, d.stride, d.padding};
}

// The three plans of a layer from one cache, and one workspace for them.
struct Plans {
  Plans(ConvCache& cache, const Context& ctx, const ConvDesc& d)
      : fwd(cache.get(ctx, d, ConvKind::kForward)),
        dgrad(cache.get(ctx, d, ConvKind::kDataGrad)),
        wgrad(cache.get(ctx, d, ConvKind::kWeightGrad)) {}
  size_t workspace() const {
    return std::max(
        {fwd.workspace_bytes(), dgrad.workspace_bytes(), wgrad.workspace_bytes(), size_t{16}});
  }
  std::string engines() const {
    return "fprop " + fwd.engine() +
           (fwd.desc().bias ? (fwd.bias_fused() ? " (+bias fused)" : " (+bias kernel)") : "") +
           ", dgrad " + dgrad.engine() + ", wgrad " + wgrad.engine() + ", workspace " +
           std::to_string(workspace()) + " B";
  }
  const ConvPlan& fwd;
  const ConvPlan& dgrad;
  const ConvPlan& wgrad;
};

// Inputs drawn and rounded to the storage type; filter scaled by 1 / sqrt(C R S) so y ~ N(0, 1).
struct Problem {
  ConvDesc d;
  std::vector<float> x, w, bias, dy;
};

Problem make_problem(const ConvDesc& d, uint64_t seed) {
  const float wscale = 1.0f / std::sqrt(static_cast<float>(d.in_channels * d.kernel * d.kernel));
  return {
      d, draw(d.x_elements(), seed, 1.0f, d.dtype), draw(d.w_elements(), seed + 1, wscale, d.dtype),
      draw(d.out_channels, seed + 2, 0.5f, d.dtype), draw(d.y_elements(), seed + 3, 1.0f, d.dtype)};
}

struct Buffers {
  Buffers(const ConvDesc& d, size_t workspace_bytes)
      : x(d.x_elements()),
        w(d.w_elements()),
        bias(d.out_channels),
        dy(d.y_elements()),
        y(d.y_elements()),
        dx(d.x_elements()),
        dw(d.w_elements() * (d.fp32_weight_grad ? 2 : 1)),
        dbias(d.out_channels),
        workspace(workspace_bytes),
        bias_workspace(conv_bias_grad_workspace_bytes(rows(d), d.out_channels)) {}
  Buffers(const Problem& p, size_t workspace_bytes) : Buffers(p.d, workspace_bytes) {
    x.upload(to_storage(p.x, p.d.dtype));
    w.upload(to_storage(p.w, p.d.dtype));
    bias.upload(to_storage(p.bias, p.d.dtype));
    dy.upload(to_storage(p.dy, p.d.dtype));
  }
  static int64_t rows(const ConvDesc& d) { return d.batch * d.out_height() * d.out_width(); }
  DeviceBuffer<uint16_t> x, w, bias, dy, y, dx, dw;
  DeviceBuffer<float> dbias;
  DeviceBuffer<uint8_t> workspace, bias_workspace;
};

// fprop, dgrad, wgrad and the bias gradient, in that order, on `stream`.
void run_all(const Context& ctx, const Plans& plans, Buffers& b, cudaStream_t stream) {
  const ConvDesc& d = plans.fwd.desc();
  ConvArgs f;
  f.x = b.x.get(), f.w = b.w.get(), f.y = b.y.get();
  if (d.bias) f.bias = b.bias.get();
  plans.fwd.execute(ctx, stream, f, b.workspace.get(), b.workspace.size());
  ConvArgs g;
  g.dy = b.dy.get(), g.w = b.w.get(), g.dx = b.dx.get();
  plans.dgrad.execute(ctx, stream, g, b.workspace.get(), b.workspace.size());
  ConvArgs h;
  h.dy = b.dy.get(), h.x = b.x.get(), h.dw = b.dw.get();
  plans.wgrad.execute(ctx, stream, h, b.workspace.get(), b.workspace.size());
  conv_bias_grad(d.dtype, b.dbias.get(), b.dy.get(), Buffers::rows(d), d.out_channels, false,
                 b.bias_workspace.get(), b.bias_workspace.size(), stream);
}

std::vector<float> dw_host(const ConvDesc& d, const Buffers& b) {
  const std::vector<uint16_t> raw = b.dw.download();
  if (!d.fp32_weight_grad) return from_storage(raw, d.dtype);
  std::vector<float> f(d.w_elements());
  std::memcpy(f.data(), raw.data(), f.size() * sizeof(float));
  return f;
}

void expect_matches_reference(const Problem& p, const Buffers& b) {
  const ConvDesc& d = p.d;
  const ref::ConvShape s = ref_shape(d);
  const Vec x = test::to_double(p.x), w = test::to_double(p.w), bias = test::to_double(p.bias),
            dy = test::to_double(p.dy);
  Vec y(d.y_elements()), dx(d.x_elements()), dw(d.w_elements()), db(d.out_channels);
  ref::conv2d_forward(y.data(), x.data(), w.data(), d.bias ? bias.data() : nullptr, s);
  ref::conv2d_dgrad(dx.data(), dy.data(), w.data(), s);
  ref::conv2d_wgrad(dw.data(), dy.data(), x.data(), s);
  ref::bias_grad(db.data(), dy.data(), Buffers::rows(d), d.out_channels);
  const std::string at = " (" + d.describe() + ")";
  EXPECT_TRUE(close("fprop y" + at, from_storage(b.y.download(), d.dtype), y, tol(d.dtype)));
  EXPECT_TRUE(close("dgrad dx" + at, from_storage(b.dx.download(), d.dtype), dx, tol(d.dtype)));
  EXPECT_TRUE(
      close("wgrad dw" + at, dw_host(d, b), dw, d.fp32_weight_grad ? kFp32Tol : tol(d.dtype)));
  EXPECT_TRUE(close("dbias" + at, b.dbias.download(), db, kBiasTol));
}

constexpr DType kF16 = DType::kFP16, kB16 = DType::kBF16;

// --- against the reference -----------------------------------------------------------------------

TEST(ConvGpu, MatchesReference) {
  const ConvDesc cases[] = {
      make_desc(2, 8, 8, 16, 32, 3, 1, kF16),       make_desc(2, 8, 8, 16, 32, 3, 1, kB16),
      make_desc(1, 7, 5, 32, 16, 3, 1, kF16),       make_desc(2, 8, 8, 16, 16, 3, 2, kF16),
      make_desc(1, 9, 7, 24, 8, 3, 2, kB16),        make_desc(2, 6, 6, 32, 64, 1, 1, kF16),
      make_desc(1, 5, 3, 16, 8, 1, 1, kB16),        make_desc(1, 8, 8, 4, 32, 3, 1, kF16),
      make_desc(1, 8, 8, 32, 4, 3, 1, kF16),        make_desc(1, 8, 8, 320, 320, 3, 1, kF16),
      make_desc(1, 16, 16, 320, 320, 3, 2, kB16),   make_desc(1, 8, 8, 640, 320, 1, 1, kF16),
      make_desc(2, 8, 8, 16, 32, 3, 1, kF16, false)};
  Context ctx;
  uint64_t seed = 1;
  for (const ConvDesc& d : cases) {
    ConvCache cache;
    const Plans plans(cache, ctx, d);
    std::printf("%s: %s\n", d.describe().c_str(), plans.engines().c_str());
    const Problem p = make_problem(d, seed += 10);
    Buffers b(p, plans.workspace());
    run_all(ctx, plans, b, ctx.stream());
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    expect_matches_reference(p, b);
  }
}

// With fuse_bias off, the bias is added by the kernel after cuDNN: the same result.
TEST(ConvGpu, UnfusedBiasMatchesReference) {
  Context ctx;
  for (const DType t : {kF16, kB16}) {
    ConvDesc d = make_desc(2, 8, 8, 32, 12, 3, 1, t);
    d.fuse_bias = false;
    ConvCache cache;
    const Plans plans(cache, ctx, d);
    EXPECT_FALSE(plans.fwd.bias_fused());
    const Problem p = make_problem(d, 900);
    Buffers b(p, plans.workspace());
    run_all(ctx, plans, b, ctx.stream());
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    expect_matches_reference(p, b);
  }
}

// dw straight in fp32, where cuDNN has a deterministic engine for it.
TEST(ConvGpu, Fp32WeightGradient) {
  Context ctx;
  ConvDesc d = make_desc(2, 8, 8, 32, 16, 3, 1, kF16);
  d.fp32_weight_grad = true;
  ConvCache cache;
  try {
    cache.get(ctx, d, ConvKind::kWeightGrad);
  } catch (const Error& e) {
    GTEST_SKIP() << "cuDNN has no deterministic fp16 -> fp32 wgrad engine here: " << e.what();
  }
  const Plans plans(cache, ctx, d);
  std::printf("%s: %s\n", d.describe().c_str(), plans.engines().c_str());
  const Problem p = make_problem(d, 950);
  Buffers b(p, plans.workspace());
  run_all(ctx, plans, b, ctx.stream());
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  expect_matches_reference(p, b);
}

// --- determinism and capture ---------------------------------------------------------------------

// Fills a device buffer with uniform values in [-1, 1) * scale, rounded: a host chunk of at most
// 2^20 values from xorshift, copied over the buffer as often as needed (quick for hundreds of MB;
// the repetition does not matter to the determinism and timing tests).
void fill_uniform(DeviceBuffer<uint16_t>& b, uint64_t seed, float scale, DType t) {
  std::vector<uint16_t> v(std::min<size_t>(b.size(), size_t{1} << 20));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& e : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    e = to_bits(scale * (static_cast<float>(s >> 40) * (2.0f / 16777216.0f) - 1.0f), t);
  }
  for (size_t at = 0; at < b.size(); at += v.size()) {
    const size_t n = std::min(v.size(), b.size() - at);
    REPLAY_CUDA_CHECK(
        cudaMemcpy(b.get() + at, v.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
  }
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
}

void fill_inputs(Buffers& b, DType t) {
  fill_uniform(b.x, 1, 1.0f, t);
  fill_uniform(b.w, 2, 0.05f, t);
  fill_uniform(b.bias, 3, 0.5f, t);
  fill_uniform(b.dy, 4, 1.0f, t);
}

// Same inputs, all three directions twice (the workspace poisoned in between): the same bits, at
// the UNet's widths and sizes where split reductions would show nondeterminism.
TEST(ConvGpu, DeterministicAtUnetSizes) {
  const ConvDesc cases[] = {
      make_desc(8, 32, 32, 320, 320, 3, 1, kF16), make_desc(8, 64, 64, 320, 320, 3, 2, kF16),
      make_desc(8, 16, 16, 1280, 1280, 3, 1, kB16), make_desc(8, 32, 32, 960, 320, 1, 1, kF16)};
  Context ctx;
  for (const ConvDesc& d : cases) {
    ConvCache cache;
    const Plans plans(cache, ctx, d);
    std::printf("%s: %s\n", d.describe().c_str(), plans.engines().c_str());
    Buffers a(d, plans.workspace()), b(d, plans.workspace());
    fill_inputs(a, d.dtype);
    fill_inputs(b, d.dtype);
    run_all(ctx, plans, a, ctx.stream());
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    // b reuses a's workspace, poisoned: what a plan leaves there must not matter.
    REPLAY_CUDA_CHECK(cudaMemset(a.workspace.get(), 0x5A, a.workspace.size()));
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    run_all(ctx, plans, b, ctx.stream());
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    const std::string at = " (" + d.describe() + ")";
    EXPECT_TRUE(same_bits("y" + at, a.y.download(), b.y.download()));
    EXPECT_TRUE(same_bits("dx" + at, a.dx.download(), b.dx.download()));
    EXPECT_TRUE(same_bits("dw" + at, a.dw.download(), b.dw.download()));
    EXPECT_TRUE(same_bits("dbias" + at, a.dbias.download(), b.dbias.download()));
  }
}

// Plans built, then the three directions and the bias gradient captured on a side stream and
// replayed: the same bits as eager calls on the work stream, and the handle back on its stream.
TEST(ConvGpu, CapturedAfterSetUpMatchesEager) {
  Context ctx;
  ConvCache cache;
  const ConvDesc d = make_desc(4, 16, 16, 320, 640, 3, 1, kF16);
  const Plans plans(cache, ctx, d);
  cache.seal();
  const Problem p = make_problem(d, 1200);
  Buffers eager(p, plans.workspace()), graphed(p, plans.workspace());
  run_all(ctx, plans, eager, ctx.stream());
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));

  cudaStream_t side = ctx.side_stream(0);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(side, cudaStreamCaptureModeGlobal));
  run_all(ctx, plans, graphed, side);
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(side, &graph));
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, side));
  REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, side));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(side));
  REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
  REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));

  cudaStream_t bound = nullptr;
  ASSERT_EQ(cudnnGetStream(ctx.cudnn(), &bound), CUDNN_STATUS_SUCCESS);
  EXPECT_EQ(bound, ctx.stream()) << "the cuDNN handle was not pointed back at the work stream";
  EXPECT_TRUE(same_bits("y, graph vs eager", eager.y.download(), graphed.y.download()));
  EXPECT_TRUE(same_bits("dx, graph vs eager", eager.dx.download(), graphed.dx.download()));
  EXPECT_TRUE(same_bits("dw, graph vs eager", eager.dw.download(), graphed.dw.download()));
  EXPECT_TRUE(same_bits("dbias, graph vs eager", eager.dbias.download(), graphed.dbias.download()));
  expect_matches_reference(p, graphed);
}

TEST(ConvGpu, SealedCacheAndBadArgumentsAreRefused) {
  Context ctx;
  ConvCache cache;
  const ConvDesc d = make_desc(1, 8, 8, 16, 16, 3, 1, kF16);
  const ConvPlan& fwd = cache.get(ctx, d, ConvKind::kForward);
  EXPECT_EQ(&cache.get(ctx, d, ConvKind::kForward), &fwd);  // cached
  // dgrad and wgrad plans do not depend on the bias settings: one plan serves both descs.
  ConvDesc no_bias = d;
  no_bias.bias = false;
  EXPECT_EQ(&cache.get(ctx, d, ConvKind::kDataGrad), &cache.get(ctx, no_bias, ConvKind::kDataGrad));
  cache.seal();
  EXPECT_NO_THROW(cache.get(ctx, d, ConvKind::kForward));
  EXPECT_THROW(cache.get(ctx, make_desc(1, 8, 8, 16, 32, 3, 1, kF16), ConvKind::kForward), Error);
  EXPECT_THROW(cache.get(ctx, d, ConvKind::kWeightGrad), Error);
  EXPECT_GE(cache.max_workspace_bytes(), fwd.workspace_bytes());

  const Problem p = make_problem(d, 1300);
  Buffers b(p, std::max<size_t>(fwd.workspace_bytes(), 16));
  ConvArgs ok;
  ok.x = b.x.get(), ok.w = b.w.get(), ok.y = b.y.get(), ok.bias = b.bias.get();
  EXPECT_NO_THROW(fwd.execute(ctx, ctx.stream(), ok, b.workspace.get(), b.workspace.size()));
  ConvArgs missing = ok;
  missing.bias = nullptr;
  EXPECT_THROW(fwd.execute(ctx, ctx.stream(), missing, b.workspace.get(), b.workspace.size()),
               Error);
  ConvArgs stray = ok;
  stray.dx = b.dx.get();
  EXPECT_THROW(fwd.execute(ctx, ctx.stream(), stray, b.workspace.get(), b.workspace.size()), Error);
  ConvArgs misaligned = ok;
  misaligned.x = b.x.get() + 1;
  EXPECT_THROW(fwd.execute(ctx, ctx.stream(), misaligned, b.workspace.get(), b.workspace.size()),
               Error);
  if (fwd.workspace_bytes() > 0) {
    EXPECT_THROW(fwd.execute(ctx, ctx.stream(), ok, b.workspace.get(), fwd.workspace_bytes() - 1),
                 Error);
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
}

// --- timing (printed, not asserted) --------------------------------------------------------------

TEST(ConvGpu, TimingPrinted) {
  const ConvDesc shapes[] = {
      make_desc(32, 64, 64, 320, 320, 3, 1, kF16),   make_desc(32, 64, 64, 320, 320, 3, 1, kB16),
      make_desc(32, 64, 64, 320, 320, 3, 2, kF16),   make_desc(32, 32, 32, 640, 640, 3, 1, kF16),
      make_desc(32, 16, 16, 1280, 1280, 3, 1, kF16), make_desc(32, 64, 64, 960, 320, 1, 1, kF16)};
  Context ctx;
  cudaStream_t stream = ctx.stream();
  cudaEvent_t start, stop;
  REPLAY_CUDA_CHECK(cudaEventCreate(&start));
  REPLAY_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_ms = [&](auto&& body, int iterations) {
    for (int i = 0; i < 3; ++i) body();
    REPLAY_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iterations; ++i) body();
    REPLAY_CUDA_CHECK(cudaEventRecord(stop, stream));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms / iterations;
  };
  for (const ConvDesc& d : shapes) {
    ConvCache cache;
    const Plans plans(cache, ctx, d);
    Buffers b(d, plans.workspace());
    fill_inputs(b, d.dtype);
    ConvArgs f, g, h;
    f.x = b.x.get(), f.w = b.w.get(), f.y = b.y.get(), f.bias = b.bias.get();
    g.dy = b.dy.get(), g.w = b.w.get(), g.dx = b.dx.get();
    h.dy = b.dy.get(), h.x = b.x.get(), h.dw = b.dw.get();
    void* ws = b.workspace.get();
    const size_t bytes = b.workspace.size();
    const int iters = 10;
    const float fwd = time_ms([&] { plans.fwd.execute(ctx, stream, f, ws, bytes); }, iters);
    const float dgrad = time_ms([&] { plans.dgrad.execute(ctx, stream, g, ws, bytes); }, iters);
    const float wgrad = time_ms([&] { plans.wgrad.execute(ctx, stream, h, ws, bytes); }, iters);
    const int64_t rows = Buffers::rows(d);
    const float dbias = time_ms(
        [&] {
          conv_bias_grad(d.dtype, b.dbias.get(), b.dy.get(), rows, d.out_channels, false,
                         b.bias_workspace.get(), b.bias_workspace.size(), stream);
        },
        iters);
    const double tflop = d.flops() / 1e12;
    std::printf(
        "%s\n  fprop %.3f ms %.0f TFLOP/s, dgrad %.3f ms %.0f TFLOP/s, wgrad %.3f ms "
        "%.0f TFLOP/s, dbias %.1f us (%.0f GB/s)\n  %s\n",
        d.describe().c_str(), fwd, tflop / (fwd * 1e-3), dgrad, tflop / (dgrad * 1e-3), wgrad,
        tflop / (wgrad * 1e-3), dbias * 1e3, d.y_elements() * 2.0 / 1e6 / dbias,
        plans.engines().c_str());
  }
  REPLAY_CUDA_CHECK(cudaEventDestroy(start));
  REPLAY_CUDA_CHECK(cudaEventDestroy(stop));
}

}  // namespace
}  // namespace replay::unet
