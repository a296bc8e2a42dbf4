// cuDNN's LSTM through LstmPlan against the fp64 reference (lstm_reference.h): fp32, fp16 and bf16,
// one and two layers, time-major and batch-major, ragged lengths, nonzero initial states and every
// output gradient; the weight layout cuDNN reports (PyTorch's names, gate order i, f, g, o) and
// MLPerf's initialisation; what cuDNN writes past each sample's length and what it reads there;
// bit-identical reruns; a CUDA graph of forward and both backwards replayed twice against eager
// runs; what a replay does when the lengths in device memory change, and the alternative the
// workload can rely on (every sample run to the rung's length, the gradient masked); a length of
// 0; cuDNN's dropout; the MLPerf encoder's and prediction network's LSTMs timed (not asserted).
// LstmTorch compares with torch.nn.LSTM where torch is importable (torch_lstm_check.py writes the
// cases; skipped otherwise).
//
// Tolerances, for cuDNN against fp64 on identical (already rounded) inputs, as the largest error
// over a tensor divided by the tensor's largest reference magnitude: fp32 (FMA math, no TF32)
// 2e-6 for outputs and gradients; fp16 2e-3 for y, hy, cy and 4e-3 for the gradients, bf16 eight
// times those (2^-8 against 2^-11): cuDNN rounds h_t to the storage type at every step (it is the
// next step's GEMM input), so each step adds a rounding of the storage type, and the weight
// gradients sum B x T such terms. Measured on an H100 (cuDNN 9.14), T up to 24: fp32 at most
// 4.6e-7, fp16 5.7e-4 for outputs and 1.2e-3 for gradients, bf16 3.1e-3 and 5.8e-3; the errors
// are printed per case.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/context.h"
#include "common/kernels/init.h"
#include "common/tensor.h"
#include "tests/support/compare.h"
#include "workloads/rnnt/lstm.h"
#include "workloads/rnnt/lstm_reference.h"

namespace replay::rnnt {
namespace {

using test::DeviceBuffer;
using Vec = std::vector<double>;
using Bytes = std::vector<unsigned char>;
using ref::LstmLayerWeights;

// One Context for the binary: the cuDNN handle's creation is the slow part of every test.
const Context& context() {
  static Context* ctx = new Context(0, 0);
  return *ctx;
}

// ---------------------------------------------------------------------------------------------------
// Host values in the storage type.

double round_to(DType t, double x) {
  if (t == DType::kFP16) return __half2float(__float2half_rn(static_cast<float>(x)));
  if (t == DType::kBF16) return __bfloat162float(__float2bfloat16_rn(static_cast<float>(x)));
  return static_cast<float>(x);
}

void put(unsigned char* dst, DType t, double v) {
  if (t == DType::kFP16) {
    const __half h = __float2half_rn(static_cast<float>(v));
    std::memcpy(dst, &h, 2);
  } else if (t == DType::kBF16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(static_cast<float>(v));
    std::memcpy(dst, &h, 2);
  } else {
    const float f = static_cast<float>(v);
    std::memcpy(dst, &f, 4);
  }
}

double get(const unsigned char* src, DType t) {
  if (t == DType::kFP16) {
    __half h;
    std::memcpy(&h, src, 2);
    return __half2float(h);
  }
  if (t == DType::kBF16) {
    __nv_bfloat16 h;
    std::memcpy(&h, src, 2);
    return __bfloat162float(h);
  }
  float f;
  std::memcpy(&f, src, 4);
  return f;
}

Bytes encode(const Vec& v, DType t) {
  Bytes out(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) put(out.data() + i * dtype_size(t), t, v[i]);
  return out;
}

Vec decode(const Bytes& b, DType t) {
  Vec out(b.size() / dtype_size(t));
  for (size_t i = 0; i < out.size(); ++i) out[i] = get(b.data() + i * dtype_size(t), t);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// A problem: the desc, the lengths and every input on the host in the reference's layouts (x, dy
// [B, T, X], states [L, B, H]), already rounded to the storage type.

enum class Pad { kZero, kJunk, kNaN };  // what x and dy hold past each sample's length

struct Problem {
  LstmDesc desc;
  int64_t T = 0;  // the padded length of this call (set_lengths' max_seq)
  std::vector<int32_t> lengths;
  ref::LstmShape shape;
  std::vector<LstmLayerWeights> w;
  Vec x, h0, c0, dy, dhn, dcn;
  bool states = true;  // hx, cx, dhy, dcy given (otherwise null: zeros)

  std::string name() const {
    std::string lens;
    for (int32_t n : lengths) lens += (lens.empty() ? "" : ",") + std::to_string(n);
    return desc.describe() + " T'=" + std::to_string(T) + " lengths {" + lens + "}";
  }
  bool inside(int64_t b, int64_t t) const { return t < lengths[b]; }
};

Problem make_problem(const LstmDesc& d, std::vector<int32_t> lengths, uint64_t seed, int64_t T = 0,
                     Pad pad = Pad::kZero) {
  Problem p;
  p.desc = d;
  p.T = T == 0 ? d.max_seq : T;
  p.lengths = std::move(lengths);
  p.shape.input = d.input_size;
  p.shape.hidden = d.hidden_size;
  p.shape.layers = d.layers;
  p.shape.batch = d.batch;
  p.shape.max_seq = p.T;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double k = 1.5 / std::sqrt(static_cast<double>(d.hidden_size));
  std::uniform_real_distribution<double> uw(-k, k), ub(-0.5, 0.5);
  auto fill = [&](Vec& v, size_t n, std::function<double()> draw) {
    v.resize(n);
    for (double& e : v) e = round_to(d.dtype, draw());
  };
  p.w = ref::lstm_zero_weights(p.shape);
  for (LstmLayerWeights& l : p.w) {
    fill(l.w_ih, l.w_ih.size(), [&] { return uw(rng); });
    fill(l.w_hh, l.w_hh.size(), [&] { return uw(rng); });
    fill(l.b_ih, l.b_ih.size(), [&] { return ub(rng); });
    fill(l.b_hh, l.b_hh.size(), [&] { return ub(rng); });
  }
  const int64_t B = d.batch, I = d.input_size, H = d.hidden_size, L = d.layers;
  fill(p.x, B * p.T * I, [&] { return normal(rng); });
  fill(p.dy, B * p.T * H, [&] { return normal(rng); });
  fill(p.h0, L * B * H, [&] { return 0.5 * normal(rng); });
  fill(p.c0, L * B * H, [&] { return 0.5 * normal(rng); });
  fill(p.dhn, L * B * H, [&] { return normal(rng); });
  fill(p.dcn, L * B * H, [&] { return normal(rng); });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = p.lengths[b]; t < p.T; ++t) {
      auto pad_value = [&] {
        if (pad == Pad::kZero) return 0.0;
        if (pad == Pad::kNaN) return std::numeric_limits<double>::quiet_NaN();
        return round_to(d.dtype, 3.0 * normal(rng));
      };
      for (int64_t i = 0; i < I; ++i) p.x[(b * p.T + t) * I + i] = pad_value();
      for (int64_t i = 0; i < H; ++i) p.dy[(b * p.T + t) * H + i] = pad_value();
    }
  return p;
}

// Ragged lengths in [1, T] with sample 0 at T.
std::vector<int32_t> ragged(int64_t B, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out(B);
  for (int64_t b = 0; b < B; ++b) out[b] = b == 0 ? T : 1 + static_cast<int32_t>(rng() % T);
  return out;
}

// [B, T, X] (the reference's) to and from the device layout of the call.
size_t device_index(const LstmDesc& d, int64_t T, int64_t b, int64_t t, int64_t k, int64_t X) {
  if (d.layout == LstmLayout::kSeqMajor) return static_cast<size_t>((t * d.batch + b) * X + k);
  return static_cast<size_t>((b * T + t) * X + k);
}

Vec to_device_layout(const Vec& v, const LstmDesc& d, int64_t T, int64_t X) {
  Vec out(v.size());
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < X; ++k) out[device_index(d, T, b, t, k, X)] = v[(b * T + t) * X + k];
  return out;
}

Vec from_device_layout(const Vec& v, const LstmDesc& d, int64_t T, int64_t X) {
  Vec out(static_cast<size_t>(d.batch * T * X));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < X; ++k) out[(b * T + t) * X + k] = v[device_index(d, T, b, t, k, X)];
  return out;
}

// The weights into a weight space of the plan's layout (zeros between the tensors), and back.
Bytes pack_weights(const LstmPlan& plan, const std::vector<LstmLayerWeights>& w) {
  const LstmWeightLayout& lay = plan.weights();
  Bytes out(plan.weight_bytes(), 0);
  const size_t es = dtype_size(lay.dtype);
  for (const LstmWeightTensor& t : lay.tensors) {
    const LstmLayerWeights& l = w[t.layer];
    const Vec& v = t.param == LstmParam::kWeightIH   ? l.w_ih
                   : t.param == LstmParam::kWeightHH ? l.w_hh
                   : t.param == LstmParam::kBiasIH   ? l.b_ih
                                                     : l.b_hh;
    EXPECT_EQ(static_cast<int64_t>(v.size()), t.elements()) << t.name;
    for (int64_t i = 0; i < t.elements(); ++i)
      put(out.data() + (t.offset + i) * es, lay.dtype, v[i]);
  }
  return out;
}

std::vector<LstmLayerWeights> unpack_weights(const LstmPlan& plan, const ref::LstmShape& s,
                                             const Bytes& space) {
  const LstmWeightLayout& lay = plan.weights();
  std::vector<LstmLayerWeights> w = ref::lstm_zero_weights(s);
  const size_t es = dtype_size(lay.dtype);
  for (const LstmWeightTensor& t : lay.tensors) {
    LstmLayerWeights& l = w[t.layer];
    Vec& v = t.param == LstmParam::kWeightIH   ? l.w_ih
             : t.param == LstmParam::kWeightHH ? l.w_hh
             : t.param == LstmParam::kBiasIH   ? l.b_ih
                                               : l.b_hh;
    for (int64_t i = 0; i < t.elements(); ++i)
      v[i] = get(space.data() + (t.offset + i) * es, lay.dtype);
  }
  return w;
}

// ---------------------------------------------------------------------------------------------------
// The device side of one plan: buffers sized for the desc's largest shape, the calls.

struct Outputs {
  Bytes y, hy, cy, dx, dhx, dcx, dw;  // raw, device layouts
};

struct Device {
  const LstmPlan& plan;
  const LstmDesc& d;
  size_t es;
  DeviceBuffer<unsigned char> x, y, hx, cx, hy, cy, dy, dhy, dcy, dx, dhx, dcx, w, dw, ws, rs;
  DeviceBuffer<int32_t> lengths;

  explicit Device(const LstmPlan& p)
      : plan(p),
        d(p.desc()),
        es(dtype_size(p.desc().dtype)),
        x(d.x_elements() * es),
        y(d.y_elements() * es),
        hx(d.state_elements() * es),
        cx(d.state_elements() * es),
        hy(d.state_elements() * es),
        cy(d.state_elements() * es),
        dy(d.y_elements() * es),
        dhy(d.state_elements() * es),
        dcy(d.state_elements() * es),
        dx(d.x_elements() * es),
        dhx(d.state_elements() * es),
        dcx(d.state_elements() * es),
        w(p.weight_bytes()),
        dw(p.weight_bytes()),
        ws(std::max<size_t>(p.workspace_bytes(), 16)),
        rs(std::max<size_t>(p.reserve_bytes(), 16)),
        lengths(static_cast<size_t>(p.desc().batch)) {}

  // Inputs of p (whose T the plan's set_lengths must already have), weights included.
  void upload(const Problem& p) {
    x.upload(encode(to_device_layout(p.x, d, p.T, d.input_size), d.dtype));
    dy.upload(encode(to_device_layout(p.dy, d, p.T, d.hidden_size), d.dtype));
    hx.upload(encode(p.h0, d.dtype));
    cx.upload(encode(p.c0, d.dtype));
    dhy.upload(encode(p.dhn, d.dtype));
    dcy.upload(encode(p.dcn, d.dtype));
    w.upload(pack_weights(plan, p.w));
    lengths.upload(p.lengths);
  }

  // Every output back to 0xFF bytes (NaN), so that a run must write what is compared.
  void poison(cudaStream_t s) {
    for (auto* b : {&y, &hy, &cy, &dx, &dhx, &dcx, &dw})
      REPLAY_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xFF, b->size(), s));
  }

  void forward(cudaStream_t s, LstmMode mode, bool states = true) {
    LstmForwardArgs a;
    a.lengths = lengths.get();
    a.x = x.get();
    a.weights = w.get();
    a.y = y.get();
    if (states) {
      a.hx = hx.get();
      a.cx = cx.get();
      a.hy = hy.get();
      a.cy = cy.get();
    }
    plan.forward(context(), s, mode, a, ws.get(), ws.size(), rs.get(), rs.size());
  }

  void backward(cudaStream_t s, bool states = true, bool zero = true) {
    LstmBackwardDataArgs bd;
    bd.lengths = lengths.get();
    bd.y = y.get();
    bd.dy = dy.get();
    bd.weights = w.get();
    bd.dx = dx.get();
    if (states) {
      bd.dhy = dhy.get();
      bd.dcy = dcy.get();
      bd.hx = hx.get();
      bd.cx = cx.get();
      bd.dhx = dhx.get();
      bd.dcx = dcx.get();
    }
    plan.backward_data(context(), s, bd, ws.get(), ws.size(), rs.get(), rs.size());
    if (zero) plan.zero_weight_grad(dw.get(), s);
    LstmBackwardWeightsArgs bw;
    bw.lengths = lengths.get();
    bw.x = x.get();
    bw.hx = states ? hx.get() : nullptr;
    bw.y = y.get();
    bw.dweights = dw.get();
    plan.backward_weights(context(), s, bw, ws.get(), ws.size(), rs.get(), rs.size());
  }

  // Forward (training) and both backwards, eagerly, on the context's stream.
  Outputs run(bool states = true) {
    const cudaStream_t s = context().stream();
    poison(s);
    forward(s, LstmMode::kTraining, states);
    backward(s, states);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    return download();
  }

  Outputs download() const {
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    return {y.download(),   hy.download(),  cy.download(), dx.download(),
            dhx.download(), dcx.download(), dw.download()};
  }
};

// ---------------------------------------------------------------------------------------------------
// Comparison with the reference.

struct Reference {
  Vec y, hn, cn, dx, dh0, dc0;
  std::vector<LstmLayerWeights> dw;
};

Reference reference(const Problem& p, bool states = true) {
  const ref::LstmShape& s = p.shape;
  Reference r;
  r.y.resize(s.batch * s.max_seq * s.hidden);
  r.hn.resize(s.layers * s.batch * s.hidden);
  r.cn.resize(r.hn.size());
  r.dx.resize(s.batch * s.max_seq * s.input);
  r.dh0.resize(r.hn.size());
  r.dc0.resize(r.hn.size());
  r.dw = ref::lstm_zero_weights(s);
  const double* h0 = states ? p.h0.data() : nullptr;
  const double* c0 = states ? p.c0.data() : nullptr;
  ref::lstm_forward(s, p.w, p.x.data(), p.lengths.data(), h0, c0, r.y.data(), r.hn.data(),
                    r.cn.data());
  ref::lstm_backward(s, p.w, p.x.data(), p.lengths.data(), h0, c0, p.dy.data(),
                     states ? p.dhn.data() : nullptr, states ? p.dcn.data() : nullptr, r.dx.data(),
                     r.dh0.data(), r.dc0.data(), &r.dw);
  return r;
}

// max |got - want| / max |want| over the elements `use` selects (all when null); infinity when a
// selected got is not finite.
double rel_err(const Vec& got, const Vec& want, const std::function<bool(size_t)>& use = nullptr) {
  double worst = 0.0, scale = 1e-12;
  for (size_t i = 0; i < want.size(); ++i) {
    if (use && !use(i)) continue;
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return worst / scale;
}

struct Tol {
  double out, grad;
};

Tol tolerance(DType t) {
  switch (t) {
    case DType::kFP32:
      return {2e-6, 2e-6};
    case DType::kFP16:
      return {2e-3, 4e-3};
    default:
      return {1.6e-2, 3.2e-2};
  }
}

// Compares one run with the reference; prints the errors; returns the worst gradient error.
struct Errors {
  double y = 0, hy = 0, cy = 0, dx = 0, dhx = 0, dcx = 0, dw = 0;
  std::string dw_worst;
};

Errors compare(const Problem& p, const LstmPlan& plan, const Outputs& o, const Reference& r,
               bool states = true) {
  const LstmDesc& d = p.desc;
  const int64_t I = d.input_size, H = d.hidden_size, T = p.T;
  const Vec y = from_device_layout(decode(o.y, d.dtype), d, T, H);
  const Vec dx = from_device_layout(decode(o.dx, d.dtype), d, T, I);
  auto y_inside = [&](size_t i) { return p.inside(i / (T * H), (i / H) % T); };
  auto x_inside = [&](size_t i) { return p.inside(i / (T * I), (i / I) % T); };
  Errors e;
  e.y = rel_err(y, r.y, y_inside);
  e.dx = rel_err(dx, r.dx, x_inside);
  if (states) {
    e.hy = rel_err(decode(o.hy, d.dtype), r.hn);
    e.cy = rel_err(decode(o.cy, d.dtype), r.cn);
    e.dhx = rel_err(decode(o.dhx, d.dtype), r.dh0);
    e.dcx = rel_err(decode(o.dcx, d.dtype), r.dc0);
  }
  const std::vector<LstmLayerWeights> dw = unpack_weights(plan, p.shape, o.dw);
  for (const LstmWeightTensor& t : plan.weights().tensors) {
    const LstmLayerWeights &g = dw[t.layer], &w = r.dw[t.layer];
    double err = 0;
    switch (t.param) {
      case LstmParam::kWeightIH:
        err = rel_err(g.w_ih, w.w_ih);
        break;
      case LstmParam::kWeightHH:
        err = rel_err(g.w_hh, w.w_hh);
        break;
      case LstmParam::kBiasIH:
        err = rel_err(g.b_ih, w.b_ih);
        break;
      case LstmParam::kBiasHH:
        err = rel_err(g.b_hh, w.b_hh);
        break;
    }
    if (err >= e.dw) {
      e.dw = err;
      e.dw_worst = t.name;
    }
  }
  std::printf("  %s\n    y %.1e hy %.1e cy %.1e | dx %.1e dhx %.1e dcx %.1e dW %.1e (%s)  [%s]\n",
              p.name().c_str(), e.y, e.hy, e.cy, e.dx, e.dhx, e.dcx, e.dw, e.dw_worst.c_str(),
              plan.math());
  const Tol tol = tolerance(d.dtype);
  EXPECT_LE(e.y, tol.out) << "y, " << p.name();
  EXPECT_LE(e.hy, tol.out) << "hy, " << p.name();
  EXPECT_LE(e.cy, tol.out) << "cy, " << p.name();
  EXPECT_LE(e.dx, tol.grad) << "dx, " << p.name();
  EXPECT_LE(e.dhx, tol.grad) << "dhx, " << p.name();
  EXPECT_LE(e.dcx, tol.grad) << "dcx, " << p.name();
  EXPECT_LE(e.dw, tol.grad) << "dW (" << e.dw_worst << "), " << p.name();
  return e;
}

// What a buffer holds past the lengths, counted: the fill, zero, the 0xFF poison, other.
std::string padding_census(const Problem& p, const Bytes& raw, int64_t X, double fill) {
  const LstmDesc& d = p.desc;
  const size_t es = dtype_size(d.dtype);
  size_t n_fill = 0, n_zero = 0, n_poison = 0, n_other = 0;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = p.lengths[b]; t < p.T; ++t)
      for (int64_t k = 0; k < X; ++k) {
        const unsigned char* e = raw.data() + device_index(d, p.T, b, t, k, X) * es;
        bool poison = true;
        for (size_t i = 0; i < es; ++i) poison = poison && e[i] == 0xFF;
        const double v = get(e, d.dtype);
        if (poison)
          ++n_poison;
        else if (v == fill)
          ++n_fill;
        else if (v == 0.0)
          ++n_zero;
        else
          ++n_other;
      }
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%zu fill, %zu zero, %zu untouched (poison), %zu other", n_fill,
                n_zero, n_poison, n_other);
  return buf;
}

bool same(const Bytes& a, const Bytes& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

// Every output bitwise equal; names the first that differs.
::testing::AssertionResult same_outputs(const Outputs& a, const Outputs& b) {
  const std::pair<const char*, std::pair<const Bytes*, const Bytes*>> all[] = {
      {"y", {&a.y, &b.y}},    {"hy", {&a.hy, &b.hy}},    {"cy", {&a.cy, &b.cy}},
      {"dx", {&a.dx, &b.dx}}, {"dhx", {&a.dhx, &b.dhx}}, {"dcx", {&a.dcx, &b.dcx}},
      {"dW", {&a.dw, &b.dw}}};
  for (const auto& e : all)
    if (!same(*e.second.first, *e.second.second))
      return ::testing::AssertionFailure() << e.first << " differs";
  return ::testing::AssertionSuccess();
}

LstmDesc make_desc(int64_t I, int64_t H, int64_t L, int64_t B, int64_t T, DType t,
                   LstmLayout layout = LstmLayout::kSeqMajor, float fill = 0.0f) {
  LstmDesc d;
  d.input_size = I;
  d.hidden_size = H;
  d.layers = L;
  d.batch = B;
  d.max_seq = T;
  d.dtype = t;
  d.layout = layout;
  d.padding_fill = fill;
  return d;
}

// ---------------------------------------------------------------------------------------------------
// The plan: sizes, the weight layout.

TEST(LstmPlan, SizesAndWeightLayout) {
  const LstmDesc descs[] = {
      make_desc(8, 16, 1, 4, 9, DType::kFP32),
      make_desc(32, 64, 2, 6, 12, DType::kFP16, LstmLayout::kBatchMajor),
      make_desc(240, 1024, 2, 192, 410, DType::kFP16),   // MLPerf encoder, before the stacking
      make_desc(2048, 1024, 3, 192, 205, DType::kFP16),  // after it
      make_desc(512, 512, 2, 192, 72, DType::kFP16),     // prediction network
  };
  for (const LstmDesc& d : descs) {
    LstmPlan plan(context(), d);
    const LstmWeightLayout& lay = plan.weights();
    std::printf(
        "  %s [%s]: weights %zu B, workspace %zu (training) / %zu (inference), reserve %zu\n",
        d.describe().c_str(), plan.math(), plan.weight_bytes(), plan.training_workspace_bytes(),
        plan.inference_workspace_bytes(), plan.reserve_bytes());
    ASSERT_EQ(lay.tensors.size(), static_cast<size_t>(4 * d.layers));
    int64_t elements = 0;
    std::string offsets;
    for (size_t k = 0; k < lay.tensors.size(); ++k) {
      const LstmWeightTensor& t = lay.tensors[k];
      const int64_t l = static_cast<int64_t>(k / 4);
      const char* names[] = {"weight_ih_l", "weight_hh_l", "bias_ih_l", "bias_hh_l"};
      EXPECT_EQ(t.name, names[k % 4] + std::to_string(l));
      EXPECT_EQ(t.layer, l);
      EXPECT_EQ(t.rows, 4 * d.hidden_size);
      EXPECT_EQ(t.cols, k % 4 == 0 ? d.layer_input(l) : (k % 4 == 1 ? d.hidden_size : 1));
      elements += t.elements();
      if (l == 0) offsets += " " + t.name + "@" + std::to_string(t.offset);
    }
    std::printf("    layer 0 at elements:%s; %lld of %zu elements named; layout %s\n",
                offsets.c_str(), static_cast<long long>(elements),
                plan.weight_bytes() / dtype_size(d.dtype), plan.layout_note().c_str());
    EXPECT_LE(static_cast<size_t>(elements) * dtype_size(d.dtype), plan.weight_bytes());
    // The layout read against the stand-in address is the real buffer's.
    DeviceBuffer<unsigned char> space(plan.weight_bytes());
    EXPECT_NO_THROW(plan.check_weight_layout(context(), space.get()));
  }
}

// MLPerf's initialisation: the ranges, the forget blocks, reproducible for a seed.
TEST(LstmPlan, MlperfInit) {
  const LstmDesc d = make_desc(32, 64, 2, 4, 8, DType::kFP16);
  LstmPlan plan(context(), d);
  DeviceBuffer<unsigned char> a(plan.weight_bytes()), b(plan.weight_bytes()),
      c(plan.weight_bytes());
  const cudaStream_t s = context().stream();
  lstm_init_weights(plan.weights(), a.get(), 7, 100, LstmInit{}, s);
  lstm_init_weights(plan.weights(), b.get(), 7, 100, LstmInit{}, s);
  lstm_init_weights(plan.weights(), c.get(), 8, 100, LstmInit{}, s);
  const Bytes ha = a.download(), hb = b.download(), hc = c.download();
  EXPECT_TRUE(same(ha, hb)) << "same seed, different weights";
  EXPECT_FALSE(same(ha, hc)) << "another seed, the same weights";
  const double bound = 0.5 / std::sqrt(64.0);
  const std::vector<LstmLayerWeights> w = unpack_weights(
      plan,
      [&] {
        ref::LstmShape sh;
        sh.input = 32;
        sh.hidden = 64;
        sh.layers = 2;
        return sh;
      }(),
      ha);
  for (const LstmLayerWeights& l : w) {
    for (const Vec* v : {&l.w_ih, &l.w_hh}) {
      double lo = 1, hi = -1;
      for (double e : *v) {
        lo = std::min(lo, e);
        hi = std::max(hi, e);
      }
      EXPECT_GE(lo, -bound * 1.001);
      EXPECT_LE(hi, bound * 1.001);
      EXPECT_LT(lo, -0.8 * bound);  // the whole range is drawn
      EXPECT_GT(hi, 0.8 * bound);
    }
    for (int64_t j = 0; j < 4 * 64; ++j) {
      const bool forget = j >= 64 && j < 128;
      if (forget) {
        EXPECT_EQ(l.b_ih[j], 0.5) << j;
        EXPECT_EQ(l.b_hh[j], 0.0) << j;
      } else {
        EXPECT_LE(std::fabs(l.b_ih[j]), bound * 1.001) << j;
        EXPECT_LE(std::fabs(l.b_hh[j]), bound * 1.001) << j;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Numerics against the reference.

struct RefCase {
  LstmDesc desc;
  int64_t T;  // set_lengths' max_seq, 0 for the desc's
  uint64_t seed;
};

TEST(LstmGpu, MatchesReference) {
  using L = LstmLayout;
  const RefCase cases[] = {
      {make_desc(8, 16, 1, 5, 9, DType::kFP32), 0, 1},
      {make_desc(12, 24, 2, 6, 11, DType::kFP32, L::kBatchMajor, -2.5f), 0, 2},
      {make_desc(12, 24, 2, 6, 16, DType::kFP32, L::kBatchMajor), 10, 3},  // a shorter rung
      {make_desc(32, 64, 1, 7, 16, DType::kFP16), 0, 4},
      {make_desc(40, 64, 2, 8, 20, DType::kFP16, L::kBatchMajor, -2.5f), 0, 5},
      {make_desc(240, 128, 2, 16, 24, DType::kFP16), 0, 6},
      {make_desc(32, 64, 2, 6, 12, DType::kBF16), 0, 7},
  };
  for (const RefCase& c : cases) {
    LstmPlan plan(context(), c.desc);
    const int64_t T = c.T == 0 ? c.desc.max_seq : c.T;
    Problem p = make_problem(c.desc, ragged(c.desc.batch, T, c.seed), c.seed, T);
    plan.set_lengths(p.lengths.data(), T);
    Device dev(plan);
    dev.upload(p);
    const Outputs o = dev.run();
    const Reference r = reference(p);
    compare(p, plan, o, r);
    // y past the lengths is the fill; dx there is whatever cuDNN leaves (reported).
    const std::string y_pad = padding_census(p, o.y, c.desc.hidden_size, c.desc.padding_fill);
    const std::string dx_pad = padding_census(p, o.dx, c.desc.input_size, c.desc.padding_fill);
    std::printf("    past the lengths: y %s; dx %s\n", y_pad.c_str(), dx_pad.c_str());
    EXPECT_NE(y_pad.find(" 0 zero, 0 untouched (poison), 0 other"), std::string::npos)
        << "y past the lengths: " << y_pad;
  }
}

// hx, cx null (zeros), hy, cy, dhx, dcx not written, dhy, dcy null (zeros); and the inference
// forward against the training one.
TEST(LstmGpu, NullStatesAndInference) {
  const LstmDesc d = make_desc(16, 32, 2, 5, 10, DType::kFP32);
  LstmPlan plan(context(), d);
  Problem p = make_problem(d, ragged(d.batch, d.max_seq, 9), 9);
  plan.set_lengths(p.lengths.data());
  Device dev(plan);
  dev.upload(p);
  const Outputs o = dev.run(false);
  compare(p, plan, o, reference(p, false), false);
  // Not written: still the poison.
  for (const Bytes* b : {&o.hy, &o.cy, &o.dhx, &o.dcx})
    EXPECT_TRUE(std::all_of(b->begin(), b->end(), [](unsigned char v) { return v == 0xFF; }));

  const cudaStream_t s = context().stream();
  dev.poison(s);
  dev.forward(s, LstmMode::kInference, false);
  const Bytes y_inf = dev.y.download();
  std::printf("  inference y %s the training forward's\n",
              same(y_inf, o.y) ? "is bitwise" : "differs from");
  const int64_t H = d.hidden_size, T = d.max_seq;
  EXPECT_LE(rel_err(from_device_layout(decode(y_inf, d.dtype), d, T, H),
                    from_device_layout(decode(o.y, d.dtype), d, T, H),
                    [&](size_t i) { return p.inside(i / (T * H), (i / H) % T); }),
            2e-6);
}

// The weight gradient adds (CUDNN_WGRAD_MODE_ADD): a second backward_weights without zeroing
// doubles it.
TEST(LstmGpu, WeightGradientAccumulates) {
  const LstmDesc d = make_desc(16, 32, 2, 5, 10, DType::kFP32);
  LstmPlan plan(context(), d);
  Problem p = make_problem(d, ragged(d.batch, d.max_seq, 10), 10);
  plan.set_lengths(p.lengths.data());
  Device dev(plan);
  dev.upload(p);
  const Outputs once = dev.run();
  LstmBackwardWeightsArgs bw;
  bw.lengths = dev.lengths.get();
  bw.x = dev.x.get();
  bw.hx = dev.hx.get();
  bw.y = dev.y.get();
  bw.dweights = dev.dw.get();
  plan.backward_weights(context(), context().stream(), bw, dev.ws.get(), dev.ws.size(),
                        dev.rs.get(), dev.rs.size());
  const Vec one = decode(once.dw, d.dtype), two = decode(dev.dw.download(), d.dtype);
  Vec doubled(one.size());
  size_t exact = 0, named = 0;
  for (const LstmWeightTensor& t : plan.weights().tensors)
    for (int64_t i = t.offset; i < t.offset + t.elements(); ++i) {
      ++named;
      exact += two[i] == 2 * one[i];
    }
  for (size_t i = 0; i < one.size(); ++i) doubled[i] = 2 * one[i];
  const double err = rel_err(two, doubled);
  std::printf(
      "  second backward_weights: %zu of %zu named elements exactly doubled, rel err %.1e\n", exact,
      named, err);
  EXPECT_LE(err, 1e-6);
}

// ---------------------------------------------------------------------------------------------------
// Padding: what x and dy may hold past the lengths.

TEST(LstmGpu, PaddingContent) {
  for (DType t : {DType::kFP32, DType::kFP16}) {
    const LstmDesc d = make_desc(24, 32, 2, 6, 12, t);
    LstmPlan plan(context(), d);
    const std::vector<int32_t> lens = ragged(d.batch, d.max_seq, 12);
    plan.set_lengths(lens.data());
    Outputs out[3];
    const Pad pads[3] = {Pad::kZero, Pad::kJunk, Pad::kNaN};
    for (int k = 0; k < 3; ++k) {
      Problem p = make_problem(d, lens, 12, 0, pads[k]);
      Device dev(plan);
      dev.upload(p);
      out[k] = dev.run();
    }
    // Valid region of y and dx, and every state and weight gradient.
    auto finite = [&](const Bytes& raw) {
      const Vec v = decode(raw, t);
      return std::all_of(v.begin(), v.end(), [](double e) { return std::isfinite(e); });
    };
    auto valid_equal = [&](const Outputs& a, const Outputs& b, std::string* what) {
      const size_t es = dtype_size(t);
      for (int64_t bb = 0; bb < d.batch; ++bb)
        for (int64_t tt = 0; tt < lens[bb]; ++tt) {
          if (std::memcmp(a.y.data() + device_index(d, d.max_seq, bb, tt, 0, d.hidden_size) * es,
                          b.y.data() + device_index(d, d.max_seq, bb, tt, 0, d.hidden_size) * es,
                          d.hidden_size * es) != 0) {
            *what = "y";
            return false;
          }
          if (std::memcmp(a.dx.data() + device_index(d, d.max_seq, bb, tt, 0, d.input_size) * es,
                          b.dx.data() + device_index(d, d.max_seq, bb, tt, 0, d.input_size) * es,
                          d.input_size * es) != 0) {
            *what = "dx";
            return false;
          }
        }
      for (auto m : {&Outputs::hy, &Outputs::cy, &Outputs::dhx, &Outputs::dcx, &Outputs::dw})
        if (!same(a.*m, b.*m)) {
          *what = m == &Outputs::dw ? "dW" : "a state or state gradient";
          return false;
        }
      return true;
    };
    std::string what;
    const bool junk_ok = valid_equal(out[0], out[1], &what);
    std::printf("  %s: finite junk in x and dy past the lengths: %s%s\n", dtype_name(t),
                junk_ok ? "results bitwise as with zeros" : "results differ: ",
                junk_ok ? "" : what.c_str());
    EXPECT_TRUE(junk_ok) << what;
    const bool nan_ok = valid_equal(out[0], out[2], &what);
    std::printf("  %s: NaN in x and dy past the lengths: %s%s (y %s, dx %s, dW %s, dhx %s)\n",
                dtype_name(t), nan_ok ? "results bitwise as with zeros" : "results differ: ",
                nan_ok ? "" : what.c_str(), finite(out[2].y) ? "finite" : "has NaN",
                finite(out[2].dx) ? "finite" : "has NaN", finite(out[2].dw) ? "finite" : "has NaN",
                finite(out[2].dhx) ? "finite" : "has NaN");
  }
}

// ---------------------------------------------------------------------------------------------------
// Determinism: forward and both backwards, three times, bit for bit.

TEST(LstmGpu, BitwiseReproducible) {
  const LstmDesc d = make_desc(240, 512, 2, 64, 60, DType::kFP16);
  LstmPlan plan(context(), d);
  Problem p = make_problem(d, ragged(d.batch, d.max_seq, 13), 13);
  plan.set_lengths(p.lengths.data());
  Device dev(plan);
  dev.upload(p);
  const Outputs first = dev.run();
  for (int k = 0; k < 2; ++k) {
    const Outputs again = dev.run();
    EXPECT_TRUE(same_outputs(first, again)) << "run " << k + 2 << " of " << d.describe();
  }
  std::printf("  %s: 3 runs of forward, backward data and backward weights compared bitwise\n",
              d.describe().c_str());
}

// ---------------------------------------------------------------------------------------------------
// Graphs.

// Captures work on the stream in the strictest capture mode cuDNN allows, trying global, then
// thread-local, then relaxed; returns the executable, or null with the reasons in *why.
cudaGraphExec_t capture(cudaStream_t s, const std::function<void()>& work, std::string* mode,
                        std::string* why) {
  const std::pair<cudaStreamCaptureMode, const char*> modes[] = {
      {cudaStreamCaptureModeGlobal, "global"},
      {cudaStreamCaptureModeThreadLocal, "thread-local"},
      {cudaStreamCaptureModeRelaxed, "relaxed"}};
  for (const auto& m : modes) {
    REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, m.first));
    std::string failure;
    try {
      work();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    if (failure.empty() && end != cudaSuccess) failure = cudaGetErrorString(end);
    cudaGraphExec_t exec = nullptr;
    if (failure.empty()) {
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      if (inst != cudaSuccess) failure = std::string("instantiate: ") + cudaGetErrorString(inst);
    }
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    if (failure.empty()) {
      *mode = m.second;
      return exec;
    }
    *why += std::string(m.second) + ": " + failure + "; ";
  }
  return nullptr;
}

Outputs replay(Device& dev, cudaGraphExec_t exec) {
  const cudaStream_t s = context().stream();
  dev.poison(s);
  REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  return dev.download();
}

// Forward (training), backward data, the weight gradient's zeroing and backward weights captured
// after the plan is built; two replays against an eager run.
TEST(LstmGpu, GraphReplayMatchesEager) {
  for (DType t : {DType::kFP16, DType::kFP32}) {
    const LstmDesc d = make_desc(32, 64, 2, 8, 20, t);
    LstmPlan plan(context(), d);
    Problem p = make_problem(d, ragged(d.batch, d.max_seq, 14), 14);
    plan.set_lengths(p.lengths.data());
    Device dev(plan);
    dev.upload(p);
    const Outputs eager = dev.run();
    const cudaStream_t s = context().stream();
    std::string mode, why;
    cudaGraphExec_t exec = capture(
        s,
        [&] {
          dev.forward(s, LstmMode::kTraining);
          dev.backward(s);
        },
        &mode, &why);
    ASSERT_NE(exec, nullptr) << "cuDNN's LSTM calls could not be captured: " << why;
    std::printf("  %s: captured in %s mode%s%s\n", dtype_name(t), mode.c_str(),
                why.empty() ? "" : " (failed before: ", why.empty() ? "" : (why + ")").c_str());
    const Outputs r1 = replay(dev, exec), r2 = replay(dev, exec);
    EXPECT_TRUE(same_outputs(eager, r1)) << "replay 1, " << d.describe();
    EXPECT_TRUE(same_outputs(eager, r2)) << "replay 2, " << d.describe();
    cudaGraphExecDestroy(exec);
  }
}

// The lengths under replay. A graph captured with lengths A (host descriptor and device array);
// then only the device array changes to B. A replay gives A's results bitwise: the host lengths
// of the capture rule, and the device array is not what cuDNN goes by (an eager call with the
// descriptor at A and the device array at B gives A's results too).
TEST(LstmGpu, LengthsUnderReplay) {
  for (const LstmDesc& d : {make_desc(16, 32, 2, 6, 12, DType::kFP32),
                            make_desc(16, 32, 2, 6, 12, DType::kFP16, LstmLayout::kBatchMajor)}) {
    LstmPlan plan(context(), d);
    const std::vector<int32_t> A = {12, 5, 9, 1, 12, 7}, B = {3, 12, 6, 12, 2, 10};
    // The same inputs for both (the full random tensors, padding included; the seed's draws do not
    // depend on the lengths).
    const Problem full = make_problem(d, std::vector<int32_t>(d.batch, 12), 15);
    Problem pa = full, pb = full;
    pa.lengths = A;
    pb.lengths = B;
    Device dev(plan);
    dev.upload(pa);

    plan.set_lengths(A.data());
    const Outputs eager_a = dev.run();
    dev.lengths.upload(B);
    const Outputs eager_host_a_dev_b = dev.run();  // descriptor A, device array B
    plan.set_lengths(B.data());
    const Outputs eager_b = dev.run();
    compare(pb, plan, eager_b, reference(pb));

    // Capture with A (descriptor and device array), replay, change the device array to B, replay.
    plan.set_lengths(A.data());
    dev.lengths.upload(A);
    const cudaStream_t s = context().stream();
    std::string mode, why;
    cudaGraphExec_t exec = capture(
        s,
        [&] {
          dev.forward(s, LstmMode::kTraining);
          dev.backward(s);
        },
        &mode, &why);
    ASSERT_NE(exec, nullptr) << why;
    const Outputs replay_a = replay(dev, exec);
    dev.lengths.upload(B);
    const Outputs replay_b = replay(dev, exec);
    cudaGraphExecDestroy(exec);

    auto verdict = [](const Outputs& x, const Outputs& y) {
      const auto r = same_outputs(x, y);
      return r ? std::string("bitwise equal") : std::string("differ: ") + r.message();
    };
    const Reference rb = reference(pb);
    const int64_t H = d.hidden_size, T = d.max_seq;
    const Vec y = from_device_layout(decode(replay_b.y, d.dtype), d, T, H);
    const double err_b =
        rel_err(y, rb.y, [&](size_t i) { return pb.inside(i / (T * H), (i / H) % T); });
    std::printf(
        "  %s, captured with lengths A, the device array then set to B:\n"
        "    replay vs eager A: %s; vs eager B: %s; y vs the reference for B: %.1e\n"
        "    eager with the descriptor at A and the device array at B vs eager A: %s\n",
        d.describe().c_str(), verdict(replay_b, eager_a).c_str(),
        verdict(replay_b, eager_b).c_str(), err_b, verdict(eager_host_a_dev_b, eager_a).c_str());
    EXPECT_TRUE(same_outputs(replay_a, eager_a)) << "replay with the captured lengths";
    EXPECT_TRUE(same_outputs(replay_b, eager_a)) << "replay after the device lengths changed";
    EXPECT_TRUE(same_outputs(eager_host_a_dev_b, eager_a)) << "descriptor A, device array B";
    EXPECT_GT(err_b, 0.1) << "the replay followed the new device lengths after all";
  }
}

// One plan serves a ladder: each rung's graph is captured after set_lengths(all T_rung, T_rung)
// and keeps that state; replayed after the plan moved on to another rung, each equals an eager run
// at its own rung.
TEST(LstmGpu, OnePlanServesALadder) {
  for (LstmLayout layout : {LstmLayout::kSeqMajor, LstmLayout::kBatchMajor}) {
    const LstmDesc d = make_desc(16, 32, 2, 4, 16, DType::kFP16, layout);
    LstmPlan plan(context(), d);
    const int64_t rungs[] = {8, 16};
    Outputs eager[2];
    cudaGraphExec_t exec[2] = {};
    const cudaStream_t s = context().stream();
    for (int r = 0; r < 2; ++r) {
      const int64_t T = rungs[r];
      const std::vector<int32_t> lens(d.batch, static_cast<int32_t>(T));
      Problem p = make_problem(d, lens, 19, T);
      plan.set_lengths(lens.data(), T);
      Device dev(plan);
      dev.upload(p);
      eager[r] = dev.run();
      std::string mode, why;
      exec[r] = capture(
          s,
          [&] {
            dev.forward(s, LstmMode::kTraining);
            dev.backward(s);
          },
          &mode, &why);
      ASSERT_NE(exec[r], nullptr) << why;
      // Move the plan to the other rung, then replay: the graph keeps the lengths of its capture.
      const std::vector<int32_t> other(d.batch, static_cast<int32_t>(rungs[1 - r]));
      plan.set_lengths(other.data(), rungs[1 - r]);
      const Outputs replayed = replay(dev, exec[r]);
      EXPECT_TRUE(same_outputs(replayed, eager[r]))
          << lstm_layout_name(layout) << " rung " << T << " replayed with the plan at rung "
          << rungs[1 - r];
      compare(p, plan, replayed, reference(p));
      cudaGraphExecDestroy(exec[r]);
    }
  }
}

// The alternative that holds whatever a replay does with lengths: every sample runs to the rung's
// length (host and device lengths all T), x is zero past the real lengths, and the gradient
// arriving from the loss (dy) is zero there, dhy = dcy = 0. Then y and dx inside the real lengths,
// dhx, dcx and the weight gradient equal a ragged run's: the padded steps come after a sample's
// real ones, so they change no earlier output, and no gradient flows back from them.
TEST(LstmGpu, RungLengthWithMaskedGradient) {
  for (LstmLayout layout : {LstmLayout::kSeqMajor, LstmLayout::kBatchMajor}) {
    const LstmDesc d = make_desc(16, 32, 2, 6, 14, DType::kFP32, layout);
    LstmPlan plan(context(), d);
    Problem p = make_problem(d, ragged(d.batch, d.max_seq, 16), 16);
    // x and dy are zero past the real lengths (make_problem's Pad::kZero).
    const std::vector<int32_t> full(d.batch, static_cast<int32_t>(d.max_seq));
    plan.set_lengths(full.data());
    Device dev(plan);
    dev.upload(p);
    dev.lengths.upload(full);
    // dhy = dcy = 0: the final states of a full-length run are not the ragged run's.
    const Vec zeros(p.dhn.size(), 0.0);
    dev.dhy.upload(encode(zeros, d.dtype));
    dev.dcy.upload(encode(zeros, d.dtype));
    Problem masked = p;
    masked.dhn = masked.dcn = zeros;
    const Outputs o = dev.run();
    const Reference r = reference(masked);
    std::printf("  %s, full-length run with the gradient masked, vs the ragged reference:\n",
                lstm_layout_name(layout));
    // hy and cy are the states after step T - 1, not the ragged run's: compare all but those.
    Errors e = compare(masked, plan, o, r, false);
    const Tol tol = tolerance(d.dtype);
    const double dhx = rel_err(decode(o.dhx, d.dtype), r.dh0);
    const double dcx = rel_err(decode(o.dcx, d.dtype), r.dc0);
    std::printf("    dhx %.1e dcx %.1e\n", dhx, dcx);
    EXPECT_LE(dhx, tol.grad);
    EXPECT_LE(dcx, tol.grad);
    (void)e;
  }
}

// A sample of length 0: cuDNN takes it; its y and dx are the fill, its hy, cy, dhx, dcx zeros (the
// reference, like torch, passes hx, cx, dhy, dcy through); every other sample as the reference.
TEST(LstmGpu, ZeroLength) {
  const LstmDesc d = make_desc(8, 16, 2, 4, 6, DType::kFP32);
  LstmPlan plan(context(), d);
  const std::vector<int32_t> lens = {6, 0, 3, 6};
  Problem p = make_problem(d, lens, 17);
  plan.set_lengths(lens.data());
  Device dev(plan);
  dev.upload(p);
  const Outputs o = dev.run();
  const Reference r = reference(p);
  // The empty sample (1): zeros in the states and their gradients; the others match.
  const int64_t H = d.hidden_size;
  const Vec hy = decode(o.hy, d.dtype), cy = decode(o.cy, d.dtype);
  const Vec dhx = decode(o.dhx, d.dtype), dcx = decode(o.dcx, d.dtype);
  auto sample = [&](size_t i) { return static_cast<int64_t>(i / H) % d.batch; };
  size_t zeros = 0, n = 0;
  for (size_t i = 0; i < hy.size(); ++i)
    if (sample(i) == 1) {
      n += 4;
      zeros += (hy[i] == 0) + (cy[i] == 0) + (dhx[i] == 0) + (dcx[i] == 0);
    }
  auto others = [&](size_t i) { return sample(i) != 1; };
  const double err = std::max({rel_err(hy, r.hn, others), rel_err(cy, r.cn, others),
                               rel_err(dhx, r.dh0, others), rel_err(dcx, r.dc0, others)});
  std::printf(
      "  length 0 accepted: the empty sample's hy, cy, dhx, dcx: %zu of %zu zero; the other "
      "samples' states and state gradients vs the reference %.1e\n",
      zeros, n, err);
  EXPECT_EQ(zeros, n);
  EXPECT_LE(err, tolerance(d.dtype).grad);
  compare(p, plan, o, r, false);  // y, dx (inside the lengths) and the weight gradient
  const std::string y_pad = padding_census(p, o.y, H, 0.0);
  const std::string dx_pad = padding_census(p, o.dx, d.input_size, 0.0);
  std::printf("    past the lengths: y %s; dx %s\n", y_pad.c_str(), dx_pad.c_str());
  EXPECT_NE(y_pad.find(" 0 zero, 0 untouched (poison), 0 other"), std::string::npos) << y_pad;
  EXPECT_NE(dx_pad.find(" 0 zero, 0 untouched (poison), 0 other"), std::string::npos) << dx_pad;
}

// cuDNN's dropout between layers: does the mask change call to call, does re-binding the seed
// repeat it, and what does a graph replay do with it?
TEST(LstmGpu, Dropout) {
  LstmDesc d = make_desc(16, 32, 2, 4, 8, DType::kFP32);
  d.dropout = 0.5f;
  d.dropout_seed = 1234;
  LstmPlan plan(context(), d);
  LstmDesc nd = d;
  nd.dropout = 0.0f;
  LstmPlan plain(context(), nd);
  std::printf("  dropout state: %zu bytes\n", plan.dropout_state_bytes());
  ASSERT_GT(plan.dropout_state_bytes(), 0u);
  DeviceBuffer<unsigned char> states(plan.dropout_state_bytes());
  const cudaStream_t s = context().stream();
  Problem p = make_problem(d, std::vector<int32_t>(d.batch, 8), 18);
  Device dev(plan), ref_dev(plain);
  dev.upload(p);
  ref_dev.upload(p);
  EXPECT_THROW(dev.forward(s, LstmMode::kTraining), Error) << "training before bind_dropout";
  plan.bind_dropout(context(), states.get(), states.size(), s);
  const Outputs t1 = dev.run(), t2 = dev.run();
  plan.bind_dropout(context(), states.get(), states.size(), s);
  const Outputs t3 = dev.run();
  const Outputs plain_out = ref_dev.run();
  dev.poison(s);
  dev.forward(s, LstmMode::kInference);
  const Bytes y_inf = dev.y.download();
  EXPECT_FALSE(same(t1.y, t2.y)) << "two training forwards drew the same mask";
  EXPECT_TRUE(same(y_inf, plain_out.y)) << "the inference forward applied dropout";
  std::printf("  training forward twice: %s; after re-binding the seed: %s the first\n",
              same(t1.y, t2.y) ? "the same mask" : "different masks",
              same(t1.y, t3.y) ? "repeats" : "does not repeat");
  std::printf("  training y vs no dropout: %s; inference y vs no dropout: %s\n",
              same(t1.y, plain_out.y) ? "equal" : "differ",
              same(y_inf, plain_out.y) ? "bitwise equal" : "differ");
  EXPECT_FALSE(same(t1.y, plain_out.y)) << "dropout 0.5 changed nothing";
  EXPECT_TRUE(same(t1.y, t3.y)) << "re-binding the seed does not repeat the mask";

  // A graph of the training step: what do two replays draw?
  plan.bind_dropout(context(), states.get(), states.size(), s);
  std::string mode, why;
  cudaGraphExec_t exec = capture(
      s,
      [&] {
        dev.forward(s, LstmMode::kTraining);
        dev.backward(s);
      },
      &mode, &why);
  ASSERT_NE(exec, nullptr) << "a graph with dropout could not be captured: " << why;
  plan.bind_dropout(context(), states.get(), states.size(), s);
  const Outputs r1 = replay(dev, exec), r2 = replay(dev, exec);
  cudaGraphExecDestroy(exec);
  std::printf(
      "  replays after re-binding: replay 1 %s eager call 1, replay 2 %s eager call 2, "
      "replays %s each other\n",
      same(r1.y, t1.y) ? "=" : "!=", same(r2.y, t2.y) ? "=" : "!=",
      same(r1.y, r2.y) ? "equal" : "differ from");
}

// ---------------------------------------------------------------------------------------------------
// torch.nn.LSTM (where torch is importable): torch_lstm_check.py writes cases computed in fp64 on
// the CPU; each file: int32 I, H, L, B, T, dtype (0 fp32, 1 fp16), batch_first; int32 lengths [B];
// float32, in order: per layer weight_ih, weight_hh, bias_ih, bias_hh (PyTorch's shapes); x [B, T,
// I]; h0, c0 [L, B, H]; dy [B, T, H]; dhn, dcn [L, B, H]; then torch's y [B, T, H] (zeros past the
// lengths), hn, cn, dx [B, T, I], dh0, dc0 and the four gradients per layer in the same order.

std::string script_path() {
  if (const char* env = std::getenv("REPLAY_LSTM_TORCH_SCRIPT")) return env;
  const std::string here = __FILE__;
  const std::string near = here.substr(0, here.find_last_of('/') + 1) + "torch_lstm_check.py";
  if (access(near.c_str(), R_OK) == 0) return near;
  return "tests/workloads/rnnt/torch_lstm_check.py";
}

template <typename T>
std::vector<T> read_n(std::ifstream& f, size_t n) {
  std::vector<T> v(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  return v;
}

Vec read_vec(std::ifstream& f, size_t n) {
  const std::vector<float> v = read_n<float>(f, n);
  return Vec(v.begin(), v.end());
}

TEST(LstmTorch, MatchesTorchLstm) {
  char dir[] = "/tmp/replay_lstm_torch_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string cmd = "python3 " + script_path() + " --out-dir " + dir;
  const int status = std::system(cmd.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 77) GTEST_SKIP() << "torch is not importable";
  ASSERT_EQ(rc, 0) << cmd;
  int cases = 0;
  for (;; ++cases) {
    const std::string path = std::string(dir) + "/case" + std::to_string(cases) + ".bin";
    std::ifstream f(path, std::ios::binary);
    if (!f.good()) break;
    const std::vector<int32_t> head = read_n<int32_t>(f, 7);
    LstmDesc d = make_desc(head[0], head[1], head[2], head[3], head[4],
                           head[5] == 1 ? DType::kFP16 : DType::kFP32,
                           head[6] ? LstmLayout::kBatchMajor : LstmLayout::kSeqMajor);
    Problem p;
    p.desc = d;
    p.T = d.max_seq;
    p.lengths = read_n<int32_t>(f, d.batch);
    p.shape.input = d.input_size;
    p.shape.hidden = d.hidden_size;
    p.shape.layers = d.layers;
    p.shape.batch = d.batch;
    p.shape.max_seq = d.max_seq;
    p.w = ref::lstm_zero_weights(p.shape);
    for (LstmLayerWeights& l : p.w)
      for (Vec* v : {&l.w_ih, &l.w_hh, &l.b_ih, &l.b_hh}) *v = read_vec(f, v->size());
    const size_t nx = d.x_elements(), ny = d.y_elements(), ns = d.state_elements();
    p.x = read_vec(f, nx);
    p.h0 = read_vec(f, ns);
    p.c0 = read_vec(f, ns);
    p.dy = read_vec(f, ny);
    p.dhn = read_vec(f, ns);
    p.dcn = read_vec(f, ns);
    Reference t;
    t.y = read_vec(f, ny);
    t.hn = read_vec(f, ns);
    t.cn = read_vec(f, ns);
    t.dx = read_vec(f, nx);
    t.dh0 = read_vec(f, ns);
    t.dc0 = read_vec(f, ns);
    t.dw = ref::lstm_zero_weights(p.shape);
    for (LstmLayerWeights& l : t.dw)
      for (Vec* v : {&l.w_ih, &l.w_hh, &l.b_ih, &l.b_hh}) *v = read_vec(f, v->size());
    ASSERT_TRUE(f.good()) << "short file " << path;

    LstmPlan plan(context(), d);
    plan.set_lengths(p.lengths.data());
    Device dev(plan);
    dev.upload(p);
    const Outputs o = dev.run();
    std::printf("  vs torch.nn.LSTM (fp64, CPU, packed sequences):\n");
    compare(p, plan, o, t);
    // And the fp64 reference against torch: the same function.
    const Reference r = reference(p);
    const double ry = rel_err(r.y, t.y), rdw = rel_err(r.dw[0].w_ih, t.dw[0].w_ih);
    std::printf("    fp64 reference vs torch: y %.1e, dweight_ih_l0 %.1e\n", ry, rdw);
    EXPECT_LE(ry, 1e-6);  // torch's values went through float32 in the file
    EXPECT_LE(rdw, 1e-6);
  }
  EXPECT_GT(cases, 0) << "the script wrote no case into " << dir;
  const int removed = std::system((std::string("rm -rf ") + dir).c_str());
  (void)removed;
}

// ---------------------------------------------------------------------------------------------------
// Timing (printed, not asserted): the MLPerf RNN-T LSTMs at NVIDIA's 192 utterances per GPU, fp16,
// every sample at the full length; and the encoder's first two layers as two single-layer plans
// (what running the workload's own dropout between layers costs).

// Random inputs, MLPerf-initialised weights, zero states, every length at T.
void prepare(Device& dev, uint64_t seed) {
  const LstmDesc& d = dev.d;
  const cudaStream_t s = context().stream();
  lstm_init_weights(dev.plan.weights(), dev.w.get(), seed, 0, LstmInit{}, s);
  init_normal(TensorView(dev.x.get(), d.dtype, {d.x_elements()}), seed + 1, 0, 0.0f, 1.0f, s);
  init_normal(TensorView(dev.dy.get(), d.dtype, {d.y_elements()}), seed + 2, 0, 0.0f, 1.0f, s);
  for (auto* b : {&dev.hx, &dev.cx, &dev.dhy, &dev.dcy})
    REPLAY_CUDA_CHECK(cudaMemsetAsync(b->get(), 0, b->size(), s));
  dev.lengths.upload(std::vector<int32_t>(d.batch, static_cast<int32_t>(d.max_seq)));
}

// Milliseconds of one call of f on the context's stream: 3 warm-up calls, then the median of 5
// batches of 4 calls each (robust to a batch the clocks or a neighbour disturbed).
double time_ms(const std::function<void()>& f) {
  const cudaStream_t s = context().stream();
  cudaEvent_t e0, e1;
  REPLAY_CUDA_CHECK(cudaEventCreate(&e0));
  REPLAY_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> batches;
  for (int k = 0; k < 5; ++k) {
    REPLAY_CUDA_CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < 4; ++i) f();
    REPLAY_CUDA_CHECK(cudaEventRecord(e1, s));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    batches.push_back(ms / 4);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(batches.begin(), batches.end());
  return batches[2];
}

TEST(LstmTiming, MlperfShapes) {
  struct Shape {
    const char* what;
    LstmDesc desc;
  };
  const Shape shapes[] = {
      {"encoder pre-stack (240 -> 1024, 2 layers, T 410)",
       make_desc(240, 1024, 2, 192, 410, DType::kFP16)},
      {"encoder post-stack (2048 -> 1024, 3 layers, T 205)",
       make_desc(2048, 1024, 3, 192, 205, DType::kFP16)},
      {"prediction (512 -> 512, 2 layers, U+1 72)", make_desc(512, 512, 2, 192, 72, DType::kFP16)},
  };
  const cudaStream_t s = context().stream();
  std::printf("  cuDNN %s, %s\n", context().environment().get("cudnn").c_str(),
              context().props().name);
  for (const Shape& sh : shapes) {
    const LstmDesc& d = sh.desc;
    LstmPlan plan(context(), d);
    Device dev(plan);
    prepare(dev, 1);
    const double inf = time_ms([&] { dev.forward(s, LstmMode::kInference); });
    const double fwd = time_ms([&] { dev.forward(s, LstmMode::kTraining); });
    const double step = time_ms([&] {
      dev.forward(s, LstmMode::kTraining);
      dev.backward(s);
    });
    const double tf = d.flops() / 1e12;
    std::printf(
        "  %s, B 192 fp16 [%s]:\n    forward inference %.2f ms, training %.2f ms (%.0f "
        "TFLOP/s), forward + backward %.2f ms (%.0f TFLOP/s)\n",
        sh.what, plan.math(), inf, fwd, tf / (fwd * 1e-3), step, 3 * tf / (step * 1e-3));
    // Bitwise reproducibility at this size too: two more steps.
    const Outputs a = dev.run(), b = dev.run();
    EXPECT_TRUE(same_outputs(a, b)) << sh.what;
  }

  // The pre-stack layers as two plans of one layer each (dropout between them would go there).
  LstmPlan first(context(), make_desc(240, 1024, 1, 192, 410, DType::kFP16));
  LstmPlan second(context(), make_desc(1024, 1024, 1, 192, 410, DType::kFP16));
  Device d0(first), d1(second);
  prepare(d0, 4);
  prepare(d1, 5);
  const double fwd = time_ms([&] {
    d0.forward(s, LstmMode::kTraining);
    d1.forward(s, LstmMode::kTraining);
  });
  const double step = time_ms([&] {
    d0.forward(s, LstmMode::kTraining);
    d1.forward(s, LstmMode::kTraining);
    d1.backward(s);
    d0.backward(s);
  });
  std::printf(
      "  encoder pre-stack as two 1-layer plans: training forward %.2f ms, forward + "
      "backward %.2f ms\n",
      fwd, step);
}

}  // namespace
}  // namespace replay::rnnt
