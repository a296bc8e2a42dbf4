// moe_reference.h: fp64 CPU references of the MoE router (router.h), dispatch (dispatch.h) and MLA,
// written from the definitions rather than from the kernels: sorts instead of warp arg-max rounds,
// a sequential walk over the assignments instead of the chunked counting sort, plain loops for the
// data movement. Same conventions: slot order by score + bias (ties: the lower expert, the lower
// group), weights from the scores normalised with the 1e-20 guard, assignments a = t * topk + j
// sorted stably by expert, capacity drops of the later assignments, -1 for dropped slots and
// padding rows.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "workloads/moe/dispatch.h"
#include "workloads/moe/router.h"
#include "workloads/moe/yarn.h"

namespace replay::moe::ref {

double sigmoid(double x);

// Selection of router_forward: indices [tokens, topk]. margin: null, or [tokens]: per token the
// smallest gap between two values whose order decides the result (the kept groups' last score
// against the best dropped group's; consecutive selected experts' biased scores, and the last
// selected against the best unselected candidate). Where the margin is below the GPU's fp32
// rounding, the GPU may legitimately choose otherwise; the tests compare only tokens above it.
void router_select(int32_t* indices, double* margin, const double* logits, const double* bias,
                   const RouterShape& shape);

// The weights of given selections: route_scale * s_e / (sum of the selected s + 1e-20).
void router_weights(double* weights, const double* logits, const int32_t* indices,
                    const RouterShape& shape);

// dlogits [tokens, E] (written) from dweights [tokens, topk], the selection held fixed.
void router_backward(double* dlogits, const double* dweights, const double* logits,
                     const int32_t* indices, const RouterShape& shape);

// Assignments per expert (indices outside [0, E) not counted).
std::vector<int64_t> count_experts(const int32_t* indices, int64_t tokens, int topk, int experts);

// bias_e += rate * sign(mean(load) - load_e), sign(0) = 0.
void bias_update(double* bias, const std::vector<int64_t>& load, double rate);

// The sequence-level auxiliary loss (router.h); dlogits: null, or [tokens, E] written with
// dloss * d loss / d logits.
double aux_loss(const double* logits, const int32_t* indices, const AuxLossShape& shape,
                double* dlogits = nullptr, double dloss = 1.0);

// moe_dispatch_index's outputs.
struct Dispatch {
  std::vector<int32_t> routed_counts, expert_counts, expert_offsets;  // [E], [E], [E + 1]
  std::vector<int32_t> slot_row;                                      // [tokens * topk]
  std::vector<int32_t> row_source;                                    // [rows]
  int32_t dropped = 0;
};
Dispatch dispatch_index(const int32_t* indices, const DispatchShape& shape);

// The data movement, [*, hidden] row-major.
void gather(double* x_sorted, const double* x, const Dispatch& d, const DispatchShape& shape,
            int64_t hidden);
void gather_backward(double* dx, const double* dx_sorted, const Dispatch& d,
                     const DispatchShape& shape, int64_t hidden);
void combine(double* out, const double* y_sorted, const double* weights, const Dispatch& d,
             const DispatchShape& shape, int64_t hidden);
void combine_backward(double* dy_sorted, double* dweights, const double* dout,
                      const double* y_sorted, const double* weights, const Dispatch& d,
                      const DispatchShape& shape, int64_t hidden);

// Expert parallelism (dispatch.h, EpLayout): the exchange of `ranks` simulated ranks. Rank s
// sorts its own assignments indices[s] ([tokens, topk]) over the E global experts in capacity
// mode with `capacity` (Cs) rows per expert: send[s] (its send buffer's rows: rank d's experts'
// block is rows [d L Cs, d L Cs + L Cs)). After the all-to-all, rank d holds per source s and
// local expert l received[d][s L + l] rows (what s kept for global expert d L + l), and its local
// experts' layout (row ep_local_row(s, l, i)) holds the assignment local_rows[d][row] = (source
// rank, assignment of that rank), {-1, -1} for padding.
struct EpExchange {
  EpLayout layout;
  int experts = 0, topk = 0;
  int64_t tokens = 0;
  std::vector<Dispatch> send;
  std::vector<std::vector<int32_t>> received;
  std::vector<std::vector<std::pair<int, int32_t>>> local_rows;
  DispatchShape send_shape() const {
    return DispatchShape{tokens, experts, topk, DispatchMode::kCapacity, layout.capacity};
  }
};
EpExchange ep_exchange(const std::vector<std::vector<int32_t>>& indices, int64_t tokens, int topk,
                       int experts, int ranks, int64_t capacity);

// The data movement of the exchange on [rows, hidden] buffers, per rank: the all-to-all (block d
// of rank s's buffer to block s of rank d's) and moe_ep_permute's reordering with its masking by
// the received counts (to_local: exchange layout -> local experts' layout; otherwise back).
std::vector<std::vector<double>> ep_all_to_all(const std::vector<std::vector<double>>& buffers,
                                               int ranks, int64_t hidden);
std::vector<double> ep_permute(const std::vector<double>& in, const std::vector<int32_t>& received,
                               const EpLayout& layout, int64_t hidden, bool to_local);

// MLA, DeepSeek-V3's attention block as MoeModel runs it (moe_model.h), in fp64 for tokens
// t = b * seq + s: h = rmsnorm(x; norm1); q = rope(rmsnorm(h Wqa^T; qnorm) Wqb^T) per head on its
// last `rope` channels; kv = rmsnorm(h Wkva^T; kvnorm) Wkvb^T per head (nope key, then value);
// kpe = rope(h Wkpe^T), shared by every head; k = (kv nope, kpe), v = kv value; causal softmax
// attention at scale 1 / sqrt(nope + rope) within each sequence; out = x + o Wo^T. RoPE is
// rotate-half with angle s * theta^(-2i / rope) for channel pair (i, i + rope / 2). With
// yarn.enabled, DeepSeek-V3's YaRN: the angle's frequency is rope_frequency's, cos and sin are
// scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale by
// mscale(factor, mscale_all_dim)^2.
struct MlaRefDims {
  int64_t batch = 1, seq = 1, hidden = 8, heads = 1, q_lora = 8, kv_lora = 8;
  int64_t nope = 8, rope = 4, v = 8;
  double eps = 1e-6, theta = 10000.0;
  YarnScaling yarn;
  int64_t tokens() const { return batch * seq; }
  int64_t qk() const { return nope + rope; }
};
// The frequency of channel pair i of R rotated channels, written from DeepSeek-V3's
// DeepseekV3YarnRotaryEmbedding (yarn_find_correction_range, yarn_linear_ramp_mask): plain
// theta^(-2i / R) without YaRN.
double rope_frequency(int64_t i, int64_t R, double theta, const YarnScaling& yarn);
// DeepSeek-V3's softmax scale of MLA: (nope + rope)^-0.5, times yarn_get_mscale(factor,
// mscale_all_dim)^2 with YaRN.
double mla_scale(const MlaRefDims& d);
// Weights as nn.Linear stores them ([out, in]) and the norms' scales.
struct MlaRefWeights {
  std::vector<double> norm1, qa, qnorm, qb, kva, kvnorm, kpe, kvb, wo;
  std::vector<std::vector<double>*> all() {
    return {&norm1, &qa, &qnorm, &qb, &kva, &kvnorm, &kpe, &kvb, &wo};
  }
  // Every tensor at its size, zero.
  static MlaRefWeights zeros(const MlaRefDims& d);
};
// out [tokens, hidden] from x; with dout, the backward too: dw (every tensor written) and dx.
void mla_block(const MlaRefDims& d, const MlaRefWeights& w, const std::vector<double>& x,
               std::vector<double>* out, const std::vector<double>* dout = nullptr,
               MlaRefWeights* dw = nullptr, std::vector<double>* dx = nullptr);

// The MoE feed-forward part of a block as MoeModel runs it, in fp64, on h [tokens, hidden] (the
// normalised input): the router (logits = h Wr^T, router_select on the logits and bias,
// router_weights), the fold of global expert e onto local expert e mod local_experts, the dispatch
// into the capacity layout (dispatch_index: the later assignments over `capacity` dropped), the
// local experts' SwiGLU (gate = the first half of W1's outputs, up the second:
// act = silu(gate) up, y = act W2^T), the weighted combine, plus the shared expert's SwiGLU:
//   out = swiglu(h Ws1^T) Ws2^T + combine(experts(gather(h)), weights)
// With dout, the backward with the selection held fixed (the top-k is piecewise constant): dw
// (every tensor but the bias written) and dh. margin (optional): router_select's per-token margin.
struct MoeLayerRefDims {
  int64_t tokens = 1, hidden = 8;
  int experts = 4, local_experts = 4, groups = 1, topk_groups = 1, topk = 1;
  int64_t expert_ffn = 4, shared_ffn = 4, capacity = 1;
  double route_scale = 1.0;
};
struct MoeLayerRefWeights {
  std::vector<double> router, bias, w1, w2, ws1, ws2;  // [E, C], [E], [L, 2F, C], [L, C, F], ...
  std::vector<std::vector<double>*> differentiable() { return {&router, &w1, &w2, &ws1, &ws2}; }
  static MoeLayerRefWeights zeros(const MoeLayerRefDims& d);
};
// selection (optional): [tokens, topk] indices to use instead of router_select's (a GPU's, whose
// fp32 logits may order a near-tie otherwise); margin is still router_select's.
void moe_layer(const MoeLayerRefDims& d, const MoeLayerRefWeights& w, const std::vector<double>& h,
               std::vector<double>* out, const std::vector<double>* dout = nullptr,
               MoeLayerRefWeights* dw = nullptr, std::vector<double>* dh = nullptr,
               int32_t* dropped = nullptr, std::vector<double>* margin = nullptr,
               const std::vector<int32_t>* selection = nullptr);

}  // namespace replay::moe::ref
