// unet_reference.cpp: the fp64 references of unet_reference.h, written from the definitions (two
// exact passes for the statistics, the textbook GroupNorm backward, direct convolution loops) so
// that they share no shortcut with the GPU kernels.
#include "workloads/unet/unet_reference.h"

#include <cmath>
#include <vector>

namespace replay::unet::ref {
namespace {

double sigmoid(double y) {
  return 1.0 / (1.0 + std::exp(-y));
}

}  // namespace

void group_norm_forward(double* out, double* mean, double* rstd, const double* x,
                        const double* gamma, const double* beta, int64_t N, int64_t HW, int C,
                        int G, double eps, bool silu) {
  const int Cg = C / G;
  const double count = static_cast<double>(HW) * Cg;
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * HW * C;
    double* on = out + n * HW * C;
    for (int g = 0; g < G; ++g) {
      double sum = 0.0;
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) sum += xn[p * C + g * Cg + j];
      const double m = sum / count;
      double var = 0.0;
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) {
          const double d = xn[p * C + g * Cg + j] - m;
          var += d * d;
        }
      const double r = 1.0 / std::sqrt(var / count + eps);
      mean[n * G + g] = m;
      rstd[n * G + g] = r;
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) {
          const int c = g * Cg + j;
          const double y = (xn[p * C + c] - m) * r * gamma[c] + beta[c];
          on[p * C + c] = silu ? y * sigmoid(y) : y;
        }
    }
  }
}

void group_norm_backward(double* dx, double* dgamma, double* dbeta, const double* dout,
                         const double* x, const double* gamma, const double* beta,
                         const double* mean, const double* rstd, int64_t N, int64_t HW, int C,
                         int G, bool silu) {
  const int Cg = C / G;
  const double count = static_cast<double>(HW) * Cg;
  for (int c = 0; c < C; ++c) dgamma[c] = dbeta[c] = 0.0;
  std::vector<double> dy(static_cast<size_t>(HW * C)), xhat(static_cast<size_t>(HW * C));
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * HW * C;
    const double* dn = dout + n * HW * C;
    double* gn = dx + n * HW * C;
    for (int64_t p = 0; p < HW; ++p)
      for (int c = 0; c < C; ++c) {
        const int g = c / Cg;
        const int64_t i = p * C + c;
        xhat[i] = (xn[i] - mean[n * G + g]) * rstd[n * G + g];
        const double y = xhat[i] * gamma[c] + beta[c];
        const double s = sigmoid(y);
        dy[i] = silu ? dn[i] * s * (1.0 + y * (1.0 - s)) : dn[i];
        dgamma[c] += dy[i] * xhat[i];
        dbeta[c] += dy[i];
      }
    for (int g = 0; g < G; ++g) {
      double mean_g = 0.0, mean_gx = 0.0;  // mean over the group of dy * gamma, and of it * xhat
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) {
          const int c = g * Cg + j;
          const int64_t i = p * C + c;
          mean_g += dy[i] * gamma[c];
          mean_gx += dy[i] * gamma[c] * xhat[i];
        }
      mean_g /= count;
      mean_gx /= count;
      const double r = rstd[n * G + g];
      for (int64_t p = 0; p < HW; ++p)
        for (int j = 0; j < Cg; ++j) {
          const int c = g * Cg + j;
          const int64_t i = p * C + c;
          gn[i] = r * (dy[i] * gamma[c] - mean_g - xhat[i] * mean_gx);
        }
    }
  }
}

void conv2d_forward(double* y, const double* x, const double* w, const double* bias,
                    const ConvShape& s) {
  const int64_t P = s.p(), Q = s.q();
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t k = 0; k < s.k; ++k) {
          double acc = bias ? bias[k] : 0.0;
          for (int64_t r = 0; r < s.kernel; ++r) {
            const int64_t h = p * s.stride - s.padding + r;
            if (h < 0 || h >= s.h) continue;
            for (int64_t t = 0; t < s.kernel; ++t) {
              const int64_t v = q * s.stride - s.padding + t;
              if (v < 0 || v >= s.w) continue;
              const double* xp = x + ((n * s.h + h) * s.w + v) * s.c;
              const double* wp = w + ((k * s.kernel + r) * s.kernel + t) * s.c;
              for (int64_t c = 0; c < s.c; ++c) acc += xp[c] * wp[c];
            }
          }
          y[((n * P + p) * Q + q) * s.k + k] = acc;
        }
}

// Both gradients scatter through the same index map as the forward: every (output, tap) pair adds
// its product's derivative.
void conv2d_dgrad(double* dx, const double* dy, const double* w, const ConvShape& s) {
  const int64_t P = s.p(), Q = s.q();
  for (int64_t i = 0; i < s.n * s.h * s.w * s.c; ++i) dx[i] = 0.0;
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t k = 0; k < s.k; ++k) {
          const double g = dy[((n * P + p) * Q + q) * s.k + k];
          for (int64_t r = 0; r < s.kernel; ++r) {
            const int64_t h = p * s.stride - s.padding + r;
            if (h < 0 || h >= s.h) continue;
            for (int64_t t = 0; t < s.kernel; ++t) {
              const int64_t v = q * s.stride - s.padding + t;
              if (v < 0 || v >= s.w) continue;
              double* xp = dx + ((n * s.h + h) * s.w + v) * s.c;
              const double* wp = w + ((k * s.kernel + r) * s.kernel + t) * s.c;
              for (int64_t c = 0; c < s.c; ++c) xp[c] += g * wp[c];
            }
          }
        }
}

void conv2d_wgrad(double* dw, const double* dy, const double* x, const ConvShape& s) {
  const int64_t P = s.p(), Q = s.q();
  for (int64_t i = 0; i < s.k * s.kernel * s.kernel * s.c; ++i) dw[i] = 0.0;
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t k = 0; k < s.k; ++k) {
          const double g = dy[((n * P + p) * Q + q) * s.k + k];
          for (int64_t r = 0; r < s.kernel; ++r) {
            const int64_t h = p * s.stride - s.padding + r;
            if (h < 0 || h >= s.h) continue;
            for (int64_t t = 0; t < s.kernel; ++t) {
              const int64_t v = q * s.stride - s.padding + t;
              if (v < 0 || v >= s.w) continue;
              const double* xp = x + ((n * s.h + h) * s.w + v) * s.c;
              double* wp = dw + ((k * s.kernel + r) * s.kernel + t) * s.c;
              for (int64_t c = 0; c < s.c; ++c) wp[c] += g * xp[c];
            }
          }
        }
}

void bias_grad(double* db, const double* dy, int64_t rows, int64_t k) {
  for (int64_t j = 0; j < k; ++j) db[j] = 0.0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < k; ++j) db[j] += dy[i * k + j];
}

}  // namespace replay::unet::ref
