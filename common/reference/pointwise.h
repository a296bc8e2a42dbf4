// pointwise.h: fp64 CPU references for the pointwise and normalization kernels (norms, SwiGLU,
// GeLU, RoPE, fused bias + dropout + residual), forward and backward, with the kernels'
// conventions.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kernels/rope.h"  // RopeLayout, RopeScaling

namespace replay::ref {

// LayerNorm over rows of width C (biased variance); mean and rstd are [rows].
void layernorm_forward(double* out, double* mean, double* rstd, const double* x,
                       const double* gamma, const double* beta, int64_t rows, int C, double eps);
// dx [rows, C], dgamma and dbeta [C] (overwritten), from the saved mean and rstd.
void layernorm_backward(double* dx, double* dgamma, double* dbeta, const double* dout,
                        const double* x, const double* gamma, const double* mean,
                        const double* rstd, int64_t rows, int C);

void rmsnorm_forward(double* out, double* rstd, const double* x, const double* gamma, int64_t rows,
                     int C, double eps);
void rmsnorm_backward(double* dx, double* dgamma, const double* dout, const double* x,
                      const double* gamma, const double* rstd, int64_t rows, int C);

// SwiGLU on in [M, 2F] (gate | up) -> out [M, F]; backward -> din [M, 2F].
void swiglu_forward(double* out, const double* in, int64_t M, int F);
void swiglu_backward(double* din, const double* dout, const double* in, int64_t M, int F);

// GeLU, tanh approximation, over n elements.
void gelu_forward(double* out, const double* x, int64_t n);
void gelu_backward(double* dx, const double* dout, const double* x, int64_t n);

// The rotary frequencies f_i, i < rope_dim / 2 (see rope.h), and the table of their cos and sin,
// [max_positions, rope_dim / 2] each.
std::vector<double> rope_frequencies(int rope_dim, double theta, const RopeScaling& scaling);
void rope_table(double* cos_out, double* sin_out, int max_positions, int rope_dim, double theta,
                const RopeScaling& scaling);
// Rotation of x [B, S, H, D] (layout as in rope.h) by +angle (forward) or -angle (backward), angles
// pos * f_i computed in fp64; positions [B * S] or null for pos = s. Channels outside the rotated
// range are copied.
void rope_forward(double* out, const double* x, const std::vector<double>& freqs,
                  const int32_t* positions, const RopeLayout& layout);
void rope_backward(double* dx, const double* dout, const std::vector<double>& freqs,
                   const int32_t* positions, const RopeLayout& layout);

// Dropout keep mask of n elements (1 = kept), drawn with philox_block on the host exactly as the
// kernels draw it (dropout.h): position = slot offset + op offset.
std::vector<uint8_t> dropout_keep_mask(int64_t n, float p, uint64_t seed, uint64_t position);
// out = residual + mask * (x + bias) / (1 - p); bias [C] and residual [rows, C] may be null.
void dropout_residual_forward(double* out, const double* x, const double* bias,
                              const double* residual, int64_t rows, int C, float p, uint64_t seed,
                              uint64_t position);
// dx = dout * mask / (1 - p); dbias = column sums of dx (skipped when null).
void dropout_residual_backward(double* dx, double* dbias, const double* dout, int64_t rows, int C,
                               float p, uint64_t seed, uint64_t position);

}  // namespace replay::ref
