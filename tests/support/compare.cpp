// compare.cpp: the tolerance table and comparison helpers.
#include "tests/support/compare.h"

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>

namespace replay::test {

// Tolerances are for GPU output against an fp64 CPU reference fed the same (bf16-rounded) inputs.
// bf16 outputs carry a rounding error of up to 2^-8 relative; fp32 outputs depend on the reduction
// length. Keep entries tight: a loose tolerance hides indexing bugs.
Tolerance tolerance(const std::string& key) {
  static const std::map<std::string, Tolerance> table = {
      // key                          atol     rtol
      // Pointwise/norm bf16 outputs: fp32 math, one final rounding; rtol is twice the worst bf16
      // rounding error (2^-8 relative), atol covers values near zero.
      {"layernorm.fwd.bf16", {2e-3, 8e-3}},
      {"layernorm.bwd.bf16", {2e-3, 8e-3}},
      {"layernorm.bwd_param.fp32", {1e-4, 1e-4}},
      {"rmsnorm.fwd.bf16", {2e-3, 8e-3}},
      {"rmsnorm.bwd.bf16", {2e-3, 8e-3}},
      {"rmsnorm.bwd_param.fp32", {1e-4, 1e-4}},
      {"stats.fp32", {1e-5, 1e-5}},
      {"swiglu.fwd.bf16", {2e-3, 8e-3}},
      {"swiglu.bwd.bf16", {2e-3, 8e-3}},
      {"gelu.fwd.bf16", {2e-3, 8e-3}},
      {"gelu.bwd.bf16", {2e-3, 8e-3}},
      {"rope.fwd.bf16", {2e-3, 8e-3}},
      {"rope.bwd.bf16", {2e-3, 8e-3}},
      {"rope.table.fp32", {1e-6, 0.0}},
      {"dropout_residual.fwd.bf16", {2e-3, 8e-3}},
      {"dropout_residual.bwd.bf16", {2e-3, 8e-3}},
      {"dropout_residual.bwd_bias.fp32", {1e-4, 1e-4}},
      {"embedding.fwd.bf16", {1e-6, 5e-3}},
      {"embedding.bwd.fp32", {1e-4, 1e-4}},
      {"cross_entropy.loss.fp32", {1e-4, 1e-4}},
      {"cross_entropy.bwd.bf16", {1e-6, 5e-3}},
      {"adamw.param.fp32", {1e-6, 1e-6}},
      {"adamw.state.fp32", {1e-6, 1e-6}},
      {"grad_norm.fp32", {0.0, 1e-6}},
      {"gemm.bf16", {2e-2, 1e-2}},
      {"gemm.fp32", {1e-3, 1e-3}},
      {"gemm.fp8", {1e-2, 1e-2}},
      // attention: atol is a fraction of the tensor's largest |ref| (test_attention_gpu.cpp)
      {"attention.fwd.bf16", {1e-2, 1e-2}},
      {"attention.bwd.bf16", {2e-2, 2e-2}},
      {"attention.fwd.fp16", {5e-3, 5e-3}},
      {"attention.bwd.fp16", {1e-2, 1e-2}},
      {"attention.lse.fp32", {5e-4, 5e-5}},
  };
  auto it = table.find(key);
  if (it == table.end()) throw std::invalid_argument("no tolerance for '" + key + "' in the table");
  return it->second;
}

::testing::AssertionResult all_close(const std::string& what, const float* got, const double* ref,
                                     size_t n, Tolerance tol) {
  size_t failures = 0, worst = 0;
  double worst_excess = -1.0;
  std::ostringstream first;
  for (size_t i = 0; i < n; ++i) {
    const double g = got[i], r = ref[i];
    const double err = std::fabs(g - r);
    const double allowed = tol.atol + tol.rtol * std::fabs(r);
    const bool bad = !(err <= allowed) || (std::isfinite(r) && !std::isfinite(g));
    if (!bad) continue;
    if (failures < 4) first << "\n    [" << i << "] got " << g << " ref " << r << " err " << err;
    ++failures;
    const double excess = std::isfinite(err) ? err - allowed : 1e300;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << failures << " of " << n << " elements outside atol " << tol.atol
         << " rtol " << tol.rtol << "; worst [" << worst << "] got " << got[worst] << " ref "
         << ref[worst] << " err " << std::fabs(got[worst] - ref[worst])
         << "; first:" << first.str();
}

::testing::AssertionResult all_close(const std::string& what, const std::vector<float>& got,
                                     const std::vector<double>& ref, Tolerance tol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " against reference size " << ref.size();
  return all_close(what, got.data(), ref.data(), got.size(), tol);
}

::testing::AssertionResult bit_equal(const std::string& what, const void* a, const void* b,
                                     size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < bytes; ++i) {
    if (x[i] != y[i])
      return ::testing::AssertionFailure()
             << what << ": first differing byte at " << i << " (word " << i / 4 << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<float> random_uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

std::vector<float> random_normal(size_t n, uint64_t seed, float mean, float stddev) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16_rn(x[i]);
  return y;
}

std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

std::vector<float> round_bf16(const std::vector<float>& x) {
  return from_bf16(to_bf16(x));
}

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

std::vector<double> numeric_grad(std::vector<double>& v, const std::function<double()>& loss,
                                 double h) {
  std::vector<double> g(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double saved = v[i];
    v[i] = saved + h;
    const double up = loss();
    v[i] = saved - h;
    const double down = loss();
    v[i] = saved;
    g[i] = (up - down) / (2.0 * h);
  }
  return g;
}

::testing::AssertionResult grad_close(const std::string& what, const std::vector<double>& analytic,
                                      const std::vector<double>& numeric, double tol) {
  if (analytic.size() != numeric.size())
    return ::testing::AssertionFailure() << what << ": size mismatch";
  double scale = 0.0, worst_err = -1.0;
  size_t worst = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    scale = std::max(scale, std::fabs(numeric[i]));
    const double err = std::fabs(analytic[i] - numeric[i]);
    if (!(err <= worst_err)) {
      worst_err = err;
      worst = i;
    }
  }
  if (scale > 0.0 && worst_err <= tol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": worst [" << worst << "] analytic " << analytic[worst] << " numeric "
         << numeric[worst] << " error " << worst_err << " against scale " << scale;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

uint16_t to_bits(float v, DType t) {
  return t == DType::kFP16 ? __half_as_ushort(__float2half_rn(v))
                           : __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

float from_bits(uint16_t b, DType t) {
  return t == DType::kFP16 ? __half2float(__ushort_as_half(b))
                           : __bfloat162float(__ushort_as_bfloat16(b));
}

std::vector<uint16_t> to_storage(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = to_bits(v[i], t);
  return r;
}

std::vector<float> from_storage(const std::vector<uint16_t>& v, DType t) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_bits(v[i], t);
  return r;
}

}  // namespace replay::test
