// transducer_reference.cpp: fp64 CPU reference of the RNN-T loss (see transducer_reference.h).
// Straightforward loops over one utterance at a time, written from the lattice's definition.
#include "workloads/rnnt/transducer_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace replay::rnnt::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double log_add(double x, double y) {
  const double m = std::max(x, y);
  return m == kNegInf ? m : m + std::log(std::exp(x - m) + std::exp(y - m));
}

int64_t clamp(int64_t x, int64_t hi) {
  return std::min<int64_t>(std::max<int64_t>(x, 0), hi);
}

}  // namespace

void transducer_loss(double* loss, double* grad, const double* logits, const int32_t* labels,
                     const int32_t* frame_lengths, const int32_t* label_lengths,
                     const TransducerShape& s, double grad_scale) {
  const int64_t T = s.max_frames, P = s.positions(), V = s.vocab, blank = s.blank;
  if (grad != nullptr) std::fill(grad, grad + s.elements(), 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t Tb = clamp(frame_lengths[b], T), Ub = clamp(label_lengths[b], P - 1);
    if (Tb == 0) {
      loss[b] = 0.0;
      continue;
    }
    auto row = [&](int64_t t, int64_t u) { return transducer_row(b, t, u, T, P) * V; };
    auto label = [&](int64_t u) { return clamp(labels[b * (P - 1) + u], V - 1); };  // y_{u+1}

    // log_softmax of every row inside the lengths; lp_blank and lp_label are what the lattice uses.
    std::vector<double> lse(Tb * (Ub + 1)), lpb(Tb * (Ub + 1)), lpl(Tb * (Ub + 1), kNegInf);
    auto at = [&](int64_t t, int64_t u) { return t * (Ub + 1) + u; };
    for (int64_t t = 0; t < Tb; ++t)
      for (int64_t u = 0; u <= Ub; ++u) {
        const double* z = logits + row(t, u);
        const double m = *std::max_element(z, z + V);
        double sum = 0.0;
        for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
        lse[at(t, u)] = m + std::log(sum);
        lpb[at(t, u)] = z[blank] - lse[at(t, u)];
        if (u < Ub) lpl[at(t, u)] = z[label(u)] - lse[at(t, u)];
      }

    std::vector<double> alpha(Tb * (Ub + 1), kNegInf), beta(Tb * (Ub + 1), kNegInf);
    for (int64_t t = 0; t < Tb; ++t)
      for (int64_t u = 0; u <= Ub; ++u) {
        if (t == 0 && u == 0) {
          alpha[at(0, 0)] = 0.0;
          continue;
        }
        double a = kNegInf;
        if (t > 0) a = log_add(a, alpha[at(t - 1, u)] + lpb[at(t - 1, u)]);
        if (u > 0) a = log_add(a, alpha[at(t, u - 1)] + lpl[at(t, u - 1)]);
        alpha[at(t, u)] = a;
      }
    for (int64_t t = Tb - 1; t >= 0; --t)
      for (int64_t u = Ub; u >= 0; --u) {
        if (t == Tb - 1 && u == Ub) {
          beta[at(t, u)] = lpb[at(t, u)];  // the final blank
          continue;
        }
        double c = kNegInf;
        if (t + 1 < Tb) c = log_add(c, beta[at(t + 1, u)] + lpb[at(t, u)]);
        if (u < Ub) c = log_add(c, beta[at(t, u + 1)] + lpl[at(t, u)]);
        beta[at(t, u)] = c;
      }
    const double log_prob = alpha[at(Tb - 1, Ub)] + lpb[at(Tb - 1, Ub)];
    loss[b] = -log_prob;
    if (grad == nullptr) continue;

    // d loss / d lp(blank) and d loss / d lp(label) of each cell, then through log_softmax:
    // d loss / d z[v] = sum over k of dlp[k] * ([v == k] - softmax[v]).
    for (int64_t t = 0; t < Tb; ++t)
      for (int64_t u = 0; u <= Ub; ++u) {
        const double after_blank = t + 1 < Tb ? beta[at(t + 1, u)] : (u == Ub ? 0.0 : kNegInf);
        const double d_blank = -std::exp(alpha[at(t, u)] + lpb[at(t, u)] + after_blank - log_prob);
        const double d_label =
            u < Ub ? -std::exp(alpha[at(t, u)] + lpl[at(t, u)] + beta[at(t, u + 1)] - log_prob)
                   : 0.0;
        const double* z = logits + row(t, u);
        double* g = grad + row(t, u);
        for (int64_t v = 0; v < V; ++v)
          g[v] = -std::exp(z[v] - lse[at(t, u)]) * (d_blank + d_label) * grad_scale;
        g[blank] += d_blank * grad_scale;
        if (u < Ub) g[label(u)] += d_label * grad_scale;
      }
  }
}

}  // namespace replay::rnnt::ref
