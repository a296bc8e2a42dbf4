// moe_model.h: MoeModel, one GPU's shard of DeepSeek-V3 as a train::Model. Blocks of RMSNorm, MLA
// attention and a feed-forward part: SwiGLU for the first `dense_layers` blocks, a mixture of
// experts for the rest (the fp32 group-limited sigmoid router with its auxiliary loss and its
// on-device bias update, dispatch at a capacity factor or dropless, the routed experts as batched
// cuBLASLt GEMMs over the capacity layout, one shared expert, the weighted combine). The head is
// either an LM head with cross-entropy over synthetic token data (tiny, small) or, for the
// 671b-ep32 pipeline middle stage, the loss against a fixed gradient the next stage would send,
// with the activation the previous stage would send as the input.
//
// Per block, M tokens, C hidden, H heads, Dn + Dr query/key dims per head (128 + 64), Dv (128):
//   h1 = rmsnorm(x)
//   q  = rope(rmsnorm(h1 Wqa^T) Wqb^T)            [M, H, Dn + Dr]   RoPE on the last Dr channels
//   kv = rmsnorm(h1 Wkva^T) Wkvb^T                [M, H, Dn + Dv]
//   kpe = rope(h1 Wkpe^T)                         [M, Dr]          one RoPE key for every head
//   k = (kv[:, :, :Dn], kpe), v = kv[:, :, Dn:]   mla_assemble_kv
//   o = attention(q, k, v)  (cuDNN, causal, d_qk 192, d_v 128)
//   x_mid = x + o Wo^T                            GEMM with beta 1 (the residual as C)
//   h2 = rmsnorm(x_mid)
//   dense:  out = x_mid + swiglu(h2 W1^T) W2^T
//   MoE:    logits = h2 Wr^T (fp32 out)  -> router_forward (indices, weights), aux loss, load,
//           bias update; dispatch (fold to the local experts, counting sort, gather);
//           out = x_mid + swiglu(h2 Ws1^T) Ws2^T (shared expert) + combine(experts(x_sorted))
// Backward mirrors it; the residual gradient G flows through every block in place (the norms'
// backward adds into it). Weight gradients are written (one micro-batch per step).
//
// Regions: per block `layerL.fwd` and `layerL.bwd`, or, with graph scopes, each block split into
// its parts with their scope: attn, mlp (dense), moe_router, moe_preprocess, moe_experts; in layer
// mode only the parts of the named scopes are graphs (Region::graphable), the others run eagerly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/attention.h"
#include "common/comm.h"
#include "common/context.h"
#include "common/gemm.h"
#include "train/model.h"
#include "workloads/moe/dispatch.h"
#include "workloads/moe/router.h"
#include "workloads/moe/yarn.h"

namespace replay::moe {

enum class HeadKind { kLmHead, kPipelineStage };

struct MoeShape {
  int64_t micro_batch = 2;
  int64_t seq = 64;
  int64_t hidden = 128;
  int64_t vocab = 512;  // kLmHead only
  HeadKind head = HeadKind::kLmHead;
  int64_t heads = 2;
  int64_t q_lora = 64;
  int64_t kv_lora = 64;
  int64_t nope_dim = 128;
  int64_t rope_dim = 64;
  int64_t v_dim = 128;
  double rope_theta = 10000.0;
  YarnScaling yarn;  // DeepSeek-V3's RoPE scaling (yarn.h): the table and the softmax scale
  int64_t dense_layers = 1;
  int64_t moe_layers = 1;
  int64_t dense_ffn = 256;
  int experts = 8;        // routed experts of the whole model
  int local_experts = 8;  // on this GPU (experts / expert-parallel ranks)
  int groups = 4;
  int topk_groups = 2;
  int topk = 2;
  int64_t expert_ffn = 64;
  int64_t shared_ffn = 64;  // this GPU's share of the shared expert
  float route_scale = 2.5f;
  float norm_eps = 1e-6f;
  float bias_rate = 1e-3f;
  float aux_coeff = 0.01f;
  double capacity_factor = 1.0;  // 0: dropless
  int64_t data_batches = 64;     // synthetic token batches (kLmHead)
  // Expert parallelism (--ep): `ep` ranks, this one `ep_rank`, each holding local_experts =
  // experts / ep consecutive experts and routing its own micro-batch; the dispatch and combine are
  // NCCL all-to-alls. ep 1: one process with every expert local (no exchange, no fold).
  int ep = 1;
  int ep_rank = 0;

  int64_t tokens() const { return micro_batch * seq; }
  int64_t layers() const { return dense_layers + moe_layers; }
  int64_t qk_dim() const { return nope_dim + rope_dim; }
  bool dropless() const { return capacity_factor <= 0.0; }
  // Rows per local expert in the dispatched buffer: ceil(F * M * topk / local) at a capacity
  // factor (at most what an expert can receive), or that most (dropless).
  int64_t capacity() const;
  int64_t max_per_expert() const;  // the most assignments one local expert can receive
  // Expert parallelism: rows each rank sends to each global expert, Cs = moe_capacity(F, tokens,
  // topk, experts) (the rest dropped on the sending rank); a local expert then holds ep x Cs rows
  // (capacity()), one block of Cs per source rank.
  int64_t ep_capacity() const;
  // What the counting sort runs over: this rank's assignments over the local experts (ep 1, the
  // fold) or over every global expert with Cs rows each (ep > 1: the all-to-all's send buffer).
  DispatchShape dispatch_shape() const;
  // Throws Error naming what is malformed.
  void validate() const;
};

class MoeModel : public train::Model {
 public:
  // `scopes`: the graph scopes (empty: one region per block and direction). `ep_comm`: the
  // expert-parallel group (shape.ep > 1; null otherwise), connecting shape.ep ranks.
  MoeModel(const Context& ctx, const MoeShape& shape, uint64_t data_seed,
           std::vector<std::string> scopes, comm::Communicator* ep_comm = nullptr);
  ~MoeModel() override;

  std::string describe() const override;
  train::ParamStore& params() override { return params_; }
  const train::ParamStore& params() const override { return params_; }
  void plan(ArenaPlan& plan) override;
  void bind(const Arena& arena) override;
  void initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) override;
  std::vector<graphs::Region> regions() override;
  int load_batch(cudaStream_t stream) override;
  int64_t data_position() const override { return next_batch_; }
  void seek_data(int64_t position) override;
  std::vector<NamedTensor> checkpoint_state() const override;
  double flops_per_step() const override;
  std::string flops_formula() const override;
  double units_per_step() const override { return static_cast<double>(shape_.tokens()); }
  double samples_per_step() const override { return static_cast<double>(shape_.micro_batch); }
  std::string collectives() const override;
  double loss_floor() const override;

  const MoeShape& shape() const { return shape_; }
  // After a step (synchronizes: tests and reports): per MoE block the assignments dropped at the
  // capacity, the routed count per global expert, and the router biases.
  std::vector<int32_t> dropped() const;
  std::vector<int32_t> routed_counts(int moe_block) const;
  std::vector<float> router_bias(int moe_block) const;
  // The router's selection of the last forward, [tokens, topk] global expert indices (tests: read
  // it after the forward, before the backward's phases can reuse its memory).
  std::vector<int32_t> router_indices(int moe_block) const;
  // Model FLOPs of the routed expert GEMMs in one step (forward and backward, the kept
  // assignments as counted by the routed shape: M * topk rows), and as executed (capacity rows).
  double expert_flops_routed() const;
  double expert_flops_executed() const;
  // A diagnostic, after at least one step and outside any capture (synchronizes after every
  // part): `reps` times the step's regions in order without the optimizer, each block's parts
  // timed eagerly with events, and the routed experts' GEMMs run once more right after their part
  // on the same inputs (same outputs: deterministic) and timed alone. Returns the mean time per
  // step in ms by key: "<scope>.fwd", "<scope>.bwd", "expert_gemm.fwd", "expert_gemm.bwd",
  // "head", "embedding".
  std::vector<std::pair<std::string, double>> time_parts(cudaStream_t stream, int reps);
  // Tests (a pipeline-stage head): the stage's input, the next stage's gradient, the last block's
  // output (valid after the head, before the backward reuses its memory) and the residual
  // gradient (after the backward: the gradient of the loss by the stage's input).
  const TensorView& stage_input() const { return x_.front(); }
  const TensorView& stage_gradient() const { return stage_grad_; }
  const TensorView& output() const { return x_.back(); }
  const TensorView& residual_gradient() const { return grad_; }

 private:
  struct Plans;
  struct Block;
  struct Part;
  struct Planned {
    BufferId id;
    DType dtype;
    int64_t elements;
    TensorView* view;
  };

  void add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype,
           int64_t elements, Lifetime life);
  void gemm(GemmPlan* plan, const void* a, const void* b, void* d, cudaStream_t s,
            const void* c = nullptr) const;
  std::vector<Part> forward_parts(int layer);
  std::vector<Part> backward_parts(int layer);
  void embedding_forward(cudaStream_t s) const;
  void head(cudaStream_t s) const;
  void embedding_backward(cudaStream_t s) const;
  // The scale the backward starts from: the loss scale, divided by ep (ep > 1: each rank's loss is
  // 1/ep of the step's, so the experts' gradients, summed over every rank's tokens, and the
  // replicated parameters' gradients, summed by the all-reduce, are those of the mean loss).
  const float* backward_scale() const;
  // ep > 1: the replicated parameters' gradients summed over the expert-parallel group.
  void reduce_replicated_grads(cudaStream_t s) const;

  const Context& ctx_;
  MoeShape shape_;
  comm::Communicator* ep_comm_ = nullptr;
  // ep > 1: the replicated parameters as ranges of consecutive ids [first, last] (the experts'
  // weights, held per rank, between them).
  std::vector<std::pair<train::ParamId, train::ParamId>> replicated_;
  std::vector<std::string> scopes_;
  train::ParamStore params_;
  GemmCache gemms_;
  std::unique_ptr<Plans> plans_;
  AttentionCache attention_cache_;
  const AttentionPlan* attention_ = nullptr;
  std::vector<std::unique_ptr<Block>> blocks_;
  train::ParamId wte_ = -1, lnf_ = -1, lm_head_ = -1;
  train::StepIO io_;
  std::vector<Planned> planned_;

  // Data (kLmHead): synthetic token sequences in pinned host memory, [batches, M + 1]-ish rows.
  uint64_t data_seed_ = 0;
  int32_t* host_tokens_ = nullptr;
  int32_t* host_targets_ = nullptr;
  int64_t next_batch_ = 0;

  // Inputs, the residual stream and the head.
  TensorView tokens_, targets_, rope_q_table_, stage_grad_;
  std::vector<TensorView> x_;  // x_[0] the input activation, x_[l + 1] block l's output
  TensorView hf_, lnf_rstd_, logits_, ce_stats_, row_loss_, count_, stage_partials_, aux_losses_;
  TensorView grad_, d_hf_;
  // Shared scratch.
  TensorView gemm_ws_, attention_ws_, norm_ws_, dispatch_ws_, embedding_ws_;
  size_t gemm_ws_bytes_ = 0, attention_ws_bytes_ = 0, norm_ws_bytes_ = 0, dispatch_ws_bytes_ = 0,
         embedding_ws_bytes_ = 0;
  // Forward scratch (every block's), backward scratch (every block's).
  TensorView kvb_, kpe_;
  TensorView dh_, d_o_, dq_, dk_, dv_, dkvb_, dkpe_, d_kv_latn_, d_kv_lat_, d_q_latn_, d_q_lat_;
  TensorView d_s_, d_a_;                             // dense and shared-expert SwiGLU
  TensorView dy_sorted_, d_act_, d_up_, dx_sorted_;  // routed experts
  TensorView dweights_, dlogits_, dlogits_bf_;       // router
  // Expert parallelism: two exchange buffers (send and receive, [rows, hidden] each) shared by the
  // blocks forward and backward, and the backward's starting scale.
  TensorView ep_a_, ep_b_, ep_scale_;
};

}  // namespace replay::moe
