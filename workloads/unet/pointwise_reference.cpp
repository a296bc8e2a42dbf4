// pointwise_reference.cpp: the fp64 references of pointwise.h's kernels.
#include "workloads/unet/pointwise_reference.h"

#include <cmath>

namespace replay::unet::ref {

double gelu(double x) {
  return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
}

double gelu_grad(double x) {
  const double cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
  const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * 3.14159265358979323846);
  return cdf + x * pdf;
}

void geglu_forward(double* out, const double* in, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < F; ++f)
      out[r * F + f] = in[r * 2 * F + f] * gelu(in[r * 2 * F + F + f]);
}

void geglu_backward(double* din, const double* dout, const double* in, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      const double a = in[r * 2 * F + f], b = in[r * 2 * F + F + f], d = dout[r * F + f];
      din[r * 2 * F + f] = d * gelu(b);
      din[r * 2 * F + F + f] = d * a * gelu_grad(b);
    }
  }
}

void upsample_nearest2x_forward(double* y, const double* x, int64_t N, int64_t H, int64_t W,
                                int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < 2 * H; ++h)
      for (int64_t w = 0; w < 2 * W; ++w)
        for (int64_t c = 0; c < C; ++c)
          y[((n * 2 * H + h) * 2 * W + w) * C + c] = x[((n * H + h / 2) * W + w / 2) * C + c];
}

void upsample_nearest2x_backward(double* dx, const double* dy, int64_t N, int64_t H, int64_t W,
                                 int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t w = 0; w < W; ++w) {
        for (int64_t c = 0; c < C; ++c) {
          double s = 0.0;
          for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 2; ++j)
              s += dy[((n * 2 * H + 2 * h + i) * 2 * W + 2 * w + j) * C + c];
          dx[((n * H + h) * W + w) * C + c] = s;
        }
      }
    }
  }
}

void concat_channels_forward(double* y, const double* a, int64_t Ca, const double* b, int64_t Cb,
                             int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < Ca; ++c) y[r * (Ca + Cb) + c] = a[r * Ca + c];
    for (int64_t c = 0; c < Cb; ++c) y[r * (Ca + Cb) + Ca + c] = b[r * Cb + c];
  }
}

void concat_channels_backward(double* da, double* db, const double* dy, int64_t Ca, int64_t Cb,
                              int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < Ca; ++c) da[r * Ca + c] = dy[r * (Ca + Cb) + c];
    for (int64_t c = 0; c < Cb; ++c) db[r * Cb + c] = dy[r * (Ca + Cb) + Ca + c];
  }
}

}  // namespace replay::unet::ref
