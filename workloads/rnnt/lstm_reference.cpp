// lstm_reference.cpp: fp64 CPU reference of a multi-layer LSTM (see lstm_reference.h). One sample
// at a time: its forward keeps every layer's inputs, gates and states, and the backward walks them
// in reverse, top layer first (a layer's input gradient is the gradient of the layer below's
// output).
#include "workloads/rnnt/lstm_reference.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"

namespace replay::rnnt::ref {
namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// One sample's forward, per layer l and step t < n: the layer's input u[l] [n, I_l], the gate
// activations act[l] [n, 4H] (i, f, g, o after their nonlinearities), c[l] and h[l] [n, H].
struct Trace {
  std::vector<std::vector<double>> u, act, c, h;
};

// The sample's initial state of layer l (zeros when the array is null).
const double* state_row(const double* s, const LstmShape& shape, int64_t l, int64_t b) {
  return s == nullptr ? nullptr : s + (l * shape.batch + b) * shape.hidden;
}

Trace run_sample(const LstmShape& shape, const std::vector<LstmLayerWeights>& w, const double* x,
                 int64_t b, int64_t n, const double* h0, const double* c0) {
  const int64_t H = shape.hidden, G = 4 * H;
  Trace tr;
  tr.u.resize(shape.layers);
  tr.act.resize(shape.layers);
  tr.c.resize(shape.layers);
  tr.h.resize(shape.layers);
  for (int64_t l = 0; l < shape.layers; ++l) {
    const int64_t In = shape.layer_input(l);
    std::vector<double>& u = tr.u[l];
    u.resize(n * In);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < In; ++k)
        u[t * In + k] =
            l == 0 ? x[(b * shape.max_seq + t) * shape.input + k] : tr.h[l - 1][t * H + k];
    tr.act[l].resize(n * G);
    tr.c[l].resize(n * H);
    tr.h[l].resize(n * H);
    const double* hi = state_row(h0, shape, l, b);
    const double* ci = state_row(c0, shape, l, b);
    std::vector<double> a(G);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < G; ++r) {
        double s = w[l].b_ih[r] + w[l].b_hh[r];
        for (int64_t k = 0; k < In; ++k) s += w[l].w_ih[r * In + k] * u[t * In + k];
        for (int64_t k = 0; k < H; ++k) {
          const double hp = t > 0 ? tr.h[l][(t - 1) * H + k] : (hi ? hi[k] : 0.0);
          s += w[l].w_hh[r * H + k] * hp;
        }
        a[r] = s;
      }
      double* act = &tr.act[l][t * G];
      for (int64_t j = 0; j < H; ++j) {
        act[j] = sigmoid(a[j]);                    // i
        act[H + j] = sigmoid(a[H + j]);            // f
        act[2 * H + j] = std::tanh(a[2 * H + j]);  // g
        act[3 * H + j] = sigmoid(a[3 * H + j]);    // o
        const double cp = t > 0 ? tr.c[l][(t - 1) * H + j] : (ci ? ci[j] : 0.0);
        const double c = act[H + j] * cp + act[j] * act[2 * H + j];
        tr.c[l][t * H + j] = c;
        tr.h[l][t * H + j] = act[3 * H + j] * std::tanh(c);
      }
    }
  }
  return tr;
}

void check_shape(const LstmShape& s, const std::vector<LstmLayerWeights>& w,
                 const int32_t* lengths) {
  REPLAY_REQUIRE(s.input >= 1 && s.hidden >= 1 && s.layers >= 1 && s.batch >= 1 && s.max_seq >= 1,
                 "LSTM reference: every size must be >= 1");
  REPLAY_REQUIRE(static_cast<int64_t>(w.size()) == s.layers,
                 "LSTM reference: one weight set a layer");
  for (int64_t l = 0; l < s.layers; ++l)
    REPLAY_REQUIRE(
        static_cast<int64_t>(w[l].w_ih.size()) == 4 * s.hidden * s.layer_input(l) &&
            static_cast<int64_t>(w[l].w_hh.size()) == 4 * s.hidden * s.hidden &&
            static_cast<int64_t>(w[l].b_ih.size()) == 4 * s.hidden &&
            static_cast<int64_t>(w[l].b_hh.size()) == 4 * s.hidden,
        "LSTM reference: layer " + std::to_string(l) + "'s weights have the wrong sizes");
  for (int64_t b = 0; b < s.batch; ++b)
    REPLAY_REQUIRE(lengths[b] >= 0 && lengths[b] <= s.max_seq,
                   "LSTM reference: length " + std::to_string(lengths[b]) + " of sample " +
                       std::to_string(b) + " outside [0, T]");
}

}  // namespace

std::vector<LstmLayerWeights> lstm_zero_weights(const LstmShape& s) {
  std::vector<LstmLayerWeights> w(s.layers);
  for (int64_t l = 0; l < s.layers; ++l) {
    w[l].w_ih.assign(4 * s.hidden * s.layer_input(l), 0.0);
    w[l].w_hh.assign(4 * s.hidden * s.hidden, 0.0);
    w[l].b_ih.assign(4 * s.hidden, 0.0);
    w[l].b_hh.assign(4 * s.hidden, 0.0);
  }
  return w;
}

void lstm_forward(const LstmShape& s, const std::vector<LstmLayerWeights>& w, const double* x,
                  const int32_t* lengths, const double* h0, const double* c0, double* y, double* hn,
                  double* cn) {
  check_shape(s, w, lengths);
  const int64_t H = s.hidden, T = s.max_seq;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t n = lengths[b];
    const Trace tr = run_sample(s, w, x, b, n, h0, c0);
    if (y != nullptr)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < H; ++j)
          y[(b * T + t) * H + j] = t < n ? tr.h[s.layers - 1][t * H + j] : 0.0;
    for (int64_t l = 0; l < s.layers; ++l)
      for (int64_t j = 0; j < H; ++j) {
        const int64_t at = (l * s.batch + b) * H + j;
        if (hn != nullptr) hn[at] = n > 0 ? tr.h[l][(n - 1) * H + j] : (h0 ? h0[at] : 0.0);
        if (cn != nullptr) cn[at] = n > 0 ? tr.c[l][(n - 1) * H + j] : (c0 ? c0[at] : 0.0);
      }
  }
}

void lstm_backward(const LstmShape& s, const std::vector<LstmLayerWeights>& w, const double* x,
                   const int32_t* lengths, const double* h0, const double* c0, const double* dy,
                   const double* dhn, const double* dcn, double* dx, double* dh0, double* dc0,
                   std::vector<LstmLayerWeights>* dw) {
  check_shape(s, w, lengths);
  if (dw != nullptr) {
    REPLAY_REQUIRE(static_cast<int64_t>(dw->size()) == s.layers,
                   "LSTM reference: dweights must have one entry a layer (lstm_zero_weights)");
    for (int64_t l = 0; l < s.layers; ++l)
      REPLAY_REQUIRE(
          (*dw)[l].w_ih.size() == w[l].w_ih.size() && (*dw)[l].w_hh.size() == w[l].w_hh.size() &&
              (*dw)[l].b_ih.size() == w[l].b_ih.size() && (*dw)[l].b_hh.size() == w[l].b_hh.size(),
          "LSTM reference: dweights sized unlike the weights");
  }
  const int64_t H = s.hidden, G = 4 * H, T = s.max_seq;
  if (dx != nullptr) std::fill(dx, dx + s.batch * T * s.input, 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t n = lengths[b];
    const Trace tr = run_sample(s, w, x, b, n, h0, c0);
    // The gradient arriving at layer l's outputs h_t from above: dy for the top layer, the input
    // gradient of layer l + 1 for the others.
    std::vector<double> dout(n * H, 0.0);
    if (dy != nullptr)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < H; ++j) dout[t * H + j] = dy[(b * T + t) * H + j];
    for (int64_t l = s.layers - 1; l >= 0; --l) {
      const int64_t In = s.layer_input(l);
      const int64_t st = (l * s.batch + b) * H;
      std::vector<double> dh(H), dc(H), da(G), din(n * In, 0.0);
      for (int64_t j = 0; j < H; ++j) {
        dh[j] = dhn ? dhn[st + j] : 0.0;
        dc[j] = dcn ? dcn[st + j] : 0.0;
      }
      for (int64_t t = n - 1; t >= 0; --t) {
        const double* act = &tr.act[l][t * G];
        for (int64_t j = 0; j < H; ++j) {
          const double i = act[j], f = act[H + j], g = act[2 * H + j], o = act[3 * H + j];
          const double c = tr.c[l][t * H + j];
          const double cp = t > 0 ? tr.c[l][(t - 1) * H + j] : (c0 ? c0[st + j] : 0.0);
          const double tc = std::tanh(c);
          const double dht = dh[j] + dout[t * H + j];
          const double dct = dc[j] + dht * o * (1.0 - tc * tc);
          da[j] = dct * g * i * (1.0 - i);
          da[H + j] = dct * cp * f * (1.0 - f);
          da[2 * H + j] = dct * i * (1.0 - g * g);
          da[3 * H + j] = dht * tc * o * (1.0 - o);
          dc[j] = dct * f;  // to step t - 1
        }
        // dh to step t - 1 and the input gradient, through W_hh and W_ih.
        for (int64_t k = 0; k < H; ++k) {
          double sum = 0.0;
          for (int64_t r = 0; r < G; ++r) sum += w[l].w_hh[r * H + k] * da[r];
          dh[k] = sum;
        }
        for (int64_t k = 0; k < In; ++k) {
          double sum = 0.0;
          for (int64_t r = 0; r < G; ++r) sum += w[l].w_ih[r * In + k] * da[r];
          din[t * In + k] = sum;
        }
        if (dw != nullptr) {
          LstmLayerWeights& g = (*dw)[l];
          for (int64_t r = 0; r < G; ++r) {
            g.b_ih[r] += da[r];
            g.b_hh[r] += da[r];
            for (int64_t k = 0; k < In; ++k) g.w_ih[r * In + k] += da[r] * tr.u[l][t * In + k];
            for (int64_t k = 0; k < H; ++k) {
              const double hp = t > 0 ? tr.h[l][(t - 1) * H + k] : (h0 ? h0[st + k] : 0.0);
              g.w_hh[r * H + k] += da[r] * hp;
            }
          }
        }
      }
      for (int64_t j = 0; j < H; ++j) {
        if (dh0 != nullptr) dh0[st + j] = dh[j];
        if (dc0 != nullptr) dc0[st + j] = dc[j];
      }
      if (l > 0) {
        dout = std::move(din);
      } else if (dx != nullptr) {
        for (int64_t t = 0; t < n; ++t)
          for (int64_t k = 0; k < In; ++k) dx[(b * T + t) * s.input + k] = din[t * In + k];
      }
    }
  }
}

}  // namespace replay::rnnt::ref
