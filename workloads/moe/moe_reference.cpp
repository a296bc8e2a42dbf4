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

EpExchange ep_exchange(const std::vector<std::vector<int32_t>>& indices, int64_t tokens, int topk,
                       int experts, int ranks, int64_t capacity) {
  REPLAY_REQUIRE(ranks >= 1 && experts % ranks == 0 && static_cast<int>(indices.size()) == ranks,
                 "ep_exchange: the ranks must divide the experts, one index set per rank");
  EpExchange x;
  x.layout = EpLayout{ranks, experts / ranks, capacity};
  x.experts = experts, x.topk = topk, x.tokens = tokens;
  const int L = x.layout.local_experts;
  for (int s = 0; s < ranks; ++s)
    x.send.push_back(dispatch_index(indices[s].data(), x.send_shape()));
  x.received.assign(ranks, std::vector<int32_t>(static_cast<size_t>(ranks) * L, 0));
  x.local_rows.assign(
      ranks, std::vector<std::pair<int, int32_t>>(static_cast<size_t>(x.layout.rows()), {-1, -1}));
  for (int d = 0; d < ranks; ++d)
    for (int s = 0; s < ranks; ++s)
      for (int l = 0; l < L; ++l) {
        x.received[d][s * L + l] = x.send[s].expert_counts[d * L + l];
        for (int64_t i = 0; i < capacity; ++i) {
          const int32_t a = x.send[s].row_source[ep_send_row(d, l, i, L, capacity)];
          if (a >= 0) x.local_rows[d][ep_local_row(s, l, i, ranks, capacity)] = {s, a};
        }
      }
  return x;
}

std::vector<std::vector<double>> ep_all_to_all(const std::vector<std::vector<double>>& buffers,
                                               int ranks, int64_t hidden) {
  REPLAY_REQUIRE(static_cast<int>(buffers.size()) == ranks, "ep_all_to_all: a buffer per rank");
  const size_t block = buffers[0].size() / static_cast<size_t>(ranks);
  REPLAY_REQUIRE(block % static_cast<size_t>(hidden) == 0, "ep_all_to_all: whole rows per block");
  std::vector<std::vector<double>> out(ranks, std::vector<double>(buffers[0].size()));
  for (int s = 0; s < ranks; ++s)
    for (int d = 0; d < ranks; ++d)
      std::copy(buffers[s].begin() + static_cast<int64_t>(d * block),
                buffers[s].begin() + static_cast<int64_t>((d + 1) * block),
                out[d].begin() + static_cast<int64_t>(s * block));
  return out;
}

std::vector<double> ep_permute(const std::vector<double>& in, const std::vector<int32_t>& received,
                               const EpLayout& e, int64_t hidden, bool to_local) {
  std::vector<double> out(in.size(), 0.0);
  for (int s = 0; s < e.ranks; ++s)
    for (int l = 0; l < e.local_experts; ++l)
      for (int64_t i = 0; i < received[s * e.local_experts + l]; ++i) {
        const int64_t x = ep_send_row(s, l, i, e.local_experts, e.capacity);
        const int64_t y = ep_local_row(s, l, i, e.ranks, e.capacity);
        const int64_t from = to_local ? x : y, to = to_local ? y : x;
        for (int64_t h = 0; h < hidden; ++h) out[to * hidden + h] = in[from * hidden + h];
      }
  return out;
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

// ---- MLA
// ------------------------------------------------------------------------------------------

namespace replay::moe::ref {

namespace {

using Vec = std::vector<double>;

// DeepSeek-V3's yarn_get_mscale(scale, mscale): 0.1 mscale ln(scale) + 1, 1 for scale <= 1.
double get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// Y[M, out] = X[M, in] W[out, in]^T.
Vec linear(const Vec& X, const Vec& W, int64_t M, int64_t in, int64_t out) {
  Vec Y(static_cast<size_t>(M * out), 0.0);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i)
        s += X[static_cast<size_t>(t * in + i)] * W[static_cast<size_t>(o * in + i)];
      Y[static_cast<size_t>(t * out + o)] = s;
    }
  return Y;
}

// dX (+)= dY W, dW = dY^T X.
void linear_backward(const Vec& dY, const Vec& X, const Vec& W, int64_t M, int64_t in, int64_t out,
                     Vec& dX, Vec& dW) {
  if (dX.empty()) dX.assign(static_cast<size_t>(M * in), 0.0);
  dW.assign(static_cast<size_t>(out * in), 0.0);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t o = 0; o < out; ++o) {
      const double g = dY[static_cast<size_t>(t * out + o)];
      for (int64_t i = 0; i < in; ++i) {
        dX[static_cast<size_t>(t * in + i)] += g * W[static_cast<size_t>(o * in + i)];
        dW[static_cast<size_t>(o * in + i)] += g * X[static_cast<size_t>(t * in + i)];
      }
    }
}

// y = x * r * g per row, r = 1 / sqrt(mean(x^2) + eps).
Vec rmsnorm(const Vec& X, const Vec& g, int64_t M, int64_t C, double eps, Vec* r) {
  Vec Y(X.size());
  r->assign(static_cast<size_t>(M), 0.0);
  for (int64_t t = 0; t < M; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c)
      ss += X[static_cast<size_t>(t * C + c)] * X[static_cast<size_t>(t * C + c)];
    const double rr = 1.0 / std::sqrt(ss / static_cast<double>(C) + eps);
    (*r)[static_cast<size_t>(t)] = rr;
    for (int64_t c = 0; c < C; ++c)
      Y[static_cast<size_t>(t * C + c)] =
          X[static_cast<size_t>(t * C + c)] * rr * g[static_cast<size_t>(c)];
  }
  return Y;
}

// dx (+)= r (g dy) - x r^3 / C * sum(g dy x); dg = sum over rows of dy x r.
void rmsnorm_backward(const Vec& dY, const Vec& X, const Vec& g, const Vec& r, int64_t M, int64_t C,
                      Vec& dX, Vec& dg) {
  if (dX.empty()) dX.assign(static_cast<size_t>(M * C), 0.0);
  dg.assign(static_cast<size_t>(C), 0.0);
  for (int64_t t = 0; t < M; ++t) {
    const double rr = r[static_cast<size_t>(t)];
    double s = 0;
    for (int64_t c = 0; c < C; ++c) {
      const auto i = static_cast<size_t>(t * C + c);
      s += g[static_cast<size_t>(c)] * dY[i] * X[i];
      dg[static_cast<size_t>(c)] += dY[i] * X[i] * rr;
    }
    for (int64_t c = 0; c < C; ++c) {
      const auto i = static_cast<size_t>(t * C + c);
      dX[i] +=
          rr * g[static_cast<size_t>(c)] * dY[i] - X[i] * rr * rr * rr / static_cast<double>(C) * s;
    }
  }
}

// Rotates channels [off, off + R) of each of `heads` heads (head width D) of every token in place;
// backward: by the negative angle.
void rope(Vec& X, const MlaRefDims& d, int64_t heads, int64_t D, int64_t off, bool backward) {
  const int64_t R = d.rope, half = R / 2;
  const double amp = d.yarn.enabled ? get_mscale(d.yarn.factor, d.yarn.mscale) /
                                          get_mscale(d.yarn.factor, d.yarn.mscale_all_dim)
                                    : 1.0;
  for (int64_t t = 0; t < d.tokens(); ++t) {
    const auto pos = static_cast<double>(t % d.seq);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double a = pos * rope_frequency(i, R, d.theta, d.yarn);
        const double c = amp * std::cos(a), s = amp * (backward ? -std::sin(a) : std::sin(a));
        const auto lo = static_cast<size_t>((t * heads + h) * D + off + i);
        const auto hi = lo + static_cast<size_t>(half);
        const double x0 = X[lo], x1 = X[hi];
        X[lo] = x0 * c - x1 * s;
        X[hi] = x1 * c + x0 * s;
      }
  }
}

}  // namespace

double rope_frequency(int64_t i, int64_t R, double theta, const YarnScaling& y) {
  // freq_extra and freq_inter as DeepSeek's code builds them: 1 / theta^(2i / R), the latter
  // divided by the factor.
  const double extra = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(R));
  if (!y.enabled) return extra;
  const double inter =
      1.0 / (y.factor * std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(R)));
  // yarn_find_correction_dim(num_rotations, dim, base, max_position_embeddings)
  auto dim_of = [&](double rotations) {
    return (static_cast<double>(R) *
            std::log(y.original_max_position / (rotations * 2.0 * 3.141592653589793))) /
           (2.0 * std::log(theta));
  };
  double low = std::floor(dim_of(y.beta_fast)), high = std::ceil(dim_of(y.beta_slow));
  low = low < 0.0 ? 0.0 : low;
  high = high > static_cast<double>(R - 1) ? static_cast<double>(R - 1) : high;
  if (low == high) high += 0.001;  // yarn_linear_ramp_mask's guard
  double ramp = (static_cast<double>(i) - low) / (high - low);
  ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
  const double inv_freq_mask = 1.0 - ramp;
  return inter * (1.0 - inv_freq_mask) + extra * inv_freq_mask;
}

double mla_scale(const MlaRefDims& d) {
  double s = std::pow(static_cast<double>(d.qk()), -0.5);
  if (d.yarn.enabled && d.yarn.mscale_all_dim != 0.0) {
    const double m = get_mscale(d.yarn.factor, d.yarn.mscale_all_dim);
    s = s * m * m;
  }
  return s;
}

MlaRefWeights MlaRefWeights::zeros(const MlaRefDims& d) {
  const int64_t C = d.hidden, H = d.heads;
  MlaRefWeights w;
  auto z = [](int64_t n) { return Vec(static_cast<size_t>(n), 0.0); };
  w.norm1 = z(C), w.qa = z(d.q_lora * C), w.qnorm = z(d.q_lora), w.qb = z(H * d.qk() * d.q_lora);
  w.kva = z(d.kv_lora * C), w.kvnorm = z(d.kv_lora), w.kpe = z(d.rope * C);
  w.kvb = z(H * (d.nope + d.v) * d.kv_lora), w.wo = z(C * H * d.v);
  return w;
}

void mla_block(const MlaRefDims& d, const MlaRefWeights& w, const Vec& x, Vec* out, const Vec* dout,
               MlaRefWeights* dw, Vec* dx) {
  const int64_t M = d.tokens(), C = d.hidden, H = d.heads, QK = d.qk(), Dn = d.nope, Dv = d.v;
  const int64_t qr = d.q_lora, kr = d.kv_lora, S = d.seq;
  const double scale = mla_scale(d);
  Vec r1, rq, rk;
  const Vec h = rmsnorm(x, w.norm1, M, C, d.eps, &r1);
  const Vec ql = linear(h, w.qa, M, C, qr);
  const Vec qn = rmsnorm(ql, w.qnorm, M, qr, d.eps, &rq);
  Vec q = linear(qn, w.qb, M, qr, H * QK);
  rope(q, d, H, QK, Dn, false);
  const Vec kl = linear(h, w.kva, M, C, kr);
  const Vec kn = rmsnorm(kl, w.kvnorm, M, kr, d.eps, &rk);
  const Vec kvb = linear(kn, w.kvb, M, kr, H * (Dn + Dv));
  Vec kp = linear(h, w.kpe, M, C, d.rope);
  rope(kp, d, 1, d.rope, 0, false);
  auto K = [&](int64_t t, int64_t hh, int64_t c) {
    return c < Dn ? kvb[static_cast<size_t>((t * H + hh) * (Dn + Dv) + c)]
                  : kp[static_cast<size_t>(t * d.rope + c - Dn)];
  };
  auto V = [&](int64_t t, int64_t hh, int64_t c) {
    return kvb[static_cast<size_t>((t * H + hh) * (Dn + Dv) + Dn + c)];
  };
  // Attention probabilities P[b, h, i, j] (j <= i) and o [M, H * Dv].
  Vec P(static_cast<size_t>(d.batch * H * S * S), 0.0), o(static_cast<size_t>(M * H * Dv), 0.0);
  auto pidx = [&](int64_t b, int64_t hh, int64_t i, int64_t j) {
    return static_cast<size_t>(((b * H + hh) * S + i) * S + j);
  };
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t ti = b * S + i;
        double mx = -1e300;
        Vec sc(static_cast<size_t>(i + 1));
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t c = 0; c < QK; ++c)
            s += q[static_cast<size_t>((ti * H + hh) * QK + c)] * K(b * S + j, hh, c);
          sc[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double z = 0;
        for (int64_t j = 0; j <= i; ++j) z += std::exp(sc[static_cast<size_t>(j)] - mx);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(sc[static_cast<size_t>(j)] - mx) / z;
          P[pidx(b, hh, i, j)] = p;
          for (int64_t c = 0; c < Dv; ++c)
            o[static_cast<size_t>((ti * H + hh) * Dv + c)] += p * V(b * S + j, hh, c);
        }
      }
  *out = linear(o, w.wo, M, H * Dv, C);
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] += x[i];
  if (dout == nullptr) return;

  // Backward.
  *dw = MlaRefWeights::zeros(d);
  Vec d_o;
  linear_backward(*dout, o, w.wo, M, H * Dv, C, d_o, dw->wo);
  Vec dq(static_cast<size_t>(M * H * QK), 0.0), dk(static_cast<size_t>(M * H * QK), 0.0),
      dv(static_cast<size_t>(M * H * Dv), 0.0);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t ti = b * S + i;
        Vec dp(static_cast<size_t>(i + 1));
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t tj = b * S + j;
          const double p = P[pidx(b, hh, i, j)];
          double g = 0;
          for (int64_t c = 0; c < Dv; ++c) {
            const double doc = d_o[static_cast<size_t>((ti * H + hh) * Dv + c)];
            g += doc * V(tj, hh, c);
            dv[static_cast<size_t>((tj * H + hh) * Dv + c)] += p * doc;
          }
          dp[static_cast<size_t>(j)] = g;
          sum += p * g;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t tj = b * S + j;
          const double ds = P[pidx(b, hh, i, j)] * (dp[static_cast<size_t>(j)] - sum) * scale;
          for (int64_t c = 0; c < QK; ++c) {
            dq[static_cast<size_t>((ti * H + hh) * QK + c)] += ds * K(tj, hh, c);
            dk[static_cast<size_t>((tj * H + hh) * QK + c)] +=
                ds * q[static_cast<size_t>((ti * H + hh) * QK + c)];
          }
        }
      }
  rope(dq, d, H, QK, Dn, true);
  Vec dkvb(static_cast<size_t>(M * H * (Dn + Dv)), 0.0), dkp(static_cast<size_t>(M * d.rope), 0.0);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t hh = 0; hh < H; ++hh) {
      for (int64_t c = 0; c < Dn; ++c)
        dkvb[static_cast<size_t>((t * H + hh) * (Dn + Dv) + c)] =
            dk[static_cast<size_t>((t * H + hh) * QK + c)];
      for (int64_t c = 0; c < Dv; ++c)
        dkvb[static_cast<size_t>((t * H + hh) * (Dn + Dv) + Dn + c)] =
            dv[static_cast<size_t>((t * H + hh) * Dv + c)];
      for (int64_t c = 0; c < d.rope; ++c)
        dkp[static_cast<size_t>(t * d.rope + c)] +=
            dk[static_cast<size_t>((t * H + hh) * QK + Dn + c)];
    }
  rope(dkp, d, 1, d.rope, 0, true);
  Vec dkn, dkl, dh, dqn, dql;
  linear_backward(dkvb, kn, w.kvb, M, kr, H * (Dn + Dv), dkn, dw->kvb);
  rmsnorm_backward(dkn, kl, w.kvnorm, rk, M, kr, dkl, dw->kvnorm);
  linear_backward(dkl, h, w.kva, M, C, kr, dh, dw->kva);
  linear_backward(dkp, h, w.kpe, M, C, d.rope, dh, dw->kpe);
  linear_backward(dq, qn, w.qb, M, qr, H * QK, dqn, dw->qb);
  rmsnorm_backward(dqn, ql, w.qnorm, rq, M, qr, dql, dw->qnorm);
  linear_backward(dql, h, w.qa, M, C, qr, dh, dw->qa);
  *dx = *dout;  // the residual
  rmsnorm_backward(dh, x, w.norm1, r1, M, C, *dx, dw->norm1);
}

}  // namespace replay::moe::ref

// ---- The MoE feed-forward part
// ----------------------------------------------------------------

namespace replay::moe::ref {

namespace {

// SwiGLU of a [M, 2F] row-major (gate, then up), and its backward.
Vec swiglu(const Vec& a, int64_t M, int64_t F) {
  Vec s(static_cast<size_t>(M * F));
  for (int64_t t = 0; t < M; ++t)
    for (int64_t f = 0; f < F; ++f) {
      const double g = a[static_cast<size_t>(t * 2 * F + f)];
      const double u = a[static_cast<size_t>(t * 2 * F + F + f)];
      s[static_cast<size_t>(t * F + f)] = g * sigmoid(g) * u;
    }
  return s;
}

Vec swiglu_backward(const Vec& ds, const Vec& a, int64_t M, int64_t F) {
  Vec da(static_cast<size_t>(M * 2 * F));
  for (int64_t t = 0; t < M; ++t)
    for (int64_t f = 0; f < F; ++f) {
      const double g = a[static_cast<size_t>(t * 2 * F + f)];
      const double u = a[static_cast<size_t>(t * 2 * F + F + f)];
      const double sg = sigmoid(g), d = ds[static_cast<size_t>(t * F + f)];
      da[static_cast<size_t>(t * 2 * F + f)] = d * u * sg * (1.0 + g * (1.0 - sg));
      da[static_cast<size_t>(t * 2 * F + F + f)] = d * g * sg;
    }
  return da;
}

Vec slice(const Vec& v, int64_t first, int64_t count) {
  return Vec(v.begin() + first, v.begin() + first + count);
}

}  // namespace

MoeLayerRefWeights MoeLayerRefWeights::zeros(const MoeLayerRefDims& d) {
  const int64_t C = d.hidden, L = d.local_experts, F = d.expert_ffn, S = d.shared_ffn;
  auto z = [](int64_t n) { return Vec(static_cast<size_t>(n), 0.0); };
  MoeLayerRefWeights w;
  w.router = z(d.experts * C), w.bias = z(d.experts);
  w.w1 = z(L * 2 * F * C), w.w2 = z(L * C * F), w.ws1 = z(2 * S * C), w.ws2 = z(C * S);
  return w;
}

void moe_layer(const MoeLayerRefDims& d, const MoeLayerRefWeights& w, const Vec& h, Vec* out,
               const Vec* dout, MoeLayerRefWeights* dw, Vec* dh, int32_t* dropped, Vec* margin,
               const std::vector<int32_t>* selection) {
  const int64_t M = d.tokens, C = d.hidden, F = d.expert_ffn, S = d.shared_ffn, cap = d.capacity;
  const int E = d.experts, L = d.local_experts, K = d.topk;
  const RouterShape rs{M, E, d.groups, d.topk_groups, K, static_cast<float>(d.route_scale)};
  const Vec logits = linear(h, w.router, M, C, E);
  std::vector<int32_t> idx(static_cast<size_t>(M * K)), local(idx.size());
  Vec mg(static_cast<size_t>(M));
  router_select(idx.data(), mg.data(), logits.data(), w.bias.data(), rs);
  if (margin != nullptr) *margin = mg;
  if (selection != nullptr) {
    REPLAY_REQUIRE(selection->size() == idx.size(),
                   "moe_layer: the selection is not [tokens, topk]");
    idx = *selection;
  }
  // router_weights scales by rs.route_scale (a float): the fp64 scale instead.
  Vec weights(idx.size());
  {
    const RouterShape unit{M, E, d.groups, d.topk_groups, K, 1.0f};
    router_weights(weights.data(), logits.data(), idx.data(), unit);
    for (double& v : weights) v *= d.route_scale;
  }
  for (size_t a = 0; a < idx.size(); ++a) local[a] = idx[a] % L;
  const DispatchShape ds{M, L, K, DispatchMode::kCapacity, cap};
  const Dispatch dis = dispatch_index(local.data(), ds);
  if (dropped != nullptr) *dropped = dis.dropped;
  Vec xs(static_cast<size_t>(ds.rows() * C));
  gather(xs.data(), h.data(), dis, ds, C);
  // The local experts on their blocks of `cap` rows.
  Vec up(static_cast<size_t>(ds.rows() * 2 * F)), act(static_cast<size_t>(ds.rows() * F)),
      ys(static_cast<size_t>(ds.rows() * C));
  for (int e = 0; e < L; ++e) {
    const Vec x_e = slice(xs, e * cap * C, cap * C);
    const Vec u_e = linear(x_e, slice(w.w1, e * 2 * F * C, 2 * F * C), cap, C, 2 * F);
    const Vec a_e = swiglu(u_e, cap, F);
    const Vec y_e = linear(a_e, slice(w.w2, e * C * F, C * F), cap, F, C);
    std::copy(u_e.begin(), u_e.end(), up.begin() + e * cap * 2 * F);
    std::copy(a_e.begin(), a_e.end(), act.begin() + e * cap * F);
    std::copy(y_e.begin(), y_e.end(), ys.begin() + e * cap * C);
  }
  out->assign(static_cast<size_t>(M * C), 0.0);
  combine(out->data(), ys.data(), weights.data(), dis, ds, C);
  const Vec sa = linear(h, w.ws1, M, C, 2 * S);
  const Vec ss = swiglu(sa, M, S);
  const Vec sy = linear(ss, w.ws2, M, S, C);
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] += sy[i];
  if (dout == nullptr) return;

  *dw = MoeLayerRefWeights::zeros(d);
  dh->assign(static_cast<size_t>(M * C), 0.0);
  // The shared expert.
  Vec dss;
  linear_backward(*dout, ss, w.ws2, M, S, C, dss, dw->ws2);
  const Vec dsa = swiglu_backward(dss, sa, M, S);
  linear_backward(dsa, h, w.ws1, M, C, 2 * S, *dh, dw->ws1);
  // The combine, the experts, the gather.
  Vec dys(static_cast<size_t>(ds.rows() * C)), dweights(idx.size());
  combine_backward(dys.data(), dweights.data(), dout->data(), ys.data(), weights.data(), dis, ds,
                   C);
  Vec dxs(static_cast<size_t>(ds.rows() * C), 0.0);
  for (int e = 0; e < L; ++e) {
    const Vec a_e = slice(act, e * cap * F, cap * F), u_e = slice(up, e * cap * 2 * F, cap * 2 * F);
    const Vec x_e = slice(xs, e * cap * C, cap * C);
    Vec da_e, dx_e, dw1_e, dw2_e;
    linear_backward(slice(dys, e * cap * C, cap * C), a_e, slice(w.w2, e * C * F, C * F), cap, F, C,
                    da_e, dw2_e);
    const Vec du_e = swiglu_backward(da_e, u_e, cap, F);
    linear_backward(du_e, x_e, slice(w.w1, e * 2 * F * C, 2 * F * C), cap, C, 2 * F, dx_e, dw1_e);
    std::copy(dw1_e.begin(), dw1_e.end(), dw->w1.begin() + e * 2 * F * C);
    std::copy(dw2_e.begin(), dw2_e.end(), dw->w2.begin() + e * C * F);
    std::copy(dx_e.begin(), dx_e.end(), dxs.begin() + e * cap * C);
  }
  Vec dh_routed(static_cast<size_t>(M * C));
  gather_backward(dh_routed.data(), dxs.data(), dis, ds, C);
  for (size_t i = 0; i < dh->size(); ++i) (*dh)[i] += dh_routed[i];
  // The router: the weights' gradient to the logits (route_scale applied here in fp64), then the
  // router GEMM's.
  Vec dlogits(static_cast<size_t>(M * E));
  {
    const RouterShape unit{M, E, d.groups, d.topk_groups, K, 1.0f};
    Vec dw_scaled(dweights);
    for (double& v : dw_scaled) v *= d.route_scale;
    router_backward(dlogits.data(), dw_scaled.data(), logits.data(), idx.data(), unit);
  }
  linear_backward(dlogits, h, w.router, M, C, E, *dh, dw->router);
}

}  // namespace replay::moe::ref
