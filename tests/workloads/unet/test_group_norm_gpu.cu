// GroupNorm(+SiLU) over NHWC on the GPU against the fp64 reference: small shapes (single pixels,
// groups of 3 to 64 channels, tiles with a short tail) and the UNet's shapes (64x64 at C = 320,
// skip widths 960 and 1920, 8x8 at C = 2560), fp16 and bf16, with and without SiLU, accumulation
// into dx and into the parameter gradients; bitwise determinism; a CUDA graph replay equal to the
// eager calls; the convolutions' bias kernels (group_norm.cu); and, printed, not asserted, the
// time and bandwidth of the UNet's largest GroupNorm.
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
#include "workloads/unet/conv.h"
#include "workloads/unet/group_norm.h"
#include "workloads/unet/unet_reference.h"

namespace replay::unet {
namespace {

using test::DeviceBuffer;
using test::same_bits;
using timing::fill;
using timing::time_ms;
using Vec = std::vector<double>;

// Tolerances against the fp64 reference fed the same rounded inputs (atol, rtol). Outputs carry
// one rounding to the storage type (2^-11 relative for fp16, 2^-8 for bf16) on top of fp32 math:
// rtol is about twice that; atol covers values near zero. For dx, whose fp32 error comes from
// group means over up to 10^5 elements, and for the fp32 parameter gradients (sums over N * HW
// pixels), atol is a fraction of the tensor's largest |ref|. Statistics are fp32 throughout.
struct Tol {
  double atol, rtol;
};
Tol out_tol(DType t) {
  return t == DType::kFP16 ? Tol{1e-3, 2e-3} : Tol{2e-3, 8e-3};
}
Tol dx_tol(DType t) {  // atol relative to max |dx|
  return t == DType::kFP16 ? Tol{1e-3, 2e-3} : Tol{4e-3, 8e-3};
}
constexpr Tol kParamTol{1e-4, 1e-4};  // atol relative to max |ref|
constexpr Tol kStatsTol{1e-5, 1e-5};

// --- storage -------------------------------------------------------------------------------------

using test::from_bits;
using test::from_storage;
using test::to_bits;
using test::to_storage;
// Drawn, then rounded to the storage type: the values the GPU sees.
std::vector<float> draw(size_t n, uint64_t seed, float mean, float stddev, DType t) {
  return from_storage(to_storage(test::random_normal(n, seed, mean, stddev), t), t);
}

::testing::AssertionResult close(const std::string& what, const std::vector<float>& got,
                                 const Vec& ref, Tol tol, bool scaled_atol) {
  double largest = 0.0;
  for (double r : ref) largest = std::max(largest, std::fabs(r));
  return test::all_close(what, got, ref, {scaled_atol ? tol.atol * largest : tol.atol, tol.rtol});
}

std::string name(const GroupNormShape& s, DType t, GroupNormAct act) {
  return "N=" + std::to_string(s.batch) + " HW=" + std::to_string(s.pixels) +
         " C=" + std::to_string(s.channels) + " G=" + std::to_string(s.groups) + " " +
         dtype_name(t) + (act == GroupNormAct::kSilu ? " silu" : "");
}

// --- one problem ---------------------------------------------------------------------------------

struct Problem {
  GroupNormShape s;
  DType dtype;
  GroupNormAct act;
  std::vector<float> x, gamma, beta, dout;
};

Problem make_problem(const GroupNormShape& s, DType t, GroupNormAct act, uint64_t seed) {
  const size_t n = static_cast<size_t>(s.elements());
  // x off-centre (mean 0.5, stddev 2), so the statistics must remove a mean.
  return {s,
          t,
          act,
          draw(n, seed, 0.5f, 2.0f, t),
          draw(s.channels, seed + 1, 1.0f, 0.5f, t),
          draw(s.channels, seed + 2, 0.0f, 0.5f, t),
          draw(n, seed + 3, 0.0f, 1.0f, t)};
}

// Device buffers of a problem; outputs start as NaN (DeviceBuffer poisons them).
struct Buffers {
  explicit Buffers(const Problem& p)
      : x(to_storage(p.x, p.dtype)),
        gamma(to_storage(p.gamma, p.dtype)),
        beta(to_storage(p.beta, p.dtype)),
        dout(to_storage(p.dout, p.dtype)),
        out(p.x.size()),
        dx(p.x.size()),
        mean(p.s.batch * p.s.groups),
        rstd(p.s.batch * p.s.groups),
        dgamma(p.s.channels),
        dbeta(p.s.channels),
        workspace(std::max(group_norm_forward_workspace_bytes(p.s),
                           group_norm_backward_workspace_bytes(p.s))) {}
  DeviceBuffer<uint16_t> x, gamma, beta, dout, out, dx;
  DeviceBuffer<float> mean, rstd, dgamma, dbeta;
  DeviceBuffer<uint8_t> workspace;
};

void forward(const Problem& p, Buffers& b, cudaStream_t stream) {
  group_norm_forward(p.dtype, b.out.get(), b.mean.get(), b.rstd.get(), b.x.get(), b.gamma.get(),
                     b.beta.get(), p.s, 1e-5f, p.act, b.workspace.get(), b.workspace.size(),
                     stream);
}

void backward(const Problem& p, Buffers& b, cudaStream_t stream, bool acc_dx = false,
              bool acc_params = false) {
  group_norm_backward(p.dtype, b.dx.get(), b.dgamma.get(), b.dbeta.get(), b.dout.get(), b.x.get(),
                      b.gamma.get(), b.beta.get(), b.mean.get(), b.rstd.get(), p.s, p.act, acc_dx,
                      acc_params, b.workspace.get(), b.workspace.size(), stream);
}

struct Reference {
  Vec out, mean, rstd, dx, dgamma, dbeta;
};

Reference reference(const Problem& p) {
  const GroupNormShape& s = p.s;
  const size_t n = p.x.size();
  Reference r{Vec(n), Vec(s.batch * s.groups), Vec(s.batch * s.groups),
              Vec(n), Vec(s.channels),         Vec(s.channels)};
  const Vec x = test::to_double(p.x), gamma = test::to_double(p.gamma),
            beta = test::to_double(p.beta), dout = test::to_double(p.dout);
  const bool silu = p.act == GroupNormAct::kSilu;
  ref::group_norm_forward(r.out.data(), r.mean.data(), r.rstd.data(), x.data(), gamma.data(),
                          beta.data(), s.batch, s.pixels, s.channels, s.groups, 1e-5, silu);
  ref::group_norm_backward(r.dx.data(), r.dgamma.data(), r.dbeta.data(), dout.data(), x.data(),
                           gamma.data(), beta.data(), r.mean.data(), r.rstd.data(), s.batch,
                           s.pixels, s.channels, s.groups, silu);
  return r;
}

void expect_matches(const Problem& p, Buffers& b, const Reference& r, const Vec& dx_prefill = {},
                    const Vec& param_prefill = {}) {
  const std::string at = " (" + name(p.s, p.dtype, p.act) + ")";
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

struct Case {
  GroupNormShape s;
  DType dtype;
  GroupNormAct act;
};

constexpr DType kF16 = DType::kFP16, kB16 = DType::kBF16;
constexpr GroupNormAct kNone = GroupNormAct::kNone, kSilu = GroupNormAct::kSilu;

// Small shapes: one pixel; groups of 3 channels (a 16-byte column spans three groups); 8 channels
// per group with 7 pixels (tiles with a short tail); one group over all channels; 64 channels a
// group; G = 128. The UNet's: 64x64 at C = 320 and G = 16 (tiles of 128 pixels), 32x32 with the
// 960-wide skip concatenation and G = 32 (20-channel groups at 30: not 16-byte aligned), 16x16 at
// 1920, 8x8 at 2560 (one column per thread, a single lane).
const Case kCases[] = {
    {{1, 1, 8, 1}, kF16, kNone},       {{1, 1, 8, 1}, kB16, kSilu},
    {{2, 33, 48, 16}, kF16, kSilu},    {{2, 33, 48, 16}, kB16, kNone},
    {{3, 7, 40, 5}, kF16, kNone},      {{3, 7, 40, 5}, kB16, kSilu},
    {{2, 100, 64, 1}, kF16, kSilu},    {{1, 300, 128, 2}, kB16, kSilu},
    {{2, 64, 1024, 128}, kF16, kSilu}, {{2, 4096, 320, 16}, kF16, kSilu},
    {{2, 4096, 320, 16}, kB16, kNone}, {{1, 1024, 960, 32}, kF16, kSilu},
    {{1, 1024, 960, 32}, kB16, kSilu}, {{1, 256, 1920, 32}, kF16, kNone},
    {{2, 64, 2560, 16}, kF16, kSilu},  {{2, 64, 2560, 16}, kB16, kSilu},
};

TEST(GroupNormGpu, MatchesReference) {
  uint64_t seed = 10;
  for (const Case& c : kCases) {
    const Problem p = make_problem(c.s, c.dtype, c.act, seed += 10);
    Buffers b(p);
    forward(p, b, nullptr);
    backward(p, b, nullptr);
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    expect_matches(p, b, reference(p));
  }
}

// accumulate_dx adds into dx, accumulate_param_grads into dgamma and dbeta.
TEST(GroupNormGpu, AccumulatesIntoGradients) {
  for (const DType t : {kF16, kB16}) {
    const Problem p = make_problem({2, 300, 160, 16}, t, kSilu, 77);
    Buffers b(p);
    const std::vector<float> prefill_dx = draw(p.x.size(), 78, 0.0f, 1.0f, t);
    const std::vector<float> prefill_param = test::random_normal(p.s.channels, 79);
    b.dx.upload(to_storage(prefill_dx, t));
    b.dgamma.upload(prefill_param);
    b.dbeta.upload(prefill_param);
    forward(p, b, nullptr);
    backward(p, b, nullptr, true, true);
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    expect_matches(p, b, reference(p), test::to_double(prefill_dx), test::to_double(prefill_param));
  }
}

// Two runs, with the workspace poisoned in between, give the same bits; so does a CUDA graph of
// forward and backward captured on a caller's stream and replayed.
TEST(GroupNormGpu, DeterministicAndCapturable) {
  const Problem p = make_problem({8, 4096, 320, 16}, kF16, kSilu, 300);
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
  for (int i = 0; i < 2; ++i) REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // replays
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
  // And the result is right.
  expect_matches(p, a, reference(p));
}

TEST(GroupNormGpu, RejectsBadArguments) {
  const Problem p = make_problem({1, 16, 64, 4}, kF16, kNone, 400);
  Buffers b(p);
  const size_t need = group_norm_forward_workspace_bytes(p.s);
  EXPECT_THROW(
      group_norm_forward(p.dtype, b.out.get(), b.mean.get(), b.rstd.get(), b.x.get(), b.gamma.get(),
                         b.beta.get(), p.s, 1e-5f, p.act, b.workspace.get(), need - 1, nullptr),
      Error);
  EXPECT_THROW(group_norm_forward(p.dtype, b.out.get() + 1, b.mean.get(), b.rstd.get(), b.x.get(),
                                  b.gamma.get(), b.beta.get(), p.s, 1e-5f, p.act, b.workspace.get(),
                                  b.workspace.size(), nullptr),
               Error);  // misaligned
  EXPECT_THROW(group_norm_forward(DType::kFP32, b.out.get(), b.mean.get(), b.rstd.get(), b.x.get(),
                                  b.gamma.get(), b.beta.get(), p.s, 1e-5f, p.act, b.workspace.get(),
                                  b.workspace.size(), nullptr),
               Error);
  EXPECT_THROW(
      group_norm_backward(p.dtype, b.dout.get(), b.dgamma.get(), b.dbeta.get(), b.dout.get(),
                          b.x.get(), b.gamma.get(), b.beta.get(), b.mean.get(), b.rstd.get(), p.s,
                          p.act, true, false, b.workspace.get(), b.workspace.size(), nullptr),
      Error);  // dx accumulated into dout
}

// --- the convolutions' bias (conv.h, kernels in group_norm.cu) -----------------------------------

TEST(ConvBiasGpu, GradientAndAddMatchReference) {
  struct Shape {
    int64_t rows, k;
  };
  uint64_t seed = 500;
  for (const Shape s : {Shape{1, 4}, Shape{1000, 4}, Shape{77, 12}, Shape{4096, 320},
                        Shape{2 * 1024, 1280}, Shape{64 * 64 * 2, 4}}) {
    for (const DType t : {kF16, kB16}) {
      const std::string at =
          " rows " + std::to_string(s.rows) + " K " + std::to_string(s.k) + " " + dtype_name(t);
      const std::vector<float> dy = draw(s.rows * s.k, ++seed, 0.0f, 1.0f, t);
      const std::vector<float> bias = draw(s.k, ++seed, 0.0f, 1.0f, t);
      DeviceBuffer<uint16_t> dy_d(to_storage(dy, t)), y_d(to_storage(dy, t)),
          bias_d(to_storage(bias, t));
      DeviceBuffer<float> db(s.k), db2(s.k);
      DeviceBuffer<uint8_t> ws(conv_bias_grad_workspace_bytes(s.rows, s.k));
      conv_bias_grad(t, db.get(), dy_d.get(), s.rows, s.k, false, ws.get(), ws.size(), nullptr);
      conv_bias_grad(t, db2.get(), dy_d.get(), s.rows, s.k, false, ws.get(), ws.size(), nullptr);
      conv_bias_add(t, y_d.get(), bias_d.get(), s.rows, s.k, nullptr);
      REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
      Vec ref_db(s.k);
      ref::bias_grad(ref_db.data(), test::to_double(dy).data(), s.rows, s.k);
      EXPECT_TRUE(close("dbias" + at, db.download(), ref_db, kParamTol, true));
      EXPECT_TRUE(same_bits("dbias twice" + at, db.download(), db2.download()));
      Vec ref_y(dy.size());
      for (int64_t i = 0; i < s.rows; ++i)
        for (int64_t k = 0; k < s.k; ++k) ref_y[i * s.k + k] = dy[i * s.k + k] + bias[k];
      EXPECT_TRUE(
          close("bias add" + at, from_storage(y_d.download(), t), ref_y, out_tol(t), false));
    }
  }
}

// --- timing (printed, not asserted) --------------------------------------------------------------

// The UNet's largest GroupNorms at 32 images per GPU. "Compulsory" bytes are what any GroupNorm
// must move: the forward reads x and writes out, the backward reads x and dout and writes dx; the
// kernels read x once more in each direction (the statistics, the tile sums), partly from L2.
// Copy: a device-to-device cudaMemcpy of the tensor, the bandwidth reference.
TEST(GroupNormGpu, TimingPrinted) {
  struct Shape {
    GroupNormShape s;
    DType t;
  };
  const Shape shapes[] = {{{32, 64 * 64, 320, 16}, kF16}, {{32, 64 * 64, 320, 16}, kB16},
                          {{64, 64 * 64, 320, 16}, kF16}, {{32, 64 * 64, 960, 16}, kF16},
                          {{32, 32 * 32, 640, 16}, kF16}, {{32, 16 * 16, 1280, 16}, kF16},
                          {{32, 8 * 8, 2560, 16}, kF16},  {{1, 64 * 64, 320, 16}, kF16}};
  for (const Shape& sh : shapes) {
    const GroupNormShape& s = sh.s;
    const size_t n = static_cast<size_t>(s.elements());
    DeviceBuffer<uint16_t> x(n), out(n), dout(n), dx(n), gamma(s.channels), beta(s.channels);
    DeviceBuffer<float> mean(s.batch * s.groups), rstd(s.batch * s.groups), dgamma(s.channels),
        dbeta(s.channels);
    DeviceBuffer<uint8_t> ws(
        std::max(group_norm_forward_workspace_bytes(s), group_norm_backward_workspace_bytes(s)));
    fill(x, 1, 0.3f, sh.t);
    fill(dout, 2, 0.0f, sh.t);
    fill(gamma, 3, 1.0f, sh.t);
    fill(beta, 4, 0.0f, sh.t);
    const int iters = 20;
    const float fwd = time_ms(
        [&] {
          group_norm_forward(sh.t, out.get(), mean.get(), rstd.get(), x.get(), gamma.get(),
                             beta.get(), s, 1e-5f, kSilu, ws.get(), ws.size(), nullptr);
        },
        iters);
    const float bwd = time_ms(
        [&] {
          group_norm_backward(sh.t, dx.get(), dgamma.get(), dbeta.get(), dout.get(), x.get(),
                              gamma.get(), beta.get(), mean.get(), rstd.get(), s, kSilu, false,
                              false, ws.get(), ws.size(), nullptr);
        },
        iters);
    const float copy = time_ms(
        [&] {
          REPLAY_CUDA_CHECK(
              cudaMemcpyAsync(out.get(), x.get(), n * 2, cudaMemcpyDeviceToDevice, nullptr));
        },
        iters);
    const double mb = n * 2.0 / 1e6;
    const GroupNormSplit split = group_norm_split(s);
    std::printf(
        "GroupNorm+SiLU %-32s %7.1f MB  tiles %4lld x %3d thr  fwd %7.1f us %6.0f GB/s "
        "(moved %6.0f)  bwd %7.1f us %6.0f GB/s (moved %6.0f)  copy %6.0f GB/s\n",
        name(s, sh.t, kSilu).c_str(), mb, static_cast<long long>(s.batch * split.blocks_per_sample),
        split.threads, fwd * 1e3, 2 * mb / fwd, 3 * mb / fwd, bwd * 1e3, 3 * mb / bwd, 5 * mb / bwd,
        2 * mb / copy);
  }
}

}  // namespace
}  // namespace replay::unet
