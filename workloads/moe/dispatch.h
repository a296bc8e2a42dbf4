// dispatch.h: MoE token dispatch without a host read of any count: the (token, slot) assignments
// of the router sorted by expert on the device (counts, offsets, a stable permutation), the gather
// of token rows into the expert-sorted buffer, the weighted combine back into token order, and
// the backward of both. Deterministic: the sort is a counting sort whose order is fixed by the
// data alone, every sum runs in a fixed order, and nothing uses float atomics, so eager runs and
// graph replays give the same bits.
//
// An assignment is a = t * topk + j (token t, slot j of router_forward's indices [tokens, topk]).
// Its rank r within its expert e is the number of assignments a' < a with the same expert: the
// sort is stable in (token, slot) order. The sorted buffer has `rows()` rows of `hidden` values:
//
//   kCapacity: E blocks of `capacity` rows, expert e at rows [e * C, e * C + C). Assignment a goes
//     to row e * C + r if r < C, and is dropped otherwise: an expert keeps its first C assignments
//     in (token, slot) order and drops the later ones (Megatron's "position" drop policy). Rows
//     past an expert's kept count are padding, zero in the gathered buffer. Static shapes: what the
//     capacity-padded batched expert GEMM (expert_gemm.h) reads. C = moe_capacity(F, ...).
//   kDropless: tokens * topk rows (the worst case: every assignment), expert e at rows
//     [offsets[e], offsets[e] + counts[e]) with offsets the exclusive sum of the counts, all on
//     the device; nothing is dropped and there is no padding.
//
// Data are bf16 (the activations' type) with fp32 arithmetic; hidden is a multiple of 8 and every
// bf16 pointer 16-byte aligned. Indices outside [0, E) are treated as dropped.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/philox.h"  // REPLAY_HOST_DEVICE

namespace replay::moe {

enum class DispatchMode { kCapacity, kDropless };

// Rows kept per expert at capacity factor F: ceil(F * tokens * topk / experts), at least 1 and at
// most `tokens` (an expert receives at most one assignment per token, so a larger C never keeps
// more). The product is rounded down by 1e-9 first so that F * T * k / E landing on an integer in
// exact arithmetic is not pushed up a row by floating point.
int64_t moe_capacity(double factor, int64_t tokens, int topk, int experts);

// Limits: 1 <= experts <= 512, 1 <= topk <= min(32, experts), tokens >= 1,
// tokens * topk < 2^31, rows() < 2^31, capacity >= 1 in kCapacity mode.
struct DispatchShape {
  int64_t tokens = 0;
  int experts = 0;
  int topk = 1;
  DispatchMode mode = DispatchMode::kDropless;
  int64_t capacity = 0;  // rows per expert, kCapacity only

  int64_t assignments() const { return tokens * topk; }
  int64_t rows() const {
    return mode == DispatchMode::kCapacity ? capacity * experts : assignments();
  }
};

void check_dispatch_shape(const DispatchShape& shape);

// What moe_dispatch_index writes (device memory, int32).
struct DispatchIndex {
  int32_t* routed_counts = nullptr;   // [E] assignments routed to e (before any drop): the load
  int32_t* expert_counts = nullptr;   // [E] rows kept for e: min(routed, C), or routed (dropless)
  int32_t* expert_offsets = nullptr;  // [E + 1] first row of e; [E] = rows() (capacity) or the
                                      // number of assignments (dropless)
  int32_t* slot_row = nullptr;        // [tokens * topk] row of assignment a, -1 when dropped
  int32_t* row_source = nullptr;      // [rows()] assignment in the row, -1 for padding
  int32_t* dropped = nullptr;         // [1] assignments dropped (0 in dropless mode)
};

// Scratch for the sort: per-chunk counts of the assignments ([chunks, E] int32, chunks of 512
// assignments, one warp each). Contents undefined after the call. Depends on the shape only.
size_t moe_dispatch_workspace_bytes(const DispatchShape& shape);

// The counting sort, three kernels: per-chunk histograms; one block scanning them per expert and
// over experts (counts, offsets, drops); each chunk's warp walking its assignments again in order
// and writing every row (slot_row, row_source; padding rows -1). indices [tokens, topk] int32.
// workspace: 16-byte aligned, at least moe_dispatch_workspace_bytes(shape).
void moe_dispatch_index(const DispatchIndex& out, const int32_t* indices,
                        const DispatchShape& shape, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// Gather (the dispatch): x_sorted[slot_row[t * topk + j]] = x[t] for every kept slot, padding
// rows zero (the rows no slot maps to: row_source -1). x [tokens, hidden], x_sorted
// [rows(), hidden] bf16. A copy: exact. Token-major, so each token's row is read once.
void moe_gather(__nv_bfloat16* x_sorted, const __nv_bfloat16* x, const int32_t* slot_row,
                const int32_t* row_source, const DispatchShape& shape, int64_t hidden,
                cudaStream_t stream);

// Its backward: dx[t] = (accumulate ? dx[t] : 0) + sum over t's kept slots j = 0, 1, ... in order
// of dx_sorted[slot_row[t * topk + j]], in fp32, rounded once to bf16 (0 for a token whose slots
// were all dropped, unless accumulating). dx [tokens, hidden], dx_sorted [rows(), hidden].
void moe_gather_backward(__nv_bfloat16* dx, const __nv_bfloat16* dx_sorted, const int32_t* slot_row,
                         const DispatchShape& shape, int64_t hidden, bool accumulate,
                         cudaStream_t stream);

// Combine (the unpermute): out[t] = (accumulate ? out[t] : 0) + sum over t's kept slots j in
// order of weights[t, j] * y_sorted[slot_row[t * topk + j]], fp32, rounded once to bf16. A dropped
// slot adds nothing (its weight is lost, not renormalised: the token keeps its residual path).
// out [tokens, hidden], y_sorted [rows(), hidden], weights [tokens, topk] fp32.
void moe_combine(__nv_bfloat16* out, const __nv_bfloat16* y_sorted, const float* weights,
                 const int32_t* slot_row, const DispatchShape& shape, int64_t hidden,
                 bool accumulate, cudaStream_t stream);

// Combine backward, one pass over the assignments:
//   dy_sorted[slot_row[a]] = weights[a] * dout[t]                    bf16, every kept row
//   dweights[a] = sum over h of y_sorted[slot_row[a], h] * dout[t, h]  fp32, fixed order; 0 when
//                                                                     dropped
// and the padding rows of dy_sorted written with zeros (so the expert backward sees zeros there).
// dout [tokens, hidden].
void moe_combine_backward(__nv_bfloat16* dy_sorted, float* dweights, const __nv_bfloat16* dout,
                          const __nv_bfloat16* y_sorted, const float* weights,
                          const int32_t* slot_row, const int32_t* row_source,
                          const DispatchShape& shape, int64_t hidden, cudaStream_t stream);

// ---- Expert parallelism (N ranks, E experts, L = E / N local experts each: rank r owns the global
// experts [r L, r L + L)) ------------------------------------------------------------------------
//
// A rank sorts its own assignments over all E global experts in capacity mode with Cs rows per
// expert (moe_dispatch_index with experts = E, capacity = Cs): the sorted buffer is the send
// buffer, and because every rank's experts are a consecutive block, the rows bound for rank d are
// the contiguous block [d L Cs, d L Cs + L Cs) (row ep_send_row(d, l, i)). The all-to-all delivers
// source s's block to block s of the receive buffer (the same row formula, s in place of d). The
// local experts want their rows together: expert l's N Cs rows are the sources' blocks in source
// order (row ep_local_row(s, l, i)), which is the one-process capacity layout with L experts and
// C = N Cs rows each. The outputs travel back the same way in reverse.
REPLAY_HOST_DEVICE int64_t ep_send_row(int rank, int local, int64_t i, int local_experts,
                                       int64_t cap) {
  return (static_cast<int64_t>(rank) * local_experts + local) * cap + i;
}
REPLAY_HOST_DEVICE int64_t ep_local_row(int source, int local, int64_t i, int ranks, int64_t cap) {
  return (static_cast<int64_t>(local) * ranks + source) * cap + i;
}

struct EpLayout {
  int ranks = 1;          // N
  int local_experts = 1;  // L
  int64_t capacity = 1;   // Cs: rows per (source rank, expert)
  int64_t rows() const { return static_cast<int64_t>(ranks) * local_experts * capacity; }
};

// The reordering between the exchange's layout (source-major: row ep_send_row(s, l, i)) and the
// local experts' (expert-major: row ep_local_row(s, l, i)), [rows(), hidden] bf16 each.
// to_local: local[ep_local_row(s, l, i)] = exchanged[ep_send_row(s, l, i)]; otherwise the
// reverse. Rows i >= counts[s * L + l] (the rows source s filled for local expert l, received
// with the data: device memory, no host read) are written as zeros, whatever the input holds
// there: padding never reaches the experts or the combine. A copy: exact, deterministic.
void moe_ep_permute(__nv_bfloat16* out, const __nv_bfloat16* in, const int32_t* counts,
                    const EpLayout& layout, int64_t hidden, bool to_local, cudaStream_t stream);

}  // namespace replay::moe
