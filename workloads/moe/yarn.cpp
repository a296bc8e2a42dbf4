// yarn.cpp: DeepSeek-V3's YaRN RoPE scaling (yarn.h).
#include "workloads/moe/yarn.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/check.h"

namespace replay::moe {

double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

void check_yarn(const YarnScaling& y) {
  if (!y.enabled) return;
  auto need = [](bool ok, const std::string& what) { REPLAY_REQUIRE(ok, "YaRN: " + what); };
  need(std::isfinite(y.factor) && y.factor >= 1.0, "the factor must be at least 1");
  need(std::isfinite(y.original_max_position) && y.original_max_position >= 1.0,
       "the original maximum position must be at least 1");
  need(std::isfinite(y.beta_fast) && std::isfinite(y.beta_slow) && y.beta_slow > 0.0 &&
           y.beta_fast > y.beta_slow,
       "beta_fast must exceed beta_slow > 0");
  need(std::isfinite(y.mscale) && std::isfinite(y.mscale_all_dim) && y.mscale >= 0.0 &&
           y.mscale_all_dim >= 0.0,
       "the mscales must be finite and non-negative");
}

std::vector<double> rope_frequencies(int rope_dim, double theta, const YarnScaling& y) {
  const int half = rope_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i)
    f[static_cast<size_t>(i)] = std::pow(theta, -2.0 * i / static_cast<double>(rope_dim));
  if (!y.enabled) return f;
  check_yarn(y);
  const double two_pi = 2.0 * 3.14159265358979323846;
  auto correction = [&](double rotations) {
    return static_cast<double>(rope_dim) *
           std::log(y.original_max_position / (rotations * two_pi)) / (2.0 * std::log(theta));
  };
  const double low = std::max(std::floor(correction(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction(y.beta_slow)), static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    double& fi = f[static_cast<size_t>(i)];
    fi = fi / y.factor * ramp + fi * (1.0 - ramp);
  }
  return f;
}

double yarn_rope_amplitude(const YarnScaling& y) {
  if (!y.enabled) return 1.0;
  return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
}

double mla_softmax_scale(int64_t qk_dim, const YarnScaling& y) {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_dim));
  if (y.enabled && y.mscale_all_dim != 0.0) {
    const double m = yarn_mscale(y.factor, y.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

std::vector<float> yarn_rope_table(int positions, int rope_dim, double theta,
                                   const YarnScaling& y) {
  REPLAY_REQUIRE(positions >= 1 && rope_dim >= 2 && rope_dim % 2 == 0,
                 "yarn_rope_table: positions >= 1 and an even rope_dim");
  const std::vector<double> f = rope_frequencies(rope_dim, theta, y);
  const double amp = yarn_rope_amplitude(y);
  const int half = rope_dim / 2;
  std::vector<float> table(static_cast<size_t>(positions) * static_cast<size_t>(rope_dim));
  for (int p = 0; p < positions; ++p)
    for (int i = 0; i < half; ++i) {
      const double a = static_cast<double>(p) * f[static_cast<size_t>(i)];
      const size_t k =
          (static_cast<size_t>(p) * static_cast<size_t>(half) + static_cast<size_t>(i)) * 2;
      table[k] = static_cast<float>(std::cos(a) * amp);
      table[k + 1] = static_cast<float>(std::sin(a) * amp);
    }
  return table;
}

}  // namespace replay::moe
