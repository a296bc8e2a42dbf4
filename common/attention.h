// attention.h: scaled dot-product attention (forward, deterministic backward, optional dropout) on
// the cuDNN frontend. Plans are built once per shape at setup by AttentionCache and executed
// cheaply on any stream. The frontend stays inside attention.cpp (pimpl): this header is light.
//
// Layouts (row-major, strides in elements), token-major as the QKV GEMM produces them:
//   kSeparate  q [B, Sq, Hq, Dqk], k [B, Skv, Hkv, Dqk], v [B, Skv, Hkv, Dv], each contiguous
//              (row strides Hq*Dqk, Hkv*Dqk, Hkv*Dv).
//   kFusedQKV  one buffer [B, S, Hq*Dqk + Hkv*Dqk + Hkv*Dv] with S = Sq = Skv: a token's row holds
//              its q heads, then its k heads, then its v heads. q, k and v are views into it at
//              element offsets 0, k_offset() and v_offset(), all with row stride fused_row().
//   Both       o and d_o are [B, Sq, Hq, Dv] contiguous. dq, dk, dv have the layout of q, k, v
//              (kFusedQKV writes one fused dQKV buffer, what the QKV GEMM's backward reads).
//              stats is fp32 [B, Hq, Sq, 1]: the natural-log log-sum-exp of each row of scaled,
//              masked scores, saved by the forward for the backward.
//
// Determinism: by default the backward uses cuDNN's deterministic algorithm (on Hopper, dP goes
// through a workspace instead of atomic dQ accumulation), so forward and backward are
// bit-reproducible. The price is a backward workspace of about B*Hq*Sq*Skv*2 bytes and, at the
// Llama 3.1 405B TP8 shape on an H200 with cuDNN 9.14, 1.58 ms for the backward against 1.37 ms
// non-deterministic (the fastest of the six engine configs of each). deterministic = false exists
// for measuring that price (replay-ops --attention-nondeterministic); the workloads never set it.
//
// Dropout: cuDNN draws the mask itself from a Philox {seed, offset} pair it reads from device
// memory. Before each forward or backward, a one-thread kernel on the same stream writes
//     seed = slot->seed,  offset = (slot->offset + op_offset) * N,  N = B*Hq*Sq*Skv (to 16s)
// into a 32-byte scratch at the end of the caller's workspace. cuDNN does not document how it
// consumes the offset: as a base added to each attention weight's index (N counters per call) or,
// like curand, as a per-thread skip-ahead (Transformer Engine advances 16 per call of this
// engine). N counters per position covers both readings: consecutive positions never share
// counters. Distinct op_offsets keep the ops of one step apart; ops of different shapes should not
// draw from one slot's position range. The forward and backward of one op read the same slot in
// the same step, so the backward regenerates the forward's mask.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/context.h"
#include "common/philox.h"
#include "common/tensor.h"

namespace replay {

enum class AttentionLayout : uint8_t { kSeparate, kFusedQKV };

// One attention shape and its options: the cache key.
struct AttentionDesc {
  int64_t batch = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;  // heads_q % heads_kv == 0: MHA (equal), GQA, MQA (1)
  int64_t seq_q = 1;
  int64_t seq_kv = 0;        // 0: same as seq_q
  int64_t head_dim_qk = 64;  // 64, 128, 192, ... (a multiple of 8; cuDNN decides the rest)
  int64_t head_dim_v = 0;    // 0: same as head_dim_qk; 128 with head_dim_qk 192 is DeepSeek's MLA
  bool causal = false;       // top-left aligned: query i sees keys 0..i
  float scale = 0.0f;        // softmax scale; 0: 1/sqrt(head_dim_qk)
  float dropout = 0.0f;      // probability of dropping an attention weight, in [0, 1)
  AttentionLayout layout = AttentionLayout::kSeparate;
  DType dtype = DType::kBF16;  // kBF16 or kFP16 storage; softmax and accumulation in fp32
  bool deterministic = true;   // backward: bit-reproducible (see Determinism above)

  int64_t kv_len() const { return seq_kv > 0 ? seq_kv : seq_q; }
  int64_t dim_v() const { return head_dim_v > 0 ? head_dim_v : head_dim_qk; }
  float softmax_scale() const;
  // Row strides (elements between consecutive tokens) of q, k and v in this layout.
  int64_t q_row() const;
  int64_t k_row() const;
  int64_t v_row() const;
  // kFusedQKV: the fused row and the element offsets of k and v inside it.
  int64_t fused_row() const { return (heads_q + heads_kv) * head_dim_qk + heads_kv * dim_v(); }
  int64_t k_offset() const { return heads_q * head_dim_qk; }
  int64_t v_offset() const { return (heads_q + heads_kv) * head_dim_qk; }

  // Throws Error naming the field when the description is malformed (sizes, GQA ratio, head dims,
  // dropout range, layout). What cuDNN cannot run is reported when the plan is built.
  void validate() const;
  std::string describe() const;
  bool operator<(const AttentionDesc& o) const;
};

// Device pointers of one attention call. The forward reads q, k, v and writes o and stats; the
// backward reads all five. Every pointer is 16-byte aligned.
struct AttentionIO {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;
};

// The backward's gradient pointers: d_o in, dq, dk, dv out (written, not accumulated).
struct AttentionGrads {
  const void* d_o = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};

// The built forward and backward plans of one AttentionDesc. Obtained from AttentionCache only.
class AttentionPlan {
 public:
  ~AttentionPlan();
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  const AttentionDesc& desc() const { return desc_; }
  // Workspace each call needs (cuDNN's own plus, with dropout, a 32-byte RNG scratch at its end).
  size_t forward_workspace_bytes() const;
  size_t backward_workspace_bytes() const;
  // The engine cuDNN's heuristics chose, for reports.
  const std::string& forward_engine() const;
  const std::string& backward_engine() const;

  // Enqueue on `stream` (the cuDNN handle of ctx is pointed at it for the call and restored after).
  // No allocation, no synchronization, no host read of device data: safe inside stream capture.
  // rng is read only when desc().dropout > 0.
  void forward(const Context& ctx, cudaStream_t stream, const AttentionIO& io, RngArgs rng,
               void* workspace, size_t workspace_bytes) const;
  void backward(const Context& ctx, cudaStream_t stream, const AttentionIO& io,
                const AttentionGrads& grads, RngArgs rng, void* workspace,
                size_t workspace_bytes) const;

 private:
  friend class AttentionCache;
  struct Impl;
  AttentionPlan(const Context& ctx, const AttentionDesc& desc);

  AttentionDesc desc_;
  std::unique_ptr<Impl> impl_;
};

// Plans keyed by AttentionDesc. get() builds on first use: validate, build the operation graphs,
// query heuristics (mode A, then fallback), check support, build the first supported plan, query
// workspaces. A configuration cuDNN cannot run throws Error naming the desc, the stage and cuDNN's
// reason. Call it at setup, before any capture. Plans live as long as the cache, which must not
// outlive the Context whose cuDNN handle built them.
class AttentionCache {
 public:
  AttentionCache();
  ~AttentionCache();
  AttentionCache(const AttentionCache&) = delete;
  AttentionCache& operator=(const AttentionCache&) = delete;

  const AttentionPlan& get(const Context& ctx, const AttentionDesc& desc);
  size_t size() const { return plans_.size(); }
  // The largest forward or backward workspace over every cached plan: one arena buffer of this size
  // serves every attention call of a run.
  size_t max_workspace_bytes() const;

 private:
  std::map<AttentionDesc, std::unique_ptr<AttentionPlan>> plans_;
};

}  // namespace replay
