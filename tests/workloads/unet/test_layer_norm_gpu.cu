// The spatial transformers' LayerNorm (layer_norm.h) on the GPU against the fp64 reference (the
// GroupNorm reference with one group over one pixel): single rows, widths that leave lanes idle
// (C = 8, 264) and the UNet's widths (320, 640, 1280) and the largest (1536), fp16 and bf16;
// accumulation into dx and into the parameter gradients; bitwise determinism; a CUDA graph replay
// equal to the eager calls; refused arguments; and, printed, not asserted, the time and bandwidth
// of the UNet's LayerNorms against the GroupNorm kernels that ran them before (in the model's
// chunks of 32,768 tokens).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/check.h"
#include "tests/support/compare.h"
#include "tests/workloads/unet/norm_timing.cuh"
#include "workloads/unet/group_norm.h"
#include "workloads/unet/layer_norm.h"
#include "workloads/unet/unet_reference.h"

namespace replay::unet {
namespace {

using test::DeviceBuffer;
using test::same_bits;
using timing::fill;
using timing::time_ms;
using Vec = std::vector<double>;

// Tolerances as test_group_norm_gpu's: one rounding to the storage type on top of fp32 math; dx's
// and the parameter gradients' atol a fraction of the largest |ref|.
struct Tol {
  double atol, rtol;
};
Tol out_tol(DType t) {
  return t == DType::kFP16 ? Tol{1e-3, 2e-3} : Tol{2e-3, 8e-3};
}
Tol dx_tol(DType t) {
  return t == DType::kFP16 ? Tol{1e-3, 2e-3} : Tol{4e-3, 8e-3};
}
constexpr Tol kParamTol{1e-4, 1e-4};
constexpr Tol kStatsTol{1e-5, 1e-5};
constexpr DType kF16 = DType::kFP16, kB16 = DType::kBF16;
constexpr float kEps = 1e-5f;

using test::from_bits;
using test::from_storage;
using test::to_bits;
using test::to_storage;
std::vector<float> draw(size_t n, uint64_t seed, float mean, float stddev, DType t) {
  return from_storage(to_storage(test::random_normal(n, seed, mean, stddev), t), t);
}

::testing::AssertionResult close(const std::string& what, const std::vector<float>& got,
                                 const Vec& ref, Tol tol, bool scaled_atol) {
  double largest = 0.0;
  for (double r : ref) largest = std::max(largest, std::fabs(r));
  return test::all_close(what, got, ref, {scaled_atol ? tol.atol * largest : tol.atol, tol.rtol});
}

struct Problem {
  int64_t rows;
  int C;
  DType dtype;
  std::vector<float> x, gamma, beta, dout;
  std::string name() const {
    return "rows=" + std::to_string(rows) + " C=" + std::to_string(C) + " " + dtype_name(dtype);
  }
};

Problem make_problem(int64_t rows, int C, DType t, uint64_t seed) {
  const size_t n = static_cast<size_t>(rows * C);
  // x off-centre (mean 0.5, stddev 2), so the statistics must remove a mean.
  return {rows,
          C,
          t,
          draw(n, seed, 0.5f, 2.0f, t),
          draw(C, seed + 1, 1.0f, 0.5f, t),
          draw(C, seed + 2, 0.0f, 0.5f, t),
          draw(n, seed + 3, 0.0f, 1.0f, t)};
}

// Outputs start as NaN (DeviceBuffer poisons them).
struct Buffers {
  explicit Buffers(const Problem& p)
      : x(to_storage(p.x, p.dtype)),
        gamma(to_storage(p.gamma, p.dtype)),
        beta(to_storage(p.beta, p.dtype)),
        dout(to_storage(p.dout, p.dtype)),
        out(p.x.size()),
        dx(p.x.size()),
        mean(p.rows),
        rstd(p.rows),
        dgamma(p.C),
        dbeta(p.C),
        workspace(layer_norm_backward_workspace_bytes(p.rows, p.C)) {}
  DeviceBuffer<uint16_t> x, gamma, beta, dout, out, dx;
  DeviceBuffer<float> mean, rstd, dgamma, dbeta;
  DeviceBuffer<uint8_t> workspace;
};

void forward(const Problem& p, Buffers& b, cudaStream_t stream) {
  layer_norm_forward(p.dtype, b.out.get(), b.mean.get(), b.rstd.get(), b.x.get(), b.gamma.get(),
                     b.beta.get(), p.rows, p.C, kEps, stream);
}

void backward(const Problem& p, Buffers& b, cudaStream_t stream, bool acc_dx = false,
              bool acc_params = false) {
  layer_norm_backward(p.dtype, b.dx.get(), b.dgamma.get(), b.dbeta.get(), b.dout.get(), b.x.get(),
                      b.gamma.get(), b.mean.get(), b.rstd.get(), p.rows, p.C, acc_dx, acc_params,
                      b.workspace.get(), b.workspace.size(), stream);
}

struct Reference {
  Vec out, mean, rstd, dx, dgamma, dbeta;
};

// LayerNorm is GroupNorm with one group over one pixel: N = rows, HW = 1, G = 1.
Reference reference(const Problem& p) {
  const size_t n = p.x.size();
  Reference r{Vec(n), Vec(p.rows), Vec(p.rows), Vec(n), Vec(p.C), Vec(p.C)};
  const Vec x = test::to_double(p.x), gamma = test::to_double(p.gamma),
            beta = test::to_double(p.beta), dout = test::to_double(p.dout);
  ref::group_norm_forward(r.out.data(), r.mean.data(), r.rstd.data(), x.data(), gamma.data(),
                          beta.data(), p.rows, 1, p.C, 1, kEps, false);
  ref::group_norm_backward(r.dx.data(), r.dgamma.data(), r.dbeta.data(), dout.data(), x.data(),
                           gamma.data(), beta.data(), r.mean.data(), r.rstd.data(), p.rows, 1, p.C,
                           1, false);
  return r;
}

void expect_matches(const Problem& p, Buffers& b, const Reference& r, const Vec& dx_prefill = {},
                    const Vec& param_prefill = {}) {
  const std::string at = " (" + p.name() + ")";
  Vec dx = r.dx, dgamma = r.dgamma, dbeta = r.dbeta;
  for (size_t i = 0; i < dx_prefill.size(); ++i) dx[i] += dx_prefill[i];
  for (size_t i = 0; i < param_prefill.size(); ++i) {
    dgamma[i] += param_prefill[i];
    dbeta[i] += param_prefill[i];
  }
  EXPECT_TRUE(
      close("out" + at, from_storage(b.out.download(), p.dtype), r.out, out_tol(p.dtype), false));
  EXPECT_TRUE(close("mean" + at, b.mean.download(), r.mean, kStatsTol, false));
  EXPECT_TRUE(close("rstd" + at, b.rstd.download(), r.rstd, kStatsTol, false));
  EXPECT_TRUE(close("dx" + at, from_storage(b.dx.download(), p.dtype), dx, dx_tol(p.dtype), true));
  EXPECT_TRUE(close("dgamma" + at, b.dgamma.download(), dgamma, kParamTol, true));
  EXPECT_TRUE(close("dbeta" + at, b.dbeta.download(), dbeta, kParamTol, true));
}

// One row of 8 (one lane busy); C = 264 (33 packs: a second pack for one lane only); the UNet's
// widths with few rows (warps without rows, one backward block) and with many (2,500 rows: 79
// backward blocks of 8 warps, 3 to 4 rows a warp); the largest width.
struct Case {
  int64_t rows;
  int C;
  DType t;
};
const Case kCases[] = {
    {1, 8, kF16},     {1, 8, kB16},     {3, 264, kF16},    {37, 264, kB16},
    {5, 320, kF16},   {300, 320, kB16}, {2500, 320, kF16}, {129, 640, kF16},
    {129, 640, kB16}, {77, 1280, kF16}, {700, 1280, kB16}, {40, 1536, kF16},
};

TEST(LayerNormGpu, MatchesReference) {
  uint64_t seed = 10;
  for (const Case& c : kCases) {
    const Problem p = make_problem(c.rows, c.C, c.t, seed += 10);
    Buffers b(p);
    forward(p, b, nullptr);
    backward(p, b, nullptr);
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    expect_matches(p, b, reference(p));
  }
}

TEST(LayerNormGpu, AccumulatesIntoGradients) {
  for (const DType t : {kF16, kB16}) {
    const Problem p = make_problem(333, 640, t, 77);
    Buffers b(p);
    const std::vector<float> prefill_dx = draw(p.x.size(), 78, 0.0f, 1.0f, t);
    const std::vector<float> prefill_param = test::random_normal(p.C, 79);
    b.dx.upload(to_storage(prefill_dx, t));
    b.dgamma.upload(prefill_param);
    b.dbeta.upload(prefill_param);
    forward(p, b, nullptr);
    backward(p, b, nullptr, true, true);
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    expect_matches(p, b, reference(p), test::to_double(prefill_dx), test::to_double(prefill_param));
  }
}

// out written over x and dx over dout (the in-place calls layer_norm.h allows) give the same bits.
TEST(LayerNormGpu, InPlaceCallsAgree) {
  const Problem p = make_problem(1000, 320, kF16, 200);
  Buffers a(p), b(p);
  forward(p, a, nullptr);
  backward(p, a, nullptr);
  layer_norm_backward(p.dtype, b.dout.get(), b.dgamma.get(), b.dbeta.get(), b.dout.get(), b.x.get(),
                      b.gamma.get(), a.mean.get(), a.rstd.get(), p.rows, p.C, false, false,
                      b.workspace.get(), b.workspace.size(), nullptr);
  layer_norm_forward(p.dtype, b.x.get(), b.mean.get(), b.rstd.get(), b.x.get(), b.gamma.get(),
                     b.beta.get(), p.rows, p.C, kEps, nullptr);
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits("out over x", a.out.download(), b.x.download()));
  EXPECT_TRUE(same_bits("dx over dout", a.dx.download(), b.dout.download()));
  EXPECT_TRUE(same_bits("dgamma", a.dgamma.download(), b.dgamma.download()));
}

// Two runs, with the workspace poisoned in between, give the same bits; so does a CUDA graph of
// forward and backward captured on a caller's stream and replayed.
TEST(LayerNormGpu, DeterministicAndCapturable) {
  const Problem p = make_problem(8 * 4096, 320, kF16, 300);
  Buffers a(p), b(p), g(p);
  forward(p, a, nullptr);
  backward(p, a, nullptr);
  REPLAY_CUDA_CHECK(cudaMemset(b.workspace.get(), 0x5A, b.workspace.size()));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  forward(p, b, nullptr);
  backward(p, b, nullptr);

  cudaStream_t stream = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward(p, g, stream);
  backward(p, g, stream);
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
  REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
  REPLAY_CUDA_CHECK(cudaStreamDestroy(stream));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());

  for (const Buffers* other : {&b, &g}) {
    const std::string run = other == &b ? "second run" : "graph replay";
    EXPECT_TRUE(same_bits("out, " + run, a.out.download(), other->out.download()));
    EXPECT_TRUE(same_bits("mean, " + run, a.mean.download(), other->mean.download()));
    EXPECT_TRUE(same_bits("rstd, " + run, a.rstd.download(), other->rstd.download()));
    EXPECT_TRUE(same_bits("dx, " + run, a.dx.download(), other->dx.download()));
    EXPECT_TRUE(same_bits("dgamma, " + run, a.dgamma.download(), other->dgamma.download()));
    EXPECT_TRUE(same_bits("dbeta, " + run, a.dbeta.download(), other->dbeta.download()));
  }
  expect_matches(p, a, reference(p));
}

TEST(LayerNormGpu, RejectsBadArguments) {
  const Problem p = make_problem(16, 64, kF16, 400);
  Buffers b(p);
  auto fwd = [&](DType t, void* out, int64_t rows, int C) {
    layer_norm_forward(t, out, b.mean.get(), b.rstd.get(), b.x.get(), b.gamma.get(), b.beta.get(),
                       rows, C, kEps, nullptr);
  };
  EXPECT_THROW(fwd(DType::kFP32, b.out.get(), p.rows, p.C), Error);
  EXPECT_THROW(fwd(p.dtype, b.out.get() + 1, p.rows, p.C), Error);  // misaligned
  EXPECT_THROW(fwd(p.dtype, b.out.get(), p.rows, 12), Error);       // not a multiple of 8
  EXPECT_THROW(fwd(p.dtype, b.out.get(), p.rows, kLayerNormMaxChannels + 8), Error);
  EXPECT_THROW(fwd(p.dtype, b.out.get(), 0, p.C), Error);
  auto bwd = [&](void* dx, bool acc, size_t ws) {
    layer_norm_backward(p.dtype, dx, b.dgamma.get(), b.dbeta.get(), b.dout.get(), b.x.get(),
                        b.gamma.get(), b.mean.get(), b.rstd.get(), p.rows, p.C, acc, false,
                        b.workspace.get(), ws, nullptr);
  };
  EXPECT_THROW(bwd(b.dx.get(), false, b.workspace.size() - 1), Error);  // workspace too small
  EXPECT_THROW(bwd(b.dout.get(), true, b.workspace.size()), Error);     // adds into dout
}

// --- timing (printed, not asserted) --------------------------------------------------------------

// SD2's LayerNorms at 32 images per GPU (tokens x width: 64x64 at 320, 32x32 at 640, 16x16 and
// 8x8 at 1280), with these kernels and with the GroupNorm kernels as the model ran them before
// (one group over one pixel a sample, in chunks of 32,768 samples). GB/s of least traffic: the
// forward reads x and writes out (2 tensors), the backward reads x and dout and writes dx (3).
TEST(LayerNormGpu, TimingPrinted) {
  constexpr int64_t kChunk = 32768;
  struct Shape {
    int64_t rows;
    int C;
  };
  for (const Shape s : {Shape{32 * 64 * 64, 320}, Shape{32 * 32 * 32, 640},
                        Shape{32 * 16 * 16, 1280}, Shape{32 * 8 * 8, 1280}}) {
    const DType t = kF16;
    const size_t n = static_cast<size_t>(s.rows * s.C);
    const GroupNormShape chunk{std::min(kChunk, s.rows), 1, s.C, 1};
    DeviceBuffer<uint16_t> x(n), out(n), dout(n), dx(n), gamma(s.C), beta(s.C);
    DeviceBuffer<float> mean(s.rows), rstd(s.rows), dgamma(s.C), dbeta(s.C);
    DeviceBuffer<uint8_t> ws(std::max({layer_norm_backward_workspace_bytes(s.rows, s.C),
                                       group_norm_forward_workspace_bytes(chunk),
                                       group_norm_backward_workspace_bytes(chunk)}));
    fill(x, 1, 0.3f, t);
    fill(dout, 2, 0.0f, t);
    fill(gamma, 3, 1.0f, t);
    fill(beta, 4, 0.0f, t);
    const int iters = 20;
    const float fwd = time_ms(
        [&] {
          layer_norm_forward(t, out.get(), mean.get(), rstd.get(), x.get(), gamma.get(), beta.get(),
                             s.rows, s.C, kEps, nullptr);
        },
        iters);
    const float bwd = time_ms(
        [&] {
          layer_norm_backward(t, dx.get(), dgamma.get(), dbeta.get(), dout.get(), x.get(),
                              gamma.get(), mean.get(), rstd.get(), s.rows, s.C, false, false,
                              ws.get(), ws.size(), nullptr);
        },
        iters);
    // The GroupNorm kernels, chunk after chunk (as GroupNormNode ran a LayerNorm before).
    auto chunks = [&](auto&& call) {
      for (int64_t first = 0; first < s.rows; first += kChunk) {
        GroupNormShape c = chunk;
        c.batch = std::min(kChunk, s.rows - first);
        call(first, c);
      }
    };
    const float gn_fwd = time_ms(
        [&] {
          chunks([&](int64_t first, const GroupNormShape& c) {
            group_norm_forward(t, out.get() + first * s.C, mean.get() + first, rstd.get() + first,
                               x.get() + first * s.C, gamma.get(), beta.get(), c, kEps,
                               GroupNormAct::kNone, ws.get(), ws.size(), nullptr);
          });
        },
        iters);
    const float gn_bwd = time_ms(
        [&] {
          chunks([&](int64_t first, const GroupNormShape& c) {
            group_norm_backward(t, dx.get() + first * s.C, dgamma.get(), dbeta.get(),
                                dout.get() + first * s.C, x.get() + first * s.C, gamma.get(),
                                beta.get(), mean.get() + first, rstd.get() + first, c,
                                GroupNormAct::kNone, false, first > 0, ws.get(), ws.size(),
                                nullptr);
          });
        },
        iters);
    const double mb = static_cast<double>(n) * 2.0 / 1e6;
    std::printf(
        "LayerNorm rows=%-7lld C=%-5d %6.1f MB  fwd %7.1f us %5.0f GB/s  bwd %7.1f us %5.0f GB/s"
        "  | GroupNorm kernels fwd %8.1f us  bwd %8.1f us  | speed-up fwd %5.1fx bwd %5.1fx\n",
        static_cast<long long>(s.rows), s.C, mb, fwd * 1e3, 2 * mb / fwd, bwd * 1e3, 3 * mb / bwd,
        gn_fwd * 1e3, gn_bwd * 1e3, gn_fwd / fwd, gn_bwd / bwd);
  }
}

}  // namespace
}  // namespace replay::unet
