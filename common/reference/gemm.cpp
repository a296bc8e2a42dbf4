// reference/gemm.cpp: fp64 GEMM with replay's epilogues, straight from the definitions in gemm.h.
#include "common/reference/gemm.h"

#include <cmath>

#include "common/check.h"

namespace replay::ref {

namespace {
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCubic = 0.044715;
}  // namespace

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
}

double gelu_tanh_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const double dinner = kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * x * x);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner;
}

void gemm(const GemmDesc& desc, const GemmRefArgs& args) {
  const GemmDesc g = desc.normalized();
  const Epilogue e = g.epilogue;
  REPLAY_REQUIRE(args.a && args.b && args.d, "reference GEMM needs A, B and D");
  REPLAY_REQUIRE(g.beta == 0.0f || args.c, "reference GEMM with beta 1 needs C");
  REPLAY_REQUIRE(!epilogue_reads_bias(e) || args.bias, "this epilogue needs the bias");
  REPLAY_REQUIRE(!epilogue_reads_aux(e) || args.aux_in, "this epilogue needs the aux input");
  REPLAY_REQUIRE(!epilogue_writes_aux(e) || args.aux_out, "this epilogue writes the aux output");
  REPLAY_REQUIRE(!epilogue_writes_bias_grad(e) || (args.bias_grad && g.batch == 1),
                 "bias-gradient epilogues write bias_grad and need batch 1");

  auto a_at = [&](const double* a, int64_t i, int64_t kk) {
    return g.trans_a ? a[kk * g.lda + i] : a[i * g.lda + kk];
  };
  auto b_at = [&](const double* b, int64_t kk, int64_t j) {
    return g.trans_b ? b[j * g.ldb + kk] : b[kk * g.ldb + j];
  };

  for (int64_t bt = 0; bt < g.batch; ++bt) {
    const double* a = args.a + bt * g.stride_a;
    const double* b = args.b + bt * g.stride_b;
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double z = 0.0;
        for (int64_t kk = 0; kk < g.k; ++kk) z += a_at(a, i, kk) * b_at(b, kk, j);
        const int64_t di = bt * g.stride_d + i * g.ldd + j;
        const int64_t xi = (bt * g.m + i) * g.n + j;  // packed aux index
        z = static_cast<double>(g.alpha) * z;
        if (g.beta != 0.0f) z += static_cast<double>(g.beta) * args.c[di];
        if (epilogue_reads_bias(e)) z += args.bias[j];
        double out = z;
        switch (e) {
          case Epilogue::kGelu:
          case Epilogue::kBiasGelu:
            out = gelu_tanh(z);
            break;
          case Epilogue::kGeluAux:
          case Epilogue::kBiasGeluAux:
            args.aux_out[xi] = z;
            out = gelu_tanh(z);
            break;
          case Epilogue::kDGelu:
          case Epilogue::kDGeluBGrad:
            out = z * gelu_tanh_grad(args.aux_in[xi]);
            break;
          default:
            break;
        }
        args.d[di] = out;
      }
    }
  }

  // Bias gradients (batch 1): sums over rows of D, or over k of op(A) / op(B).
  if (e == Epilogue::kDGeluBGrad) {
    for (int64_t j = 0; j < g.n; ++j) {
      double s = 0.0;
      for (int64_t i = 0; i < g.m; ++i) s += args.d[i * g.ldd + j];
      args.bias_grad[j] = s;
    }
  } else if (e == Epilogue::kBGradA) {
    for (int64_t i = 0; i < g.m; ++i) {
      double s = 0.0;
      for (int64_t kk = 0; kk < g.k; ++kk) s += a_at(args.a, i, kk);
      args.bias_grad[i] = s;
    }
  } else if (e == Epilogue::kBGradB) {
    for (int64_t j = 0; j < g.n; ++j) {
      double s = 0.0;
      for (int64_t kk = 0; kk < g.k; ++kk) s += b_at(args.b, kk, j);
      args.bias_grad[j] = s;
    }
  }
}

}  // namespace replay::ref
