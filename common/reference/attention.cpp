// reference/attention.cpp: fp64 attention forward and backward, one (batch, query head, query row)
// at a time, straight from the definitions.
#include "common/reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace replay::reference {
namespace {

// Element offsets of one row of each token-major tensor.
struct Index {
  const AttentionShape& s;
  int64_t q(int64_t b, int64_t i, int64_t h) const {
    return ((b * s.seq_q + i) * s.heads_q + h) * s.dim_qk;
  }
  int64_t k(int64_t b, int64_t j, int64_t g) const {
    return ((b * s.seq_kv + j) * s.heads_kv + g) * s.dim_qk;
  }
  int64_t v(int64_t b, int64_t j, int64_t g) const {
    return ((b * s.seq_kv + j) * s.heads_kv + g) * s.dim_v;
  }
  int64_t o(int64_t b, int64_t i, int64_t h) const {
    return ((b * s.seq_q + i) * s.heads_q + h) * s.dim_v;
  }
  int64_t lse(int64_t b, int64_t h, int64_t i) const { return (b * s.heads_q + h) * s.seq_q + i; }
  // Keys 0..visible(i)-1 are seen by query i.
  int64_t visible(int64_t i) const { return s.causal ? std::min(i + 1, s.seq_kv) : s.seq_kv; }
  int64_t kv_head(int64_t h) const { return h / (s.heads_q / s.heads_kv); }
};

// Softmax probabilities p[0..n) of query row (b, i, h) and its log-sum-exp.
double softmax_row(const AttentionShape& s, const Index& ix, const double* q, const double* k,
                   int64_t b, int64_t i, int64_t h, std::vector<double>& p) {
  const int64_t n = ix.visible(i), g = ix.kv_head(h);
  const double* qi = q + ix.q(b, i, h);
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const double* kj = k + ix.k(b, j, g);
    double dot = 0.0;
    for (int64_t d = 0; d < s.dim_qk; ++d) dot += qi[d] * kj[d];
    p[j] = s.scale * dot;
    m = std::max(m, p[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - m);
  const double lse = m + std::log(sum);
  for (int64_t j = 0; j < n; ++j) p[j] = std::exp(p[j] - lse);
  return lse;
}

}  // namespace

void attention_forward(const AttentionShape& s, const double* q, const double* k, const double* v,
                       double* o, double* lse) {
  const Index ix{s};
  std::vector<double> p(static_cast<size_t>(s.seq_kv));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h)
      for (int64_t i = 0; i < s.seq_q; ++i) {
        lse[ix.lse(b, h, i)] = softmax_row(s, ix, q, k, b, i, h, p);
        double* oi = o + ix.o(b, i, h);
        std::fill(oi, oi + s.dim_v, 0.0);
        for (int64_t j = 0; j < ix.visible(i); ++j) {
          const double* vj = v + ix.v(b, j, ix.kv_head(h));
          for (int64_t d = 0; d < s.dim_v; ++d) oi[d] += p[j] * vj[d];
        }
      }
}

void attention_backward(const AttentionShape& s, const double* q, const double* k, const double* v,
                        const double* d_o, double* dq, double* dk, double* dv) {
  const Index ix{s};
  std::fill(dq, dq + s.batch * s.seq_q * s.heads_q * s.dim_qk, 0.0);
  std::fill(dk, dk + s.batch * s.seq_kv * s.heads_kv * s.dim_qk, 0.0);
  std::fill(dv, dv + s.batch * s.seq_kv * s.heads_kv * s.dim_v, 0.0);
  std::vector<double> p(static_cast<size_t>(s.seq_kv)), dp(static_cast<size_t>(s.seq_kv));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h)
      for (int64_t i = 0; i < s.seq_q; ++i) {
        softmax_row(s, ix, q, k, b, i, h, p);
        const int64_t n = ix.visible(i), g = ix.kv_head(h);
        const double* doi = d_o + ix.o(b, i, h);
        // dP_ij = dO_i . v_j;  dV_j += P_ij dO_i;  D_i = sum_j P_ij dP_ij
        double row_dot = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          const double* vj = v + ix.v(b, j, g);
          double* dvj = dv + ix.v(b, j, g);
          double dot = 0.0;
          for (int64_t d = 0; d < s.dim_v; ++d) {
            dot += doi[d] * vj[d];
            dvj[d] += p[j] * doi[d];
          }
          dp[j] = dot;
          row_dot += p[j] * dot;
        }
        // dS_ij = P_ij (dP_ij - D_i); the scores were scale * q.k, so dQ and dK carry the scale.
        const double* qi = q + ix.q(b, i, h);
        double* dqi = dq + ix.q(b, i, h);
        for (int64_t j = 0; j < n; ++j) {
          const double ds = s.scale * p[j] * (dp[j] - row_dot);
          const double* kj = k + ix.k(b, j, g);
          double* dkj = dk + ix.k(b, j, g);
          for (int64_t d = 0; d < s.dim_qk; ++d) {
            dqi[d] += ds * kj[d];
            dkj[d] += ds * qi[d];
          }
        }
      }
}

}  // namespace replay::reference
