// moe_reference.cpp: fp64 references of the MoE router and dispatch (see moe_reference.h).
#include "workloads/moe/moe_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "common/check.h"

namespace replay::moe::ref {
namespace {

constexpr double kNormEps = 1e-20;

// Candidates (value, index) in selection order: larger value first, then the lower index.
bool before(const std::pair<double, int>& a, const std::pair<double, int>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

}  // namespace

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

void router_select(int32_t* indices, double* margin, const double* logits, const double* bias,
                   const RouterShape& s) {
  check_router_shape(s);
  const int E = s.experts, G = s.groups, S = s.group_size(), k = s.topk;
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<double> b(E);
    for (int e = 0; e < E; ++e) b[e] = sigmoid(logits[t * E + e]) + (bias ? bias[e] : 0.0);
    double gap = std::numeric_limits<double>::infinity();

    std::vector<bool> kept(G, true);
    if (G > 1) {
      std::vector<std::pair<double, int>> groups;
      for (int g = 0; g < G; ++g) {
        std::vector<double> v(b.begin() + g * S, b.begin() + (g + 1) * S);
        std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<double>());
        groups.emplace_back(v[0] + v[1], g);
      }
      std::sort(groups.begin(), groups.end(), before);
      std::fill(kept.begin(), kept.end(), false);
      for (int r = 0; r < s.topk_groups; ++r) kept[groups[r].second] = true;
      if (s.topk_groups < G)
        gap = std::min(gap, groups[s.topk_groups - 1].first - groups[s.topk_groups].first);
    }

    std::vector<std::pair<double, int>> candidates;
    for (int e = 0; e < E; ++e)
      if (kept[e / S]) candidates.emplace_back(b[e], e);
    std::sort(candidates.begin(), candidates.end(), before);
    for (int j = 0; j < k; ++j) indices[t * k + j] = candidates[j].second;
    const int last = std::min<int>(k, static_cast<int>(candidates.size()) - 1);
    for (int j = 0; j < last; ++j)
      gap = std::min(gap, candidates[j].first - candidates[j + 1].first);
    if (margin != nullptr) margin[t] = gap;
  }
}

void router_weights(double* weights, const double* logits, const int32_t* indices,
                    const RouterShape& s) {
  const int E = s.experts, k = s.topk;
  for (int64_t t = 0; t < s.tokens; ++t) {
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += sigmoid(logits[t * E + indices[t * k + j]]);
    sum += kNormEps;
    for (int j = 0; j < k; ++j)
      weights[t * k + j] = s.route_scale * sigmoid(logits[t * E + indices[t * k + j]]) / sum;
  }
}

void router_backward(double* dlogits, const double* dweights, const double* logits,
                     const int32_t* indices, const RouterShape& s) {
  const int E = s.experts, k = s.topk;
  std::fill(dlogits, dlogits + s.tokens * E, 0.0);
  for (int64_t t = 0; t < s.tokens; ++t) {
    double sum = kNormEps, dot = 0.0;
    for (int j = 0; j < k; ++j) {
      const double sj = sigmoid(logits[t * E + indices[t * k + j]]);
      sum += sj;
      dot += dweights[t * k + j] * sj;
    }
    for (int j = 0; j < k; ++j) {
      const int e = indices[t * k + j];
      const double sj = sigmoid(logits[t * E + e]);
      const double ds = s.route_scale * (dweights[t * k + j] / sum - dot / (sum * sum));
      dlogits[t * E + e] = ds * sj * (1.0 - sj);
    }
  }
}

std::vector<int64_t> count_experts(const int32_t* indices, int64_t tokens, int topk, int experts) {
  std::vector<int64_t> load(experts, 0);
  for (int64_t a = 0; a < tokens * topk; ++a)
    if (indices[a] >= 0 && indices[a] < experts) ++load[indices[a]];
  return load;
}

void bias_update(double* bias, const std::vector<int64_t>& load, double rate) {
  const double mean = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0})) /
                      static_cast<double>(load.size());
  for (size_t e = 0; e < load.size(); ++e) {
    const double error = mean - static_cast<double>(load[e]);
    bias[e] += rate * (error > 0 ? 1.0 : error < 0 ? -1.0 : 0.0);
  }
}

double aux_loss(const double* logits, const int32_t* indices, const AuxLossShape& s,
                double* dlogits, double dloss) {
  REPLAY_REQUIRE(s.seq_len >= 1 && s.tokens % s.seq_len == 0, "seq_len must divide tokens");
  const int E = s.experts, k = s.topk;
  const int64_t B = s.sequences(), L = s.seq_len;
  double loss = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    for (int64_t t = b * L; t < (b + 1) * L; ++t) {
      for (int j = 0; j < k; ++j) {
        const int e = indices[t * k + j];
        if (e >= 0 && e < E) f[e] += static_cast<double>(E) / (static_cast<double>(k) * L);
      }
      double z = kNormEps;
      for (int e = 0; e < E; ++e) z += sigmoid(logits[t * E + e]);
      for (int e = 0; e < E; ++e) P[e] += sigmoid(logits[t * E + e]) / z / static_cast<double>(L);
    }
    for (int e = 0; e < E; ++e) loss += s.coeff * f[e] * P[e] / static_cast<double>(B);
    if (dlogits == nullptr) continue;
    // g_i = d loss / d q_{t,i} for every token of the sequence.
    std::vector<double> g(E);
    for (int e = 0; e < E; ++e) g[e] = dloss * s.coeff * f[e] / (static_cast<double>(B) * L);
    for (int64_t t = b * L; t < (b + 1) * L; ++t) {
      double z = kNormEps, dot = 0.0;
      for (int e = 0; e < E; ++e) z += sigmoid(logits[t * E + e]);
      for (int e = 0; e < E; ++e) dot += g[e] * sigmoid(logits[t * E + e]) / z;
      for (int e = 0; e < E; ++e) {
        const double se = sigmoid(logits[t * E + e]);
        dlogits[t * E + e] = (g[e] - dot) / z * se * (1.0 - se);
      }
    }
  }
  return loss;
}

Dispatch dispatch_index(const int32_t* indices, const DispatchShape& s) {
  check_dispatch_shape(s);
  const int E = s.experts;
  const bool capacity_mode = s.mode == DispatchMode::kCapacity;
  Dispatch d;
  d.routed_counts.assign(E, 0);
  d.expert_counts.assign(E, 0);
  d.expert_offsets.assign(E + 1, 0);
  d.slot_row.assign(s.assignments(), -1);
  d.row_source.assign(s.rows(), -1);
  // Each assignment's rank within its expert: a walk in (token, slot) order.
  std::vector<int32_t> rank(s.assignments(), -1);
  for (int64_t a = 0; a < s.assignments(); ++a) {
    const int32_t e = indices[a];
    if (e >= 0 && e < E) rank[a] = d.routed_counts[e]++;
  }
  for (int e = 0; e < E; ++e) {
    d.expert_counts[e] =
        capacity_mode ? std::min<int32_t>(d.routed_counts[e], s.capacity) : d.routed_counts[e];
    d.dropped += d.routed_counts[e] - d.expert_counts[e];
    d.expert_offsets[e + 1] = capacity_mode ? static_cast<int32_t>((e + 1) * s.capacity)
                                            : d.expert_offsets[e] + d.expert_counts[e];
  }
  for (int64_t a = 0; a < s.assignments(); ++a) {
    const int32_t e = indices[a];
    if (rank[a] < 0 || rank[a] >= d.expert_counts[e]) continue;
    const int32_t row = d.expert_offsets[e] + rank[a];
    d.slot_row[a] = row;
    d.row_source[row] = static_cast<int32_t>(a);
  }
  return d;
}

void gather(double* x_sorted, const double* x, const Dispatch& d, const DispatchShape& s,
            int64_t hidden) {
  for (int64_t row = 0; row < s.rows(); ++row) {
    const int32_t a = d.row_source[row];
    for (int64_t h = 0; h < hidden; ++h)
      x_sorted[row * hidden + h] = a < 0 ? 0.0 : x[(a / s.topk) * hidden + h];
  }
}

void gather_backward(double* dx, const double* dx_sorted, const Dispatch& d, const DispatchShape& s,
                     int64_t hidden) {
  std::fill(dx, dx + s.tokens * hidden, 0.0);
  for (int64_t a = 0; a < s.assignments(); ++a) {
    const int32_t row = d.slot_row[a];
    if (row < 0) continue;
    for (int64_t h = 0; h < hidden; ++h)
      dx[(a / s.topk) * hidden + h] += dx_sorted[row * hidden + h];
  }
}

void combine(double* out, const double* y_sorted, const double* weights, const Dispatch& d,
             const DispatchShape& s, int64_t hidden) {
  std::fill(out, out + s.tokens * hidden, 0.0);
  for (int64_t a = 0; a < s.assignments(); ++a) {
    const int32_t row = d.slot_row[a];
    if (row < 0) continue;
    for (int64_t h = 0; h < hidden; ++h)
      out[(a / s.topk) * hidden + h] += weights[a] * y_sorted[row * hidden + h];
  }
}

void combine_backward(double* dy_sorted, double* dweights, const double* dout,
                      const double* y_sorted, const double* weights, const Dispatch& d,
                      const DispatchShape& s, int64_t hidden) {
  std::fill(dy_sorted, dy_sorted + s.rows() * hidden, 0.0);
  for (int64_t a = 0; a < s.assignments(); ++a) {
    const int32_t row = d.slot_row[a];
    dweights[a] = 0.0;
    if (row < 0) continue;
    const double* g = dout + (a / s.topk) * hidden;
    for (int64_t h = 0; h < hidden; ++h) {
      dy_sorted[row * hidden + h] = weights[a] * g[h];
      dweights[a] += y_sorted[row * hidden + h] * g[h];
    }
  }
}

}  // namespace replay::moe::ref
