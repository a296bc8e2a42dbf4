// router.h: DeepSeek-V3's mixture-of-experts router and its load balancing, as device kernels that
// a CUDA graph can capture (nothing is allocated, synchronized or read back on the host; changing
// scalars are device pointers; the workspaces are the caller's).
//
//   router_forward:        sigmoid scores, group-limited top-k on score + bias, normalised weights
//   router_backward:       d(router logits) from d(weights), selection held fixed
//   moe_count_experts:     per-expert token counts (the load), accumulated over micro-batches
//   router_bias_update:    the auxiliary-loss-free balancing step, bias += rate * sign(mean - load)
//   router_aux_loss_*:     MLPerf's sequence-level auxiliary loss and its gradient
//
// Everything is fp32. Every result is deterministic: sums run in a fixed order (warp butterflies
// and per-block partials reduced in order), no float atomics; the only atomics are integer counts,
// whose results do not depend on order. Ties are broken by the lower index, so identical inputs
// give identical indices on every run and in every graph mode.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace replay::moe {

// The most experts a router handles: a warp holds one token's scores, 16 a lane.
constexpr int kMoeMaxExperts = 512;
// The most groups (one lane of a warp each) and the most experts selected per token.
constexpr int kMoeMaxGroups = 32;
constexpr int kMoeMaxTopk = 32;

// Routing of `tokens` tokens over E experts split into G equal groups of E / G consecutive experts.
// DeepSeek-V3: E 256, G 8, topk_groups 4, topk 8, route_scale 2.5. With G = 1 there is no group
// stage. Limits: 1 <= E <= kMoeMaxExperts, E % G == 0, 1 <= G <= kMoeMaxGroups, E / G >= 2 when
// G > 1 (a group's score needs two experts), 1 <= topk_groups <= G,
// 1 <= topk <= min(kMoeMaxTopk, topk_groups * E / G), 1 <= tokens < 2^31 / E.
struct RouterShape {
  int64_t tokens = 0;
  int experts = 0;
  int groups = 1;
  int topk_groups = 1;
  int topk = 1;
  float route_scale = 1.0f;

  int group_size() const { return experts / groups; }
};

// Throws Error naming the limit a shape breaks.
void check_router_shape(const RouterShape& shape);

// Forward, per token t with logits x [tokens, E] (fp32, row-major):
//   s_e = sigmoid(x_e)                              the score
//   b_e = s_e + bias_e                              what selection ranks (bias null: zeros)
//   group score g = sum of the two largest b_e of the group (G > 1 only); the topk_groups best
//     groups are kept, and the topk best b_e among their experts are selected
//   w_j = route_scale * s_{e_j} / (sum over the selected of s + 1e-20)   the weights: from the
//     scores, not the bias (the 1e-20 keeps an all-underflowed row finite, as DeepSeek's code does)
// indices [tokens, topk] int32: slot j holds the j-th best selected expert by b (descending; equal
//   values: the lower expert index first; equal group scores: the lower group first).
// weights [tokens, topk] fp32, in the same slots. Logits and bias must be finite. One warp a token.
void router_forward(int32_t* indices, float* weights, const float* logits, const float* bias,
                    const RouterShape& shape, cudaStream_t stream);

// Backward through the weights, selection held fixed (the top-k is piecewise constant): with
// S = sum of the selected s + 1e-20 and c = route_scale,
//   dL/ds_j = c * (dw_j / S - sum_i dw_i s_i / S^2),   dL/dx_j = dL/ds_j * s_j * (1 - s_j)
// for the selected experts and 0 for the others. dweights [tokens, topk] fp32 (e.g. from
// moe_combine_backward); indices as router_forward wrote them. dlogits [tokens, E] fp32 is written,
// or added to when `accumulate` (so the auxiliary loss's gradient may come first or after).
void router_backward(float* dlogits, const float* dweights, const float* logits,
                     const int32_t* indices, const RouterShape& shape, bool accumulate,
                     cudaStream_t stream);

// load [E] int32: the number of (token, slot) assignments routed to each expert, added to what
// load holds when `accumulate` (the load of a step's micro-batches), written otherwise. Indices
// outside [0, E) are not counted. Integer atomics only: the counts do not depend on their order.
void moe_count_experts(int32_t* load, const int32_t* indices, int64_t tokens, int topk, int experts,
                       bool accumulate, cudaStream_t stream);

// The auxiliary-loss-free balancing step (DeepSeek-V3, section 2.1.2), on the device:
//   bias_e += rate * sign(mean_load - load_e),  mean_load = sum(load) / E
// with sign(0) = 0, the comparison done exactly in integers (E * load_e against sum(load)).
// `rate` (1e-3 in DeepSeek-V3) is a constant hyperparameter. When `reset_load`, load is zeroed
// afterwards, ready for the next step's moe_count_experts(accumulate = true). One block.
void router_bias_update(float* bias, int32_t* load, int experts, float rate, bool reset_load,
                        cudaStream_t stream);

// MLPerf's (and DeepSeek-V3's) sequence-level auxiliary balance loss over B = tokens / seq_len
// sequences of seq_len consecutive tokens. Per sequence b, with s the sigmoid scores of all E
// experts and q_{t,i} = s_{t,i} / (sum_j s_{t,j} + 1e-20) (the router's guard again):
//   f_{b,i} = E / (topk * seq_len) * (assignments of the sequence's tokens to expert i)
//   P_{b,i} = mean over the sequence's tokens of q_{t,i}
//   loss = coeff * mean over b of sum_i f_{b,i} P_{b,i}           (coeff 0.01 in MLPerf)
// f counts the selection (router_forward's indices, before any capacity drop) and is not
// differentiated. Limits: RouterShape's (its groups and scale are not used), seq_len >= 1 dividing
// tokens.
struct AuxLossShape {
  int64_t tokens = 0;
  int64_t seq_len = 0;
  int experts = 0;
  int topk = 1;
  float coeff = 0.01f;

  int64_t sequences() const { return tokens / seq_len; }
};

// Workspace the forward fills and the backward reads (keep it, the logits and the indices
// unchanged between the two): 1 / sum_j s_{t,j} per token, the per-(sequence, part) partial sums
// and counts, and f. Depends on the shape only.
size_t router_aux_loss_workspace_bytes(const AuxLossShape& shape);

// loss: one fp32, written. Partial sums over fixed token ranges, reduced in a fixed order.
// workspace: 16-byte aligned, at least router_aux_loss_workspace_bytes(shape).
void router_aux_loss_forward(float* loss, const float* logits, const int32_t* indices,
                             const AuxLossShape& shape, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

// dlogits [tokens, E] fp32 = dloss[0] * d loss / d logits (dloss null: 1; a device pointer, e.g.
// the loss scale), written or, when `accumulate`, added to (after router_backward, say):
//   g_i = coeff * f_{b,i} / (B * seq_len),  Z_t = sum_i s_{t,i} + 1e-20
//   dL/ds_{t,j} = (g_j - sum_i g_i q_{t,i}) / Z_t
//   dL/dx_{t,j} = dL/ds_{t,j} * s_j * (1 - s_j)
void router_aux_loss_backward(float* dlogits, const float* dloss, const float* logits,
                              const AuxLossShape& shape, bool accumulate, const void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay::moe
