// Expert parallelism's exchange on the CPU (dispatch.h EpLayout, moe_reference.h ep_exchange), for
// 1, 2 and 4 simulated ranks:
//   1. the layout: which of a rank's assignments goes to which rank, local expert and row, the
//      counts each rank receives and the drops, against a walk over the assignments written from
//      the definition (rank r owns experts [r L, r L + L); a rank keeps its first Cs assignments
//      per expert in (token, slot) order; source blocks in rank order);
//   2. the whole MoE layer across the ranks (dispatch, the all-to-all, the local experts' layout,
//      per-expert linear experts, the reverse all-to-all, the weighted combine, and the backward:
//      the input and router-weight gradients and the experts' weight gradients) against one
//      process holding every expert and every rank's tokens: equal in fp64 when nothing is
//      dropped (the same sums in the same order), and with drops equal to each rank running its
//      own tokens over every expert at the same capacity.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "workloads/moe/dispatch.h"
#include "workloads/moe/moe_reference.h"

namespace replay::moe {
namespace {

// Router-like indices: per token `topk` distinct experts of E, drawn from `seed`, skewed towards
// the low experts so that some experts overflow a small capacity.
std::vector<int32_t> draw_indices(int64_t tokens, int topk, int E, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> out;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> chosen;
    while (static_cast<int>(chosen.size()) < topk) {
      const int e = static_cast<int>(gen() % static_cast<uint32_t>(E)) % (gen() % 2 ? E : E / 2);
      bool seen = false;
      for (int32_t c : chosen) seen = seen || c == e;
      if (!seen) chosen.push_back(e);
    }
    out.insert(out.end(), chosen.begin(), chosen.end());
  }
  return out;
}

std::vector<double> draw(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = d(gen);
  return v;
}

struct Case {
  int ranks;
  int64_t tokens;  // per rank
  int experts, topk;
  int64_t capacity;  // Cs
};

TEST(MoeExpertParallel, TheExchangeLayoutFollowsTheDefinition) {
  for (const Case& c : {Case{1, 40, 8, 2, 6}, Case{2, 40, 16, 4, 7}, Case{4, 33, 16, 4, 5},
                        Case{4, 24, 32, 4, 24}, Case{2, 17, 8, 3, 1}}) {
    SCOPED_TRACE("ranks " + std::to_string(c.ranks) + ", capacity " + std::to_string(c.capacity));
    const int N = c.ranks, E = c.experts, L = E / N, k = c.topk;
    const int64_t Cs = c.capacity;
    std::vector<std::vector<int32_t>> idx;
    for (int r = 0; r < N; ++r) idx.push_back(draw_indices(c.tokens, k, E, 100u + r));
    const ref::EpExchange x = ref::ep_exchange(idx, c.tokens, k, E, N, Cs);

    // The definition: walk each rank's assignments in order, counting per (rank, expert).
    std::vector<std::vector<std::pair<int, int32_t>>> want(
        N, std::vector<std::pair<int, int32_t>>(static_cast<size_t>(N) * L * Cs, {-1, -1}));
    std::vector<std::vector<int32_t>> counts(N, std::vector<int32_t>(static_cast<size_t>(N) * L));
    int64_t dropped = 0, kept = 0;
    for (int s = 0; s < N; ++s) {
      std::vector<int64_t> seen(E, 0);
      for (int64_t a = 0; a < c.tokens * k; ++a) {
        const int g = idx[s][a];
        const int owner = g / L, local = g % L;
        const int64_t i = seen[g]++;
        if (i >= Cs) {
          ++dropped;
          continue;
        }
        ++kept;
        // Rank `owner`'s local expert `local`: the sources' blocks of Cs rows in rank order.
        want[owner][(static_cast<size_t>(local) * N + s) * Cs + i] = {s, static_cast<int32_t>(a)};
        counts[owner][s * L + local] += 1;
      }
    }
    int64_t dropped_by_ranks = 0, rows_held = 0;
    for (int s = 0; s < N; ++s) dropped_by_ranks += x.send[s].dropped;
    EXPECT_EQ(dropped_by_ranks, dropped);
    for (int d = 0; d < N; ++d) {
      EXPECT_EQ(x.received[d], counts[d]) << "rank " << d;
      EXPECT_EQ(x.local_rows[d], want[d]) << "rank " << d;
      for (const auto& row : x.local_rows[d]) rows_held += row.first >= 0;
    }
    EXPECT_EQ(rows_held, kept);  // every kept assignment on exactly one rank
    EXPECT_EQ(kept + dropped, static_cast<int64_t>(N) * c.tokens * k);
    if (Cs >= c.tokens) {
      EXPECT_EQ(dropped, 0);
    } else if (Cs <= 5) {
      EXPECT_GT(dropped, 0);  // the small capacities really drop
    }
    // The send buffer's block for rank d holds exactly the assignments to d's experts.
    for (int s = 0; s < N; ++s)
      for (int64_t row = 0; row < x.send_shape().rows(); ++row) {
        const int32_t a = x.send[s].row_source[row];
        if (a >= 0) {
          EXPECT_EQ(idx[s][a] / L, row / (L * Cs));
        }
      }
  }
}

// The MoE layer with linear experts y = A_g x (A_g [hidden, hidden] per global expert): forward
// out = sum_j w_j A_{e_j} x, backward dx, dweights and dA for a given dout.
struct Layer {
  std::vector<std::vector<double>> out, dx, dweights;  // per rank
  std::vector<double> dA;                              // [E, hidden, hidden]
};

// y[row] = A_{expert(row)} x[row] (transpose: A^T), for the rows of `blocks` consecutive experts of
// `rows_per` rows each, the first being global expert `first`.
std::vector<double> apply_experts(const std::vector<double>& x, const std::vector<double>& A,
                                  int first, int blocks, int64_t rows_per, int64_t H,
                                  bool transpose) {
  std::vector<double> y(x.size(), 0.0);
  for (int e = 0; e < blocks; ++e)
    for (int64_t r = 0; r < rows_per; ++r) {
      const int64_t row = e * rows_per + r;
      const double* a = &A[static_cast<size_t>(first + e) * H * H];
      for (int64_t i = 0; i < H; ++i) {
        double sum = 0.0;
        for (int64_t j = 0; j < H; ++j)
          sum += (transpose ? a[j * H + i] : a[i * H + j]) * x[row * H + j];
        y[row * H + i] = sum;
      }
    }
  return y;
}

// dA_{first + e} += sum over the block's rows of dy x^T, in row order.
void expert_wgrad(std::vector<double>& dA, const std::vector<double>& dy,
                  const std::vector<double>& x, int first, int blocks, int64_t rows_per,
                  int64_t H) {
  for (int e = 0; e < blocks; ++e)
    for (int64_t r = 0; r < rows_per; ++r) {
      const int64_t row = e * rows_per + r;
      double* g = &dA[static_cast<size_t>(first + e) * H * H];
      for (int64_t i = 0; i < H; ++i)
        for (int64_t j = 0; j < H; ++j) g[i * H + j] += dy[row * H + i] * x[row * H + j];
    }
}

// One process: the tokens `x` ([T, H]) over every expert at capacity C.
Layer one_process(const std::vector<int32_t>& idx, const std::vector<double>& x,
                  const std::vector<double>& w, const std::vector<double>& dout,
                  const std::vector<double>& A, int64_t T, int E, int k, int64_t C, int64_t H) {
  const DispatchShape ds{T, E, k, DispatchMode::kCapacity, C};
  const ref::Dispatch d = ref::dispatch_index(idx.data(), ds);
  std::vector<double> xs(static_cast<size_t>(ds.rows() * H));
  ref::gather(xs.data(), x.data(), d, ds, H);
  const std::vector<double> ys = apply_experts(xs, A, 0, E, C, H, false);
  Layer l;
  l.out.assign(1, std::vector<double>(x.size()));
  ref::combine(l.out[0].data(), ys.data(), w.data(), d, ds, H);
  std::vector<double> dys(ys.size());
  l.dweights.assign(1, std::vector<double>(w.size()));
  ref::combine_backward(dys.data(), l.dweights[0].data(), dout.data(), ys.data(), w.data(), d, ds,
                        H);
  const std::vector<double> dxs = apply_experts(dys, A, 0, E, C, H, true);
  l.dx.assign(1, std::vector<double>(x.size()));
  ref::gather_backward(l.dx[0].data(), dxs.data(), d, ds, H);
  l.dA.assign(A.size(), 0.0);
  expert_wgrad(l.dA, dys, xs, 0, E, C, H);
  return l;
}

// `ranks` ranks, each with its tokens, exchanging as MoeModel does with ep > 1.
Layer expert_parallel(const std::vector<std::vector<int32_t>>& idx,
                      const std::vector<std::vector<double>>& x,
                      const std::vector<std::vector<double>>& w,
                      const std::vector<std::vector<double>>& dout, const std::vector<double>& A,
                      int64_t T, int E, int k, int64_t Cs, int64_t H) {
  const int N = static_cast<int>(idx.size()), L = E / N;
  const ref::EpExchange ex = ref::ep_exchange(idx, T, k, E, N, Cs);
  const DispatchShape ds = ex.send_shape();
  const size_t n = static_cast<size_t>(ds.rows() * H);
  // Forward: gather into the send buffers, exchange, the local experts, back, combine.
  std::vector<std::vector<double>> send(N, std::vector<double>(n));
  for (int r = 0; r < N; ++r) ref::gather(send[r].data(), x[r].data(), ex.send[r], ds, H);
  const auto recv = ref::ep_all_to_all(send, N, H);
  std::vector<std::vector<double>> xl(N), back(N);
  for (int d = 0; d < N; ++d) {
    xl[d] = ref::ep_permute(recv[d], ex.received[d], ex.layout, H, true);
    const std::vector<double> yl = apply_experts(xl[d], A, d * L, L, N * Cs, H, false);
    back[d] = ref::ep_permute(yl, ex.received[d], ex.layout, H, false);
  }
  const auto ys = ref::ep_all_to_all(back, N, H);
  Layer l;
  l.out.assign(N, {});
  l.dweights.assign(N, {});
  std::vector<std::vector<double>> dys(N, std::vector<double>(n));
  for (int r = 0; r < N; ++r) {
    l.out[r].assign(x[r].size(), 0.0);
    ref::combine(l.out[r].data(), ys[r].data(), w[r].data(), ex.send[r], ds, H);
    l.dweights[r].assign(w[r].size(), 0.0);
    ref::combine_backward(dys[r].data(), l.dweights[r].data(), dout[r].data(), ys[r].data(),
                          w[r].data(), ex.send[r], ds, H);
  }
  // Backward: the outputs' gradients to the experts' ranks, the inputs' gradients back.
  const auto dyr = ref::ep_all_to_all(dys, N, H);
  std::vector<std::vector<double>> dxback(N);
  l.dA.assign(A.size(), 0.0);
  for (int d = 0; d < N; ++d) {
    const std::vector<double> dyl = ref::ep_permute(dyr[d], ex.received[d], ex.layout, H, true);
    expert_wgrad(l.dA, dyl, xl[d], d * L, L, N * Cs, H);
    const std::vector<double> dxl = apply_experts(dyl, A, d * L, L, N * Cs, H, true);
    dxback[d] = ref::ep_permute(dxl, ex.received[d], ex.layout, H, false);
  }
  const auto dxs = ref::ep_all_to_all(dxback, N, H);
  l.dx.assign(N, {});
  for (int r = 0; r < N; ++r) {
    l.dx[r].assign(x[r].size(), 0.0);
    ref::gather_backward(l.dx[r].data(), dxs[r].data(), ex.send[r], ds, H);
  }
  return l;
}

TEST(MoeExpertParallel, TheLayerAcrossRanksIsTheOneProcessLayer) {
  const int E = 16, k = 4;
  const int64_t T = 20, H = 8;
  const std::vector<double> A = draw(static_cast<size_t>(E) * H * H, 7);
  for (int N : {1, 2, 4}) {
    for (const bool drops : {false, true}) {
      SCOPED_TRACE("ranks " + std::to_string(N) + (drops ? ", with drops" : ", no drops"));
      const int64_t Cs = drops ? 3 : T;  // T: an expert can receive at most T of a rank's tokens
      std::vector<std::vector<int32_t>> idx;
      std::vector<std::vector<double>> x, w, dout;
      std::vector<int32_t> all_idx;
      std::vector<double> all_x, all_w, all_dout;
      for (int r = 0; r < N; ++r) {
        idx.push_back(draw_indices(T, k, E, 300u + r));
        x.push_back(draw(static_cast<size_t>(T * H), 400u + r));
        w.push_back(draw(static_cast<size_t>(T * k), 500u + r));
        dout.push_back(draw(static_cast<size_t>(T * H), 600u + r));
        all_idx.insert(all_idx.end(), idx[r].begin(), idx[r].end());
        all_x.insert(all_x.end(), x[r].begin(), x[r].end());
        all_w.insert(all_w.end(), w[r].begin(), w[r].end());
        all_dout.insert(all_dout.end(), dout[r].begin(), dout[r].end());
      }
      const Layer ep = expert_parallel(idx, x, w, dout, A, T, E, k, Cs, H);
      int64_t dropped = 0;
      for (int r = 0; r < N; ++r)
        dropped +=
            ref::dispatch_index(idx[r].data(), {T, E, k, DispatchMode::kCapacity, Cs}).dropped;
      EXPECT_EQ(dropped > 0, drops);
      if (!drops) {
        // One process with every rank's tokens, in rank order, and room for all of them.
        const Layer one = one_process(all_idx, all_x, all_w, all_dout, A, N * T, E, k, N * T, H);
        for (int r = 0; r < N; ++r) {
          const auto part = [&](const std::vector<double>& v, int64_t per) {
            return std::vector<double>(v.begin() + r * per, v.begin() + (r + 1) * per);
          };
          EXPECT_EQ(ep.out[r], part(one.out[0], T * H)) << "rank " << r;
          EXPECT_EQ(ep.dx[r], part(one.dx[0], T * H)) << "rank " << r;
          EXPECT_EQ(ep.dweights[r], part(one.dweights[0], T * k)) << "rank " << r;
        }
        // The experts' gradients: the same rows in the same order (sources in rank order).
        EXPECT_EQ(ep.dA, one.dA);
      } else {
        // Drops happen on the sending rank: each rank's outputs are those of its own tokens over
        // every expert at capacity Cs.
        for (int r = 0; r < N; ++r) {
          const Layer own = one_process(idx[r], x[r], w[r], dout[r], A, T, E, k, Cs, H);
          EXPECT_EQ(ep.out[r], own.out[0]) << "rank " << r;
          EXPECT_EQ(ep.dx[r], own.dx[0]) << "rank " << r;
          EXPECT_EQ(ep.dweights[r], own.dweights[0]) << "rank " << r;
        }
      }
    }
  }
}

TEST(MoeExpertParallel, RowFormulasAreInverseBlocks) {
  // Send layout: rank-major blocks of L experts; local layout: expert-major blocks of N sources.
  const int N = 4, L = 3;
  const int64_t Cs = 5;
  std::vector<int> hits(static_cast<size_t>(N) * L * Cs, 0);
  for (int s = 0; s < N; ++s)
    for (int l = 0; l < L; ++l)
      for (int64_t i = 0; i < Cs; ++i) {
        hits[static_cast<size_t>(ep_local_row(s, l, i, N, Cs))] += 1;
        EXPECT_EQ(ep_send_row(s, l, i, L, Cs) / (L * Cs), s);
        EXPECT_EQ(ep_local_row(s, l, i, N, Cs) / (N * Cs), l);
      }
  for (int h : hits) EXPECT_EQ(h, 1);
  EXPECT_EQ((EpLayout{N, L, Cs}.rows()), N * L * Cs);
}

}  // namespace
}  // namespace replay::moe
