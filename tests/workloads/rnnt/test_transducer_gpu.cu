// The transducer-loss kernels against the fp64 CPU reference: random shapes and ragged lengths
// (every lattice width the recursion specialises on, 16-byte and element-wise row access), fp32,
// fp16 and bf16 logits, NaN logits past the lengths (which must never be read) and an exactly zero
// gradient there; the sum and mean reductions with a device-side scale; the gradient written in
// place over the logits; bit-identical reruns; a CUDA graph replayed twice (and after the lengths
// in device memory change) against eager runs; the time of one forward and backward at an
// MLPerf-like shape. Separate suites: TransducerBig (the MLPerf padding, 2.9e9 fp16 logits, label
// big) and TransducerTorch (a case written by torch_rnnt_check.py from torchaudio's rnnt_loss).
//
// Tolerances, for the GPU's fp32 log-space arithmetic against fp64 on identical inputs: alpha and
// beta reach hundreds to thousands of nats, where an fp32 ulp is 3e-5 to 2.4e-4, and the rounding
// of each step accumulates along the lattice's T + U steps, so a gradient element, which is
// exp(alpha + beta - logP) times a probability, carries a relative error of up to ~1e-3 (measured
// with an fp32 emulation of the kernels on the host: 1.2e-3 at T = 200, U = 59) and the loss a
// relative error near 1e-7. fp16 and bf16 gradients add their own rounding (2^-11 and 2^-8
// relative).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/kernels/init.h"
#include "common/tensor.h"
#include "tests/support/compare.h"
#include "workloads/rnnt/transducer.h"
#include "workloads/rnnt/transducer_reference.h"

namespace replay::rnnt {
namespace {

using test::DeviceBuffer;

struct Tolerances {
  double loss_atol, loss_rtol;  // per-utterance loss and the mean
  double grad_atol, grad_rtol;  // gradient at scale 1 (atol scales with the gradient's scale)
};

Tolerances tolerances(DType t) {
  switch (t) {
    case DType::kFP32:
      return {1e-4, 5e-6, 5e-5, 5e-3};
    case DType::kFP16:
      return {1e-4, 5e-6, 5e-5, 6e-3};
    default:  // bf16: 2^-8 relative rounding of the gradient
      return {1e-4, 5e-6, 5e-5, 1.2e-2};
  }
}

// ---------------------------------------------------------------------------------------------------
// Host values in the logits' storage type.

float round_to(DType t, float x) {
  if (t == DType::kFP16) return __half2float(__float2half_rn(x));
  if (t == DType::kBF16) return __bfloat162float(__float2bfloat16_rn(x));
  return x;
}

std::vector<unsigned char> encode(const std::vector<float>& x, DType t) {
  std::vector<unsigned char> out(x.size() * dtype_size(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::kFP16) {
      const __half h = __float2half_rn(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else if (t == DType::kBF16) {
      const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    }
  }
  return out;
}

std::vector<float> decode(const std::vector<unsigned char>& bytes, DType t) {
  const size_t n = bytes.size() / dtype_size(t);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (t == DType::kFP16) {
      __half h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = __half2float(h);
    } else if (t == DType::kBF16) {
      __nv_bfloat16 h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = __bfloat162float(h);
    } else {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// A problem: shape, lengths, labels and the logits exactly as the device holds them.

struct Problem {
  TransducerShape shape;
  DType dtype = DType::kFP32;
  std::vector<float> logits;  // NaN past the lengths
  std::vector<int32_t> labels, frames, label_lengths;

  bool inside(int64_t b, int64_t t, int64_t u) const {
    return t < frames[b] && u <= label_lengths[b];
  }
  std::string name() const {
    return std::string(dtype_name(dtype)) + " B" + std::to_string(shape.batch) + " T" +
           std::to_string(shape.max_frames) + " U" + std::to_string(shape.max_labels) + " V" +
           std::to_string(shape.vocab) + " blank " + std::to_string(shape.blank);
  }
};

TransducerShape make_shape(int64_t B, int64_t T, int64_t U, int64_t V, int blank) {
  TransducerShape s;
  s.batch = B;
  s.max_frames = T;
  s.max_labels = U;
  s.vocab = V;
  s.blank = blank;
  return s;
}

// Random lengths with utterance 0 at the full padding and, if asked, the last one an empty slot;
// labels anywhere but the blank and out of range past each transcript (never read); logits
// N(0, 2) rounded to the storage type, NaN past the lengths.
void randomize(Problem& p, uint64_t seed, bool empty_slot) {
  const TransducerShape& s = p.shape;
  std::mt19937_64 rng(seed);
  p.frames.assign(s.batch, 0);
  p.label_lengths.assign(s.batch, 0);
  p.labels.assign(s.batch * s.max_labels, 0);
  for (int64_t b = 0; b < s.batch; ++b) {
    p.frames[b] = b == 0 ? s.max_frames : 1 + static_cast<int32_t>(rng() % s.max_frames);
    p.label_lengths[b] = b == 0 ? s.max_labels : static_cast<int32_t>(rng() % (s.max_labels + 1));
    for (int64_t u = 0; u < s.max_labels; ++u) {
      int32_t y = s.vocab > 1 ? static_cast<int32_t>(rng() % (s.vocab - 1)) : 0;
      if (y >= s.blank) ++y;
      p.labels[b * s.max_labels + u] =
          u < p.label_lengths[b] ? y : (u % 2 ? -7 : static_cast<int32_t>(s.vocab + 5));
    }
  }
  if (empty_slot && s.batch > 1) p.frames[s.batch - 1] = 0;
  p.logits = test::random_normal(s.elements(), seed + 1, 0.0f, 2.0f);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.max_frames; ++t)
      for (int64_t u = 0; u < s.positions(); ++u) {
        float* row =
            p.logits.data() + transducer_row(b, t, u, s.max_frames, s.positions()) * s.vocab;
        for (int64_t v = 0; v < s.vocab; ++v)
          row[v] = p.inside(b, t, u) ? round_to(p.dtype, row[v]) : NAN;
      }
}

Problem make_problem(int64_t B, int64_t T, int64_t U, int64_t V, int blank, DType dtype,
                     uint64_t seed, bool empty_slot = false) {
  Problem p;
  p.shape = make_shape(B, T, U, V, blank);
  p.dtype = dtype;
  randomize(p, seed, empty_slot);
  return p;
}

// The problem's device buffers. The gradient goes to its own buffer (poisoned with NaN by
// DeviceBuffer) or over the logits.
struct Device {
  const Problem& p;
  DeviceBuffer<unsigned char> logits, grad, workspace;
  DeviceBuffer<int32_t> labels, frames, label_lengths;
  DeviceBuffer<float> loss, mean, scale;

  explicit Device(const Problem& problem)
      : p(problem),
        logits(encode(problem.logits, problem.dtype)),
        grad(problem.logits.size() * dtype_size(problem.dtype)),
        workspace(transducer_workspace_bytes(problem.shape)),
        labels(problem.labels),
        frames(problem.frames),
        label_lengths(problem.label_lengths),
        loss(problem.shape.batch),
        mean(1),
        scale(1) {}

  TransducerInputs inputs() const {
    TransducerInputs in;
    in.logits = logits.get();
    in.dtype = p.dtype;
    in.labels = labels.get();
    in.frame_lengths = frames.get();
    in.label_lengths = label_lengths.get();
    return in;
  }
  void forward(cudaStream_t stream) {
    transducer_forward(loss.get(), mean.get(), inputs(), p.shape, workspace.get(), workspace.size(),
                       stream);
  }
  void backward(bool in_place, TransducerReduction reduction, cudaStream_t stream) {
    transducer_backward(in_place ? logits.get() : grad.get(), inputs(), scale.get(), reduction,
                        p.shape, workspace.get(), workspace.size(), stream);
  }
};

struct Outputs {
  std::vector<float> loss, grad;
  float mean = 0.0f;
};

Outputs download(const Device& d, bool in_place) {
  Outputs o;
  o.loss = d.loss.download();
  o.mean = d.mean.download()[0];
  o.grad = decode(in_place ? d.logits.download() : d.grad.download(), d.p.dtype);
  return o;
}

Outputs run(const Problem& p, float scale, TransducerReduction reduction, bool in_place) {
  Device d(p);
  d.scale.upload({scale});
  d.forward(nullptr);
  d.backward(in_place, reduction, nullptr);
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  return download(d, in_place);
}

struct Errors {
  double loss_rel = 0.0, grad_abs = 0.0, grad_ref_max = 0.0;
};

// The outputs against the reference; rows past the lengths must hold exactly +0.
Errors expect_matches_reference(const Problem& p, const Outputs& o, float scale,
                                TransducerReduction reduction) {
  const TransducerShape& s = p.shape;
  const std::vector<double> logits = test::to_double(p.logits);
  int count = 0;
  for (int32_t f : p.frames) count += f > 0;
  const double effective =
      reduction == TransducerReduction::kMean ? (count > 0 ? scale / count : 0.0) : scale;
  std::vector<double> loss(s.batch), grad(s.elements());
  ref::transducer_loss(loss.data(), grad.data(), logits.data(), p.labels.data(), p.frames.data(),
                       p.label_lengths.data(), s, effective);
  double sum = 0.0;
  for (int64_t b = 0; b < s.batch; ++b) sum += p.frames[b] > 0 ? loss[b] : 0.0;
  const std::vector<double> mean = {count > 0 ? sum / count : 0.0};

  const Tolerances tol = tolerances(p.dtype);
  const std::string at = " " + p.name();
  EXPECT_TRUE(test::all_close("loss" + at, o.loss, loss, {tol.loss_atol, tol.loss_rtol}));
  EXPECT_TRUE(test::all_close("mean loss" + at, {o.mean}, mean, {tol.loss_atol, tol.loss_rtol}));
  EXPECT_TRUE(test::all_close("grad" + at, o.grad, grad,
                              {tol.grad_atol * std::fabs(effective), tol.grad_rtol}));
  int64_t nonzero_past = 0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.max_frames; ++t)
      for (int64_t u = 0; u < s.positions(); ++u) {
        if (p.inside(b, t, u)) continue;
        const int64_t row = transducer_row(b, t, u, s.max_frames, s.positions()) * s.vocab;
        for (int64_t v = 0; v < s.vocab; ++v) {
          uint32_t bits;
          std::memcpy(&bits, &o.grad[row + v], 4);
          nonzero_past += bits != 0;
        }
      }
  EXPECT_EQ(nonzero_past, 0) << "gradient elements past the lengths not +0," << at;

  Errors e;
  for (int64_t b = 0; b < s.batch; ++b)
    e.loss_rel = std::max(e.loss_rel, std::fabs(o.loss[b] - loss[b]) / std::max(1.0, loss[b]));
  for (int64_t i = 0; i < s.elements(); ++i) {
    e.grad_abs = std::max(e.grad_abs, std::fabs(o.grad[i] - grad[i]));
    e.grad_ref_max = std::max(e.grad_ref_max, std::fabs(grad[i]));
  }
  std::printf("  %-44s loss rel err %.2e, grad max abs err %.2e (max |ref| %.3f)\n",
              p.name().c_str(), e.loss_rel, e.grad_abs, e.grad_ref_max);
  return e;
}

// ---------------------------------------------------------------------------------------------------

struct Case {
  int64_t B, T, U, V;
  int blank;
  DType dtype;
  bool empty_slot;
};

// Lattice widths U + 1 on both sides of each of the recursion's specialisations (32, 64, 128,
// 256, 512 positions), V that allows 16-byte rows and V that does not (odd, or 1000 in fp32
// whose rows are 16-byte aligned but 1001 is not), the blank first, last and in the middle.
const Case kCases[] = {
    {2, 5, 0, 1, 0, DType::kFP32, false},         {3, 7, 4, 5, 0, DType::kFP32, true},
    {4, 20, 10, 33, 32, DType::kFP32, false},     {2, 30, 40, 64, 63, DType::kFP16, true},
    {5, 16, 31, 1024, 1023, DType::kFP16, false}, {3, 24, 64, 1024, 1023, DType::kFP16, true},
    {2, 12, 200, 40, 5, DType::kFP32, false},     {2, 10, 400, 16, 0, DType::kFP16, false},
    {1, 6, 511, 8, 7, DType::kFP32, false},       {3, 40, 20, 1000, 999, DType::kFP32, true},
    {3, 17, 9, 1001, 500, DType::kFP16, false},   {4, 25, 15, 1024, 1023, DType::kBF16, true},
    {2, 9, 127, 96, 95, DType::kBF16, false},
};

TEST(TransducerGpu, MatchesReference) {
  uint64_t seed = 300;
  for (const Case& c : kCases) {
    const Problem p = make_problem(c.B, c.T, c.U, c.V, c.blank, c.dtype, seed += 10, c.empty_slot);
    const Outputs o = run(p, 1.0f, TransducerReduction::kSum, /*in_place=*/false);
    expect_matches_reference(p, o, 1.0f, TransducerReduction::kSum);
  }
}

// The scale is read on the device; the mean divides by the non-empty utterances only.
TEST(TransducerGpu, ScaleAndMeanReduction) {
  const Problem p = make_problem(6, 14, 9, 64, 63, DType::kFP32, 41, /*empty_slot=*/true);
  expect_matches_reference(p, run(p, 0.37f, TransducerReduction::kSum, false), 0.37f,
                           TransducerReduction::kSum);
  expect_matches_reference(p, run(p, 5.0f, TransducerReduction::kMean, false), 5.0f,
                           TransducerReduction::kMean);
}

// In place over the logits gives the same bits as into a separate buffer, and a second run the
// same bits as the first.
TEST(TransducerGpu, InPlaceAndDeterministic) {
  for (DType dtype : {DType::kFP16, DType::kFP32}) {
    const Problem p = make_problem(5, 33, 21, 1024, 1023, dtype, 51, true);
    const Outputs a = run(p, 1.0f, TransducerReduction::kMean, false);
    const Outputs b = run(p, 1.0f, TransducerReduction::kMean, false);
    const Outputs in_place = run(p, 1.0f, TransducerReduction::kMean, true);
    const std::string at = " " + p.name();
    EXPECT_TRUE(
        test::bit_equal("loss, rerun" + at, a.loss.data(), b.loss.data(), 4 * a.loss.size()));
    EXPECT_TRUE(test::bit_equal("mean, rerun" + at, &a.mean, &b.mean, 4));
    EXPECT_TRUE(
        test::bit_equal("grad, rerun" + at, a.grad.data(), b.grad.data(), 4 * a.grad.size()));
    EXPECT_TRUE(test::bit_equal("grad, in place" + at, a.grad.data(), in_place.grad.data(),
                                4 * a.grad.size()));
    EXPECT_TRUE(test::bit_equal("loss, in place" + at, a.loss.data(), in_place.loss.data(),
                                4 * a.loss.size()));
  }
}

__global__ void copy_bytes(unsigned char* dst, const unsigned char* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = src[i];
}

// One training step's loss as the workload will capture it: restore the logits (a plain kernel
// standing in for the joint), forward, backward in place. Replayed twice, and again after the
// per-utterance lengths in device memory change under the same graph, against eager runs.
TEST(TransducerGpu, GraphReplaysMatchEager) {
  Problem p = make_problem(6, 30, 18, 512, 511, DType::kFP16, 61, true);
  Device d(p);
  DeviceBuffer<unsigned char> pristine(encode(p.logits, p.dtype));
  d.scale.upload({1024.0f});  // a loss scale
  cudaStream_t stream;
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t bytes = static_cast<int64_t>(pristine.size());
  auto step = [&] {
    copy_bytes<<<256, 256, 0, stream>>>(d.logits.get(), pristine.get(), bytes);
    REPLAY_LAUNCH_CHECK();
    d.forward(stream);
    d.backward(/*in_place=*/true, TransducerReduction::kMean, stream);
  };
  auto eager = [&] {
    step();
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    return download(d, true);
  };
  const Outputs first = eager();
  expect_matches_reference(p, first, 1024.0f, TransducerReduction::kMean);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step();
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  auto replay = [&] {
    REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    return download(d, true);
  };
  for (int r = 0; r < 2; ++r) {
    const Outputs g = replay();
    const std::string at = " replay " + std::to_string(r);
    EXPECT_TRUE(test::bit_equal("loss" + at, g.loss.data(), first.loss.data(), 4 * g.loss.size()));
    EXPECT_TRUE(test::bit_equal("mean" + at, &g.mean, &first.mean, 4));
    EXPECT_TRUE(test::bit_equal("grad" + at, g.grad.data(), first.grad.data(), 4 * g.grad.size()));
  }

  // New lengths (and the logits that go with them) in the same device buffers.
  Problem q = p;
  randomize(q, 62, false);
  q.frames[0] = 11;  // no utterance at the full padding now
  q.label_lengths[0] = 5;
  for (int64_t b = 0; b < q.shape.batch; ++b)
    for (int64_t t = 0; t < q.shape.max_frames; ++t)
      for (int64_t u = 0; u < q.shape.positions(); ++u) {
        float* row =
            q.logits.data() +
            transducer_row(b, t, u, q.shape.max_frames, q.shape.positions()) * q.shape.vocab;
        if (!q.inside(b, t, u)) std::fill(row, row + q.shape.vocab, NAN);
      }
  pristine.upload(encode(q.logits, q.dtype));
  d.frames.upload(q.frames);
  d.label_lengths.upload(q.label_lengths);
  d.labels.upload(q.labels);
  const Outputs replayed = replay();
  Device e(q);
  e.scale.upload({1024.0f});
  e.forward(nullptr);
  e.backward(true, TransducerReduction::kMean, nullptr);
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  const Outputs eager_q = download(e, true);
  EXPECT_TRUE(test::bit_equal("loss, new lengths", replayed.loss.data(), eager_q.loss.data(),
                              4 * replayed.loss.size()));
  EXPECT_TRUE(test::bit_equal("grad, new lengths", replayed.grad.data(), eager_q.grad.data(),
                              4 * replayed.grad.size()));
  expect_matches_reference(q, replayed, 1024.0f, TransducerReduction::kMean);

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---------------------------------------------------------------------------------------------------
// Timing: one forward and one backward (into a separate buffer) at B = 16, T = 200, U + 1 = 60,
// V = 1024, fp16, every utterance at the full lengths. Printed, not asserted.

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.0f;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

void time_shape(const TransducerShape& s, int iterations) {
  const size_t bytes = static_cast<size_t>(s.elements()) * 2;
  DeviceBuffer<unsigned char> logits(bytes), grad(bytes), workspace(transducer_workspace_bytes(s));
  DeviceBuffer<int32_t> labels(std::vector<int32_t>(s.batch * s.max_labels, 1)),
      frames(std::vector<int32_t>(s.batch, static_cast<int32_t>(s.max_frames))),
      label_lengths(std::vector<int32_t>(s.batch, static_cast<int32_t>(s.max_labels)));
  DeviceBuffer<float> loss(s.batch), mean(1), scale(std::vector<float>{1.0f});
  init_normal(TensorView(logits.get(), DType::kFP16, {s.elements()}), 7, 0, 0.0f, 2.0f, nullptr);
  TransducerInputs in;
  in.logits = logits.get();
  in.dtype = DType::kFP16;
  in.labels = labels.get();
  in.frame_lengths = frames.get();
  in.label_lengths = label_lengths.get();
  cudaEvent_t ev[3];
  for (auto& e : ev) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
  float fwd = 0.0f, bwd = 0.0f;
  for (int i = 0; i <= iterations; ++i) {  // iteration 0 warms up
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[0], nullptr));
    transducer_forward(loss.get(), mean.get(), in, s, workspace.get(), workspace.size(), nullptr);
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[1], nullptr));
    transducer_backward(grad.get(), in, scale.get(), TransducerReduction::kMean, s, workspace.get(),
                        workspace.size(), nullptr);
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[2], nullptr));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(ev[2]));
    if (i == 0) continue;
    fwd += elapsed_ms(ev[0], ev[1]) / iterations;
    bwd += elapsed_ms(ev[1], ev[2]) / iterations;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  const double gb = bytes / 1e9;
  std::printf(
      "  B%lld T%lld U+1=%lld V%lld fp16: forward %.1f us (%.0f GB/s of logits), backward %.1f us "
      "(%.0f GB/s read + written), together %.1f us\n",
      static_cast<long long>(s.batch), static_cast<long long>(s.max_frames),
      static_cast<long long>(s.positions()), static_cast<long long>(s.vocab), 1e3 * fwd,
      gb / (fwd * 1e-3), 1e3 * bwd, 2 * gb / (bwd * 1e-3), 1e3 * (fwd + bwd));
}

// A batch of one at the same lengths is mostly the alpha/beta recursion, whose time does not
// depend on the batch (one block an utterance): it shows how the forward's time divides. The
// widths 32, 60, 72 (MLPerf's 71 labels) and 200 positions take 1, 2, 4 and 8 positions a lane.
TEST(TransducerGpu, TimingMlperfLikeShape) {
  time_shape(make_shape(16, 200, 59, 1024, 1023), 20);
  for (int64_t U : {31, 59, 71, 199}) time_shape(make_shape(1, 200, U, 1024, 1023), 20);
}

// ---------------------------------------------------------------------------------------------------
// TransducerBig: NVIDIA's MLPerf padding, 192 x 205 x 72 x 1024 = 2.9e9 fp16 logits (5.8 GB),
// past 2^31 elements. Utterances 0, 142 (which straddles element 2^31) and 191 (the last rows) run
// at the full lengths, one slot is empty, the others are short so the fp64 reference stays cheap;
// the gradient is written in place. Then the time of one step with every utterance at full length.

__global__ void count_nonzero_past_lengths(unsigned long long* count, const __half* grad,
                                           const int32_t* frames, const int32_t* label_lengths,
                                           int64_t rows, int max_frames, int positions,
                                           int64_t vocab) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t b = row / (int64_t{max_frames} * positions);
    const int64_t r = row - b * max_frames * positions;
    const int64_t t = r / positions, u = r - t * positions;
    if (t < frames[b] && u <= label_lengths[b]) continue;
    unsigned long long n = 0;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
      n += __half_as_ushort(grad[row * vocab + v]) != 0;
    if (n != 0) atomicAdd(count, n);  // integer: the count is exact in any order
  }
}

// The utterance's rows inside its lengths, [T_b, U_b + 1, V], as floats.
std::vector<float> download_utterance(const __half* x, const TransducerShape& s, int64_t b,
                                      int64_t frames, int64_t labels) {
  const size_t width = static_cast<size_t>(labels + 1) * s.vocab * 2;
  std::vector<unsigned char> bytes(width * frames);
  REPLAY_CUDA_CHECK(cudaMemcpy2D(
      bytes.data(), width, x + transducer_row(b, 0, 0, s.max_frames, s.positions()) * s.vocab,
      static_cast<size_t>(s.positions()) * s.vocab * 2, width, frames, cudaMemcpyDeviceToHost));
  return decode(bytes, DType::kFP16);
}

TEST(TransducerBig, MlperfPaddingPast2To31Elements) {
  const TransducerShape s = make_shape(192, 205, 71, 1024, 1023);
  ASSERT_GT(s.elements(), int64_t{1} << 31);
  const size_t bytes = static_cast<size_t>(s.elements()) * 2;
  size_t free_bytes = 0, total = 0;
  REPLAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (free_bytes < bytes + (1ull << 30)) GTEST_SKIP() << "needs 7 GB of free device memory";

  std::mt19937_64 rng(91);
  std::vector<int32_t> frames(s.batch), label_lengths(s.batch), labels(s.batch * s.max_labels);
  for (int64_t b = 0; b < s.batch; ++b) {
    const bool full = b == 0 || b == 142 || b == 191;
    frames[b] = full ? 205 : 1 + static_cast<int32_t>(rng() % 6);
    label_lengths[b] = full ? 71 : static_cast<int32_t>(rng() % 4);
    for (int64_t u = 0; u < s.max_labels; ++u)
      labels[b * s.max_labels + u] = static_cast<int32_t>(rng() % 1023);
  }
  frames[77] = 0;

  DeviceBuffer<unsigned char> logits_buffer(bytes), workspace(transducer_workspace_bytes(s));
  __half* logits = reinterpret_cast<__half*>(logits_buffer.get());
  DeviceBuffer<int32_t> d_labels(labels), d_frames(frames), d_label_lengths(label_lengths);
  DeviceBuffer<float> loss(s.batch), mean(1), scale(std::vector<float>{1.0f});
  init_normal(TensorView(logits, DType::kFP16, {s.elements()}), 92, 0, 0.0f, 2.0f, nullptr);
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());

  // Each utterance's inputs as the reference sees them, before the backward overwrites them.
  std::vector<std::vector<float>> inputs(s.batch);
  for (int64_t b = 0; b < s.batch; ++b)
    if (frames[b] > 0) inputs[b] = download_utterance(logits, s, b, frames[b], label_lengths[b]);

  TransducerInputs in;
  in.logits = logits;
  in.dtype = DType::kFP16;
  in.labels = d_labels.get();
  in.frame_lengths = d_frames.get();
  in.label_lengths = d_label_lengths.get();
  transducer_forward(loss.get(), mean.get(), in, s, workspace.get(), workspace.size(), nullptr);
  transducer_backward(logits, in, scale.get(), TransducerReduction::kSum, s, workspace.get(),
                      workspace.size(), nullptr);
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got_loss = loss.download();

  const Tolerances tol = tolerances(DType::kFP16);
  double worst_loss = 0.0, worst_grad = 0.0;
  for (int64_t b = 0; b < s.batch; ++b) {
    if (frames[b] == 0) {
      EXPECT_EQ(got_loss[b], 0.0f);
      continue;
    }
    // The utterance alone, as a batch of one at its own lengths.
    const TransducerShape one = make_shape(1, frames[b], label_lengths[b], 1024, 1023);
    const std::vector<double> z = test::to_double(inputs[b]);
    std::vector<double> ref_loss(1), ref_grad(one.elements());
    const int32_t f = frames[b], l = label_lengths[b];
    ref::transducer_loss(ref_loss.data(), ref_grad.data(), z.data(),
                         labels.data() + b * s.max_labels, &f, &l, one);
    EXPECT_NEAR(got_loss[b], ref_loss[0], tol.loss_atol + tol.loss_rtol * ref_loss[0])
        << "utterance " << b;
    worst_loss = std::max(worst_loss, std::fabs(got_loss[b] - ref_loss[0]) / ref_loss[0]);
    const std::vector<float> grad = download_utterance(logits, s, b, f, l);
    EXPECT_TRUE(test::all_close("grad of utterance " + std::to_string(b), grad, ref_grad,
                                {tol.grad_atol, tol.grad_rtol}));
    for (size_t i = 0; i < grad.size(); ++i)
      worst_grad = std::max(worst_grad, std::fabs(grad[i] - ref_grad[i]));
  }
  DeviceBuffer<unsigned long long> nonzero(std::vector<unsigned long long>{0});
  count_nonzero_past_lengths<<<8192, 256>>>(nonzero.get(), logits, d_frames.get(),
                                            d_label_lengths.get(), s.rows(), 205, 72, 1024);
  REPLAY_LAUNCH_CHECK();
  EXPECT_EQ(nonzero.download()[0], 0u) << "gradient elements past the lengths not zero";
  std::printf("  MLPerf padding: loss rel err %.2e, grad max abs err %.2e over 191 utterances\n",
              worst_loss, worst_grad);

  // Every utterance at the full lengths: the step the workload runs at this padding.
  d_frames.upload(std::vector<int32_t>(s.batch, 205));
  d_label_lengths.upload(std::vector<int32_t>(s.batch, 71));
  cudaEvent_t ev[3];
  for (auto& e : ev) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
  float fwd = 0.0f, bwd = 0.0f;
  for (int i = 0; i < 3; ++i) {
    init_normal(TensorView(logits, DType::kFP16, {s.elements()}), 93, 0, 0.0f, 2.0f, nullptr);
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[0], nullptr));
    transducer_forward(loss.get(), mean.get(), in, s, workspace.get(), workspace.size(), nullptr);
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[1], nullptr));
    transducer_backward(logits, in, scale.get(), TransducerReduction::kMean, s, workspace.get(),
                        workspace.size(), nullptr);
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[2], nullptr));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(ev[2]));
    fwd = elapsed_ms(ev[0], ev[1]);  // the last of three
    bwd = elapsed_ms(ev[1], ev[2]);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  const float m = mean.download()[0];
  EXPECT_TRUE(std::isfinite(m));
  std::printf(
      "  MLPerf padding, full lengths: forward %.2f ms, backward in place %.2f ms, mean "
      "loss %.3f\n",
      fwd, bwd, m);
}

// ---------------------------------------------------------------------------------------------------
// TransducerTorch: a case torch_rnnt_check.py wrote from torchaudio.functional.rnnt_loss (the
// path in REPLAY_RNNT_TORCH_CASE): int32 B, T, U, V, blank, dtype (0 fp32, 1 fp16); fp32 logits
// [B, T, U + 1, V] (already representable in dtype); int32 labels [B, U], frame lengths [B],
// label lengths [B]; torchaudio's fp32 losses [B] and gradient of their sum [B, T, U + 1, V].

template <typename T>
void read_into(std::ifstream& f, std::vector<T>& v, size_t n) {
  v.resize(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
}

TEST(TransducerTorch, MatchesTorchaudio) {
  const char* path = std::getenv("REPLAY_RNNT_TORCH_CASE");
  if (path == nullptr)
    GTEST_SKIP() << "REPLAY_RNNT_TORCH_CASE not set (torch_rnnt_check.py sets it)";
  std::ifstream f(path, std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  std::vector<int32_t> head;
  read_into(f, head, 6);
  Problem p;
  p.shape = make_shape(head[0], head[1], head[2], head[3], head[4]);
  p.dtype = head[5] == 1 ? DType::kFP16 : DType::kFP32;
  const TransducerShape& s = p.shape;
  std::vector<float> torch_loss, torch_grad;
  read_into(f, p.logits, s.elements());
  read_into(f, p.labels, s.batch * s.max_labels);
  read_into(f, p.frames, s.batch);
  read_into(f, p.label_lengths, s.batch);
  read_into(f, torch_loss, s.batch);
  read_into(f, torch_grad, s.elements());
  ASSERT_TRUE(f.good()) << "short file " << path;

  const Outputs o = run(p, 1.0f, TransducerReduction::kSum, false);
  // torchaudio computes in fp32 too: twice the tolerance against fp64, on the rows inside the
  // lengths (torchaudio leaves the padding's gradient to its own conventions).
  const Tolerances tol = tolerances(p.dtype);
  EXPECT_TRUE(test::all_close("loss vs torchaudio " + p.name(), o.loss, test::to_double(torch_loss),
                              {2 * tol.loss_atol, 2 * tol.loss_rtol}));
  std::vector<float> got;
  std::vector<double> want;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < p.frames[b]; ++t)
      for (int64_t u = 0; u <= p.label_lengths[b]; ++u) {
        const int64_t row = transducer_row(b, t, u, s.max_frames, s.positions()) * s.vocab;
        got.insert(got.end(), o.grad.begin() + row, o.grad.begin() + row + s.vocab);
        want.insert(want.end(), torch_grad.begin() + row, torch_grad.begin() + row + s.vocab);
      }
  EXPECT_TRUE(test::all_close("grad vs torchaudio " + p.name(), got, want,
                              {2 * tol.grad_atol, 2 * tol.grad_rtol}));
  double loss_err = 0.0, grad_err = 0.0;
  for (int64_t b = 0; b < s.batch; ++b)
    loss_err = std::max(loss_err, std::fabs(double{o.loss[b]} - torch_loss[b]) /
                                      std::max(1.0, std::fabs(double{torch_loss[b]})));
  for (size_t i = 0; i < got.size(); ++i)
    grad_err = std::max(grad_err, std::fabs(got[i] - want[i]));
  std::printf("  vs torchaudio, %s: loss rel err %.2e, grad max abs err %.2e\n", p.name().c_str(),
              loss_err, grad_err);
}

}  // namespace
}  // namespace replay::rnnt
