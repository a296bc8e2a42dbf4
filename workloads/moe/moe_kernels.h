// moe_kernels.h: the small kernels the DeepSeek-V3 model (moe_model.h) needs besides the router and
// dispatch ops: MLA's key and value assembly from the KV up-projection and the shared RoPE key (and
// its backward, whose sum over heads runs in a fixed order), the fold of global expert indices
// onto a rank's local experts (the one-process stand-in for the expert-parallel all-to-all), the
// router gradient's cast to bf16 for its GEMMs, the step loss's sum of auxiliary losses, and the
// pipeline-stage head (a middle stage's loss against the gradient the next stage would send).
// Every one is deterministic (fixed-order sums, no float atomics) and capturable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace replay::moe {

// MLA's per-head keys and values. kvb [M, H, Dn + Dv] is the KV up-projection's output (per head
// its Dn no-position key channels, then its Dv value channels); kpe [M, Dr] the RoPE key shared by
// every head (already rotated). Writes
//   k [M, H, Dn + Dr]: k[t, h] = (kvb[t, h, 0:Dn], kpe[t])      v [M, H, Dv]: kvb[t, h, Dn:]
// Dn, Dr, Dv multiples of 8; every pointer 16-byte aligned.
struct MlaDims {
  int64_t tokens = 0;  // M
  int heads = 0;       // H
  int nope = 0;        // Dn
  int rope = 0;        // Dr
  int v = 0;           // Dv
  int qk() const { return nope + rope; }
};
void mla_assemble_kv(__nv_bfloat16* k, __nv_bfloat16* v, const __nv_bfloat16* kvb,
                     const __nv_bfloat16* kpe, const MlaDims& d, cudaStream_t stream);
// Its backward: dkvb[t, h] = (dk[t, h, 0:Dn], dv[t, h]); dkpe[t] = sum over h = 0, 1, ... of
// dk[t, h, Dn:] in fp32, rounded once.
void mla_assemble_kv_backward(__nv_bfloat16* dkvb, __nv_bfloat16* dkpe, const __nv_bfloat16* dk,
                              const __nv_bfloat16* dv, const MlaDims& d, cudaStream_t stream);

// local[i] = global[i] % local_experts (-1 stays -1), for n indices: expert e of the global set is
// local expert e mod local_experts. With one process standing for one rank of an expert-parallel
// group of E / local ranks, the rank's local experts then receive this process's assignments to
// every rank's experts: as many (E / local times this rank's share) as a rank of the layout
// receives from all ranks' tokens, with the same statistics.
void moe_fold_indices(int32_t* local, const int32_t* global, int64_t n, int local_experts,
                      cudaStream_t stream);

// out[i] = bf16(in[i]) (round to nearest even), n elements.
void moe_to_bf16(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream);

// out[0] = (in != null ? in[0] : 1) * factor (one thread): expert parallelism's backward scale,
// the loss scale over the ranks.
void moe_scale_scalar(float* out, const float* in, float factor, cudaStream_t stream);

// loss[0] += terms[0] + terms[1] + ... + terms[n - 1], in that order (one thread).
void moe_add_terms(float* loss, const float* terms, int n, cudaStream_t stream);

// A pipeline middle stage's head. The stage's output y [n] and the gradient g [n] the next stage
// sends (fixed here) define loss = sum_i y_i g_i / n (so dL/dy = g / n). Forward: per-block
// partial sums over fixed ranges, reduced in order by one block. partials: stage_head_partials(n)
// floats.
int64_t stage_head_partials(int64_t n);
void stage_head_forward(float* loss, float* partials, const __nv_bfloat16* y,
                        const __nv_bfloat16* g, int64_t n, cudaStream_t stream);
// dy = g * (scale[0] / n) (scale: the loss scale, a device pointer; null: 1).
void stage_head_backward(__nv_bfloat16* dy, const __nv_bfloat16* g, const float* scale, int64_t n,
                         cudaStream_t stream);

}  // namespace replay::moe
