// pointwise_reference.h: fp64 CPU references for pointwise.h's kernels (GEGLU, nearest-neighbour
// 2x upsampling, skip concatenation), with their layouts and conventions. Naive loops for tests.
#pragma once

#include <cstdint>

namespace replay::unet::ref {

// The exact GELU, x * Phi(x), and its derivative Phi(x) + x * phi(x).
double gelu(double x);
double gelu_grad(double x);

// out [rows, F] = in[:, :F] * gelu(in[:, F:]); in [rows, 2F].
void geglu_forward(double* out, const double* in, int64_t rows, int64_t F);
// din [rows, 2F] (overwritten) from dout [rows, F].
void geglu_backward(double* din, const double* dout, const double* in, int64_t rows, int64_t F);

// y [N, 2H, 2W, C] from x [N, H, W, C]; dx [N, H, W, C] (overwritten) sums the four dy of each
// source pixel.
void upsample_nearest2x_forward(double* y, const double* x, int64_t N, int64_t H, int64_t W,
                                int64_t C);
void upsample_nearest2x_backward(double* dx, const double* dy, int64_t N, int64_t H, int64_t W,
                                 int64_t C);

// y [rows, Ca + Cb] = [a, b]; da, db (overwritten) the two column blocks of dy.
void concat_channels_forward(double* y, const double* a, int64_t Ca, const double* b, int64_t Cb,
                             int64_t rows);
void concat_channels_backward(double* da, double* db, const double* dy, int64_t Ca, int64_t Cb,
                              int64_t rows);

}  // namespace replay::unet::ref
