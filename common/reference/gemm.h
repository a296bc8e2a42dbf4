// reference/gemm.h: fp64 CPU reference for replay's GEMM: the same GemmDesc as common/gemm.h
// (row-major operands, transposes, leading dimensions, strided batch, alpha, beta, every epilogue),
// computed in double, plus the tanh-approximation GeLU and its derivative.
#pragma once

#include "common/gemm.h"

namespace replay::ref {

// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
double gelu_tanh(double x);
// d gelu / dx of the same formula.
double gelu_tanh_grad(double x);

// Operands in the desc's layout (A, B and C with their leading dimensions and batch strides; D, C
// and the aux matrix as GemmDesc says: aux packed [batch][m][n]). Inputs are what the GPU read
// (already rounded to the storage type); outputs are exact. Pointers an epilogue does not use stay
// null.
struct GemmRefArgs {
  const double* a = nullptr;
  const double* b = nullptr;
  const double* c = nullptr;     // beta 1: the matrix added (the GPU's C, or D's previous contents)
  const double* bias = nullptr;  // kBias, kBiasGelu, kBiasGeluAux
  const double* aux_in = nullptr;  // kDGelu, kDGeluBGrad: the pre-activation
  double* d = nullptr;
  double* aux_out = nullptr;    // kGeluAux, kBiasGeluAux: the pre-activation
  double* bias_grad = nullptr;  // kDGeluBGrad, kBGradA, kBGradB
};

// D = epilogue(alpha * op(A) op(B) + beta * C), with the epilogue's extra outputs. Throws Error
// when a pointer the desc needs is missing.
void gemm(const GemmDesc& desc, const GemmRefArgs& args);

}  // namespace replay::ref
