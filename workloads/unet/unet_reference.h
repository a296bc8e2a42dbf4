// unet_reference.h: fp64 CPU references for the UNet's GroupNorm(+SiLU) and convolutions, with the
// GPU ops' layouts and conventions (group_norm.h, conv.h): NHWC activations, [K, R, S, C] filters.
// Naive loops: meant for test shapes, not for speed.
#pragma once

#include <cstdint>

namespace replay::unet::ref {

// GroupNorm over x [N, HW, C] in groups of C / G channels; biased variance; mean and rstd [N, G].
// out = y or silu(y), y = (x - mean) * rstd * gamma + beta.
void group_norm_forward(double* out, double* mean, double* rstd, const double* x,
                        const double* gamma, const double* beta, int64_t N, int64_t HW, int C,
                        int G, double eps, bool silu);

// dx [N, HW, C], dgamma and dbeta [C] (overwritten), from the saved mean and rstd; with silu, y is
// recomputed from x and the statistics.
void group_norm_backward(double* dx, double* dgamma, double* dbeta, const double* dout,
                         const double* x, const double* gamma, const double* beta,
                         const double* mean, const double* rstd, int64_t N, int64_t HW, int C,
                         int G, bool silu);

struct ConvShape {
  int64_t n = 1, h = 1, w = 1, c = 1, k = 1;
  int64_t kernel = 3, stride = 1, padding = 1;

  int64_t p() const { return (h + 2 * padding - kernel) / stride + 1; }
  int64_t q() const { return (w + 2 * padding - kernel) / stride + 1; }
};

// y [n, p, q, k] = sum over r, s, c of x[n, p * stride - padding + r, q * stride - padding + s, c]
// * w[k, r, s, c] (+ bias[k]; bias may be null). Positions outside x are zero.
void conv2d_forward(double* y, const double* x, const double* w, const double* bias,
                    const ConvShape& s);
// dx [n, h, w, c] = d(sum(dy * y)) / dx (overwritten).
void conv2d_dgrad(double* dx, const double* dy, const double* w, const ConvShape& s);
// dw [k, r, s, c] = d(sum(dy * y)) / dw (overwritten).
void conv2d_wgrad(double* dw, const double* dy, const double* x, const ConvShape& s);
// db [k] = sum over rows of dy [rows, k] (overwritten).
void bias_grad(double* db, const double* dy, int64_t rows, int64_t k);

}  // namespace replay::unet::ref
