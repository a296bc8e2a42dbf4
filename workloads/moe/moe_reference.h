// moe_reference.h: fp64 CPU references of the MoE router (router.h) and dispatch (dispatch.h),
// written from the definitions rather than from the kernels: sorts instead of warp arg-max rounds,
// a sequential walk over the assignments instead of the chunked counting sort, plain loops for the
// data movement. Same conventions: slot order by score + bias (ties: the lower expert, the lower
// group), weights from the scores normalised with the 1e-20 guard, assignments a = t * topk + j
// sorted stably by expert, capacity drops of the later assignments, -1 for dropped slots and
// padding rows.
#pragma once

#include <cstdint>
#include <vector>

#include "workloads/moe/dispatch.h"
#include "workloads/moe/router.h"

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

}  // namespace replay::moe::ref
