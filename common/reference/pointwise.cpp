// pointwise.cpp: fp64 CPU references (see pointwise.h). Straightforward loops, written from the
// formulas in the kernel headers rather than from the kernels.
#include "common/reference/pointwise.h"

#include <cmath>

#include "common/kernels/dropout.h"  // dropout_threshold
#include "common/philox.h"

namespace replay::ref {

void layernorm_forward(double* out, double* mean, double* rstd, const double* x,
                       const double* gamma, const double* beta, int64_t rows, int C, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x + r * C;
    double m = 0.0, v = 0.0;
    for (int c = 0; c < C; ++c) m += xr[c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (xr[c] - m) * (xr[c] - m);
    const double s = 1.0 / std::sqrt(v / C + eps);
    for (int c = 0; c < C; ++c) out[r * C + c] = (xr[c] - m) * s * gamma[c] + beta[c];
    mean[r] = m;
    rstd[r] = s;
  }
}

void layernorm_backward(double* dx, double* dgamma, double* dbeta, const double* dout,
                        const double* x, const double* gamma, const double* mean,
                        const double* rstd, int64_t rows, int C) {
  for (int c = 0; c < C; ++c) dgamma[c] = dbeta[c] = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x + r * C;
    const double* dr = dout + r * C;
    double mean_g = 0.0, mean_gx = 0.0;
    for (int c = 0; c < C; ++c) {
      const double xhat = (xr[c] - mean[r]) * rstd[r];
      mean_g += dr[c] * gamma[c];
      mean_gx += dr[c] * gamma[c] * xhat;
      dgamma[c] += dr[c] * xhat;
      dbeta[c] += dr[c];
    }
    mean_g /= C;
    mean_gx /= C;
    for (int c = 0; c < C; ++c) {
      const double xhat = (xr[c] - mean[r]) * rstd[r];
      dx[r * C + c] = rstd[r] * (dr[c] * gamma[c] - mean_g - xhat * mean_gx);
    }
  }
}

void rmsnorm_forward(double* out, double* rstd, const double* x, const double* gamma, int64_t rows,
                     int C, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x + r * C;
    double ms = 0.0;
    for (int c = 0; c < C; ++c) ms += xr[c] * xr[c];
    const double s = 1.0 / std::sqrt(ms / C + eps);
    for (int c = 0; c < C; ++c) out[r * C + c] = xr[c] * s * gamma[c];
    rstd[r] = s;
  }
}

void rmsnorm_backward(double* dx, double* dgamma, const double* dout, const double* x,
                      const double* gamma, const double* rstd, int64_t rows, int C) {
  for (int c = 0; c < C; ++c) dgamma[c] = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x + r * C;
    const double* dr = dout + r * C;
    double mean_gx = 0.0;
    for (int c = 0; c < C; ++c) {
      mean_gx += dr[c] * gamma[c] * xr[c] * rstd[r];
      dgamma[c] += dr[c] * xr[c] * rstd[r];
    }
    mean_gx /= C;
    for (int c = 0; c < C; ++c)
      dx[r * C + c] = rstd[r] * (dr[c] * gamma[c] - xr[c] * rstd[r] * mean_gx);
  }
}

namespace {
double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCoeff = 0.044715;
}  // namespace

void swiglu_forward(double* out, const double* in, int64_t M, int F) {
  for (int64_t m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) {
      const double g = in[m * 2 * F + f], u = in[m * 2 * F + F + f];
      out[m * F + f] = g * sigmoid(g) * u;
    }
}

void swiglu_backward(double* din, const double* dout, const double* in, int64_t M, int F) {
  for (int64_t m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) {
      const double g = in[m * 2 * F + f], u = in[m * 2 * F + F + f], d = dout[m * F + f];
      const double s = sigmoid(g);
      din[m * 2 * F + f] = d * u * s * (1.0 + g * (1.0 - s));
      din[m * 2 * F + F + f] = d * g * s;
    }
}

void gelu_forward(double* out, const double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    out[i] = 0.5 * v * (1.0 + std::tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v)));
  }
}

void gelu_backward(double* dx, const double* dout, const double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double t = std::tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v));
    const double grad =
        0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * v * v);
    dx[i] = dout[i] * grad;
  }
}

std::vector<double> rope_frequencies(int rope_dim, double theta, const RopeScaling& s) {
  const double kPi = 3.14159265358979323846;
  std::vector<double> f(rope_dim / 2);
  for (int i = 0; i < rope_dim / 2; ++i) {
    f[i] = 1.0 / std::pow(theta, 2.0 * i / rope_dim);
    if (!s.enabled) continue;
    const double wavelen = 2.0 * kPi / f[i];
    if (wavelen < s.original_max_position / s.high_freq_factor) continue;  // high frequency: kept
    if (wavelen > s.original_max_position / s.low_freq_factor) {           // low frequency: scaled
      f[i] /= s.factor;
    } else {  // in between: interpolated
      const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f[i] = (1.0 - smooth) * f[i] / s.factor + smooth * f[i];
    }
  }
  return f;
}

void rope_table(double* cos_out, double* sin_out, int max_positions, int rope_dim, double theta,
                const RopeScaling& scaling) {
  const std::vector<double> f = rope_frequencies(rope_dim, theta, scaling);
  const int half = rope_dim / 2;
  for (int64_t pos = 0; pos < max_positions; ++pos)
    for (int i = 0; i < half; ++i) {
      cos_out[pos * half + i] = std::cos(pos * f[i]);
      sin_out[pos * half + i] = std::sin(pos * f[i]);
    }
}

namespace {
void rope_rotate(double* out, const double* x, const std::vector<double>& freqs,
                 const int32_t* positions, const RopeLayout& l, double sign) {
  const int64_t stride =
      l.token_stride ? l.token_stride : static_cast<int64_t>(l.heads) * l.head_dim;
  const int half = l.rope_dim / 2;
  for (int64_t t = 0; t < l.batch * l.seq; ++t) {
    const double pos = positions ? positions[t] : static_cast<double>(t % l.seq);
    for (int h = 0; h < l.heads; ++h) {
      const int64_t base = t * stride + static_cast<int64_t>(h) * l.head_dim;
      for (int c = 0; c < l.head_dim; ++c) out[base + c] = x[base + c];
      for (int i = 0; i < half; ++i) {
        const double a = x[base + l.rope_offset + i], b = x[base + l.rope_offset + half + i];
        const double angle = sign * pos * freqs[i];
        out[base + l.rope_offset + i] = a * std::cos(angle) - b * std::sin(angle);
        out[base + l.rope_offset + half + i] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
  }
}
}  // namespace

void rope_forward(double* out, const double* x, const std::vector<double>& freqs,
                  const int32_t* positions, const RopeLayout& layout) {
  rope_rotate(out, x, freqs, positions, layout, 1.0);
}

void rope_backward(double* dx, const double* dout, const std::vector<double>& freqs,
                   const int32_t* positions, const RopeLayout& layout) {
  rope_rotate(dx, dout, freqs, positions, layout, -1.0);
}

std::vector<uint8_t> dropout_keep_mask(int64_t n, float p, uint64_t seed, uint64_t position) {
  const uint32_t threshold = dropout_threshold(p);
  std::vector<uint8_t> keep(n);
  for (int64_t e = 0; e < n; ++e) {
    const Philox4 r = philox_block(seed, position, static_cast<uint64_t>(e) / 4);
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
    keep[e] = words[e % 4] >= threshold;
  }
  return keep;
}

void dropout_residual_forward(double* out, const double* x, const double* bias,
                              const double* residual, int64_t rows, int C, float p, uint64_t seed,
                              uint64_t position) {
  const std::vector<uint8_t> keep = dropout_keep_mask(rows * C, p, seed, position);
  const double scale = 1.0 / (1.0 - static_cast<double>(p));
  for (int64_t e = 0; e < rows * C; ++e) {
    const double v = x[e] + (bias ? bias[e % C] : 0.0);
    out[e] = (keep[e] ? v * scale : 0.0) + (residual ? residual[e] : 0.0);
  }
}

void dropout_residual_backward(double* dx, double* dbias, const double* dout, int64_t rows, int C,
                               float p, uint64_t seed, uint64_t position) {
  const std::vector<uint8_t> keep = dropout_keep_mask(rows * C, p, seed, position);
  const double scale = 1.0 / (1.0 - static_cast<double>(p));
  for (int64_t e = 0; e < rows * C; ++e) dx[e] = keep[e] ? dout[e] * scale : 0.0;
  if (!dbias) return;
  for (int c = 0; c < C; ++c) dbias[c] = 0.0;
  for (int64_t e = 0; e < rows * C; ++e) dbias[e % C] += dx[e];
}

}  // namespace replay::ref
