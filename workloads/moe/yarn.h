// yarn.h: DeepSeek-V3's YaRN RoPE scaling (the released config's rope_scaling: type yarn, factor
// 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1.0,
// mscale_all_dim 1.0), as DeepseekV3YarnRotaryEmbedding and DeepseekV3Attention compute it:
//
//   frequencies: f_i = theta^(-2i / R) for the R / 2 channel pairs of the rotated part; with
//     d(r) = R ln(original_max_position / (2 pi r)) / (2 ln theta), the correction range
//     low = max(floor(d(beta_fast)), 0), high = min(ceil(d(beta_slow)), R - 1) (high += 0.001
//     when equal) and the ramp m_i = clamp((i - low) / (high - low), 0, 1):
//       f'_i = (f_i / factor) m_i + f_i (1 - m_i)
//     (the fastest pairs keep their frequency, the slowest are interpolated by the factor)
//   the cos/sin table scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), with
//     mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1)   (1 for DeepSeek-V3: both are 1.0)
//   the attention's softmax scale: 1 / sqrt(d_qk) times mscale(factor, mscale_all_dim)^2
//     (1.3689^2 = 1.874 for DeepSeek-V3)
//
// The table is built once on the host in fp64 and stored as fp32 (cos, sin) pairs in the layout of
// common/kernels/rope.h (table[pos * R / 2 + i]), so rope_forward / rope_backward apply it as they
// apply a plain table (the backward, the transposed rotation, stays exact with the amplitude).
#pragma once

#include <cstdint>
#include <vector>

namespace replay::moe {

struct YarnScaling {
  bool enabled = false;
  double factor = 40.0;
  double original_max_position = 4096.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 1.0;

  static YarnScaling deepseek_v3() {
    YarnScaling y;
    y.enabled = true;
    return y;
  }
};

// mscale(s, m) = 0.1 m ln(s) + 1, 1 for s <= 1.
double yarn_mscale(double factor, double mscale);

// The R / 2 rotation frequencies (plain theta^(-2i / R) when !yarn.enabled).
std::vector<double> rope_frequencies(int rope_dim, double theta, const YarnScaling& yarn);

// The cos/sin factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 when disabled).
double yarn_rope_amplitude(const YarnScaling& yarn);

// 1 / sqrt(qk_dim), times mscale(factor, mscale_all_dim)^2 with YaRN (mscale_all_dim != 0).
double mla_softmax_scale(int64_t qk_dim, const YarnScaling& yarn);

// [positions, R / 2] pairs (cos(p f_i) A, sin(p f_i) A) as 2 floats each, computed in fp64.
std::vector<float> yarn_rope_table(int positions, int rope_dim, double theta,
                                   const YarnScaling& yarn);

// Throws Error naming the setting out of range (factor >= 1, original positions >= 1,
// beta_fast > beta_slow > 0, mscales >= 0).
void check_yarn(const YarnScaling& yarn);

}  // namespace replay::moe
