// model.h: Transformer, one GPU's shard of a decoder-only transformer. By default
// (TransformerShape's defaults) a GPT-3 style decoder: token + learned position embedding
// (vocab-parallel), pre-LayerNorm blocks of causal self-attention (QKV GEMM with bias, cuDNN
// attention on the fused QKV layout, output GEMM, bias-dropout-residual) and a GeLU MLP (GEMM
// epilogues), a final LayerNorm, and the tied LM head with the vocab-parallel fused cross-entropy.
// The shape's options turn it into a Llama: RMSNorm, rotary embeddings applied in place to the q
// and k heads of the fused QKV output (no position table), grouped-query attention (fewer k/v heads
// in the fused row), a SwiGLU MLP whose gate and up projections are one GEMM, no biases, and an
// untied LM head. Forward and backward of all of it, every buffer planned in the run's arena.
//
// One micro-batch runs in phases (the arena lifetimes below): embedding forward, layer 0..L-1
// forward, head (final norm, logits, loss and their backward), layer L-1..0 backward, embedding
// backward; after the last micro-batch the optimizer. Saved activations live from their layer's
// forward to its backward; the forward scratch, the backward scratch and the workspaces are shared
// by all layers, and buffers of disjoint phases share memory.
//
// Per layer, M = micro_batch * seq tokens, C = hidden, A = attention width per GPU, W = fused QKV
// width (A + 2 x kv heads x head dim), F = MLP width, F1 = fc1 width (F, or 2F with SwiGLU):
//   h1 = norm1(x)                                 mean1 (LayerNorm), rstd1, h1 saved
//   qkv = h1 Wqkv^T (+ bqkv)        [M, W]        GEMM (bias epilogue); RoPE rotates its q and k
//                                                 heads in place; saved
//   o, lse = attention(qkv)         [M, A]        cuDNN, causal, fused QKV (GQA), dropout; saved
//   x_mid = x + dropout(o Wproj^T (+ bproj))      GEMM, then the fused bias-dropout-residual; saved
//   h2 = norm2(x_mid)                             saved
//   GeLU:   a = gelu(h2 W1^T + b1), aux = the pre-activation     GEMM epilogue; both saved
//   SwiGLU: aux = h2 W1^T [M, 2F], a = silu(gate) * up [M, F]    GEMM, then swiglu; both saved
//   x_out = x_mid + dropout(a W2^T (+ b2))        GEMM, bias-dropout-residual
// Backward: the residual gradient G (bf16) flows through every layer in place: each norm's
// backward adds its dx into G (accumulate_dx). Weight gradients are fp32, written by the first
// micro-batch (beta 0) and accumulated by the others (beta 1). GeLU: fc2's dgrad applies gelu'(aux)
// (DGeLU epilogue); SwiGLU: fc2's dgrad, then swiglu_backward. The QKV and fc1 bias gradients come
// from their wgrad GEMMs (BGRADA epilogue, fp32), the output-projection and fc2 bias gradients from
// the dropout backward; without biases and dropout the branch gradient is G itself. RoPE's
// backward rotates the q and k gradients of dQKV back before the QKV GEMM's backward.
// The tied embedding: the embedding backward writes the token rows of dW_emb (and dW_pos), then the
// LM head's wgrad adds dlogits^T h_final into it (beta 1), so no buffer is zeroed in the step. An
// untied LM head takes its own wgrad in the head phase.
//
// With tensor parallelism the output projection, fc2 and the embedding are partial sums that an
// all-reduce would complete, and the cross-entropy statistics would be all-gathered; run as one
// process the shard computes rank 0's work with those collectives left out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/arena.h"
#include "common/attention.h"
#include "common/comm.h"
#include "common/context.h"
#include "common/gemm.h"
#include "common/philox.h"
#include "graphs/rng.h"
#include "graphs/step_plan.h"
#include "train/params.h"
#include "workloads/transformer/shape.h"

namespace replay::transformer {

using train::ParamId;
using train::ParamInit;
using train::ParamSpec;
using train::ParamStore;
using train::TpSplit;

// The parameters of one block, in the order they sit in the ParamStore (contiguous per layer).
// Those the shape leaves out (norm shifts with RMSNorm, biases) are -1.
struct LayerParams {
  ParamId ln1_gamma = -1, ln1_beta = -1, qkv_weight = -1, qkv_bias = -1, proj_weight = -1,
          proj_bias = -1;
  ParamId ln2_gamma = -1, ln2_beta = -1, fc1_weight = -1, fc1_bias = -1, fc2_weight = -1,
          fc2_bias = -1;
  ParamId first() const { return ln1_gamma; }
  ParamId last() const { return fc2_bias >= 0 ? fc2_bias : fc2_weight; }
};

class Transformer {
 public:
  // Registers the parameters, builds every GEMM and attention plan through the caches (set-up),
  // and queries the workspaces.
  // `tp`: the tensor-parallel group when this process is one of shape.tp ranks (rank
  // shape.tp_rank), which runs the collectives; null in a one-process run (a tp > 1 shape then
  // computes rank 0's shard without them).
  Transformer(const Context& ctx, const TransformerShape& shape, int microbatches, GemmCache& gemms,
              AttentionCache& attention, comm::Communicator* tp = nullptr);
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const TransformerShape& shape() const { return shape_; }
  int microbatches() const { return microbatches_; }
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  const LayerParams& layer_params(int layer) const {
    return layers_.at(static_cast<size_t>(layer));
  }
  ParamId token_embedding() const { return wte_; }
  ParamId position_embedding() const { return wpe_; }  // -1 without learned positions
  ParamId lm_head() const { return lm_head_w_; }       // -1 when tied to the token embedding

  // Step phases (arena lifetimes), in execution order within a micro-batch.
  int phase_embedding_forward() const { return 1; }
  int phase_layer_forward(int layer) const { return 2 + layer; }
  int phase_head() const { return 2 + num_layers(); }
  int phase_layer_backward(int layer) const { return 3 + 2 * num_layers() - 1 - layer; }
  int phase_embedding_backward() const { return 3 + 2 * num_layers(); }
  int phase_optimizer() const { return 4 + 2 * num_layers(); }

  // Adds every buffer (parameters, optimizer state, inputs, activations, workspaces) to the plan.
  void plan(ArenaPlan& plan);
  void bind(const Arena& arena);
  // Set-up: parameters from `seed`, the constant loss gradient, and where the step's loss (the
  // mean over micro-batches) goes. Synchronizes `stream`. The shard trains in bf16 without loss
  // scaling: its loss gradient is not scaled.
  void initialize(uint64_t seed, float* step_loss, cudaStream_t stream);
  // Registers the random ops (attention dropout on the tensor-parallel stream, hidden dropout on
  // the data-parallel stream), one per micro-batch and layer. Nothing when dropout is 0.
  void register_rng(graphs::RngTracker& rng);

  // The step's work for micro-batch `mb`, launched on `stream` only (capturable).
  void embedding_forward(int mb, cudaStream_t stream) const;
  void layer_forward(int mb, int layer, cudaStream_t stream) const;
  void head(int mb, cudaStream_t stream) const;  // final norm, logits, loss, and their backward
  void layer_backward(int mb, int layer, cudaStream_t stream) const;
  void embedding_backward(int mb, cudaStream_t stream) const;  // and the tied LM head's wgrad
  // Evaluation of micro-batch 0's inputs after embedding_forward(0) and layer_forward(0, l): the
  // final norm, the logits and the mean cross-entropy into *batch_loss, added to *loss_sum. No
  // backward; dropout must be 0 (the forward would apply it).
  void eval_head(float* batch_loss, float* loss_sum, cudaStream_t stream) const;

  // What each of them reads and writes (region arguments of the step plan).
  graphs::RegionArgs embedding_forward_args(int mb) const;
  graphs::RegionArgs layer_forward_args(int mb, int layer) const;
  graphs::RegionArgs head_args(int mb) const;
  graphs::RegionArgs eval_head_args(float* batch_loss, float* loss_sum) const;
  graphs::RegionArgs layer_backward_args(int mb, int layer) const;
  graphs::RegionArgs embedding_backward_args(int mb) const;

  // The step's static inputs: int32 [micro_batch, seq] per micro-batch.
  int32_t* tokens(int mb) const;
  int32_t* targets(int mb) const;
  // dL/dx0 after a step's backward: the gradient of the embedding output (tests).
  const TensorView& residual_grad() const { return grad_; }

  int num_layers() const { return static_cast<int>(shape_.layers); }

 private:
  struct Linear {
    GemmPlan* forward = nullptr;
    GemmPlan* dgrad = nullptr;
    GemmPlan* wgrad[2] = {nullptr,
                          nullptr};  // [0]: first micro-batch (beta 0), [1]: later (beta 1)
  };
  // A layer's saved activations.
  struct LayerActs {
    TensorView ln1_mean, ln1_rstd, h1, qkv, attn_o, attn_stats;
    TensorView x_mid, ln2_mean, ln2_rstd, h2, fc1_out, fc1_aux;
  };
  struct Planned {
    BufferId id;
    DType dtype;
    int64_t elements;
    TensorView* view;
  };

  void add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype,
           int64_t elements, const char* group, Lifetime life);
  // Adds a layer's saved activations to a region's arguments with one access (the forward writes
  // them, the backward reads them).
  void saved_activations(graphs::RegionArgs& args, const LayerActs& a, graphs::Access access) const;
  // What both of a layer's regions list first: its input, its parameters (and the RoPE table), and
  // its saved activations with `activations` access (written by the forward, read by the backward).
  graphs::RegionArgs layer_args(int layer, graphs::Access activations) const;
  Linear make_linear(GemmCache& gemms, LinearGemms g);
  void gemm(GemmPlan* plan, GemmArgs args, cudaStream_t stream) const;
  void wgrad(const Linear& linear, GemmArgs args, ParamId bias, int64_t width, int mb,
             cudaStream_t stream) const;
  __nv_bfloat16* weight(ParamId id) const { return params_.weight<__nv_bfloat16>(id); }
  void head_forward(int mb, float* loss, cudaStream_t s) const;
  graphs::RegionArgs head_forward_args(int mb) const;
  RngArgs rng_of(const std::vector<RngArgs>& ops, int mb, int layer) const;
  float* loss_of(int mb) const;
  bool layernorm() const { return shape_.norm == NormKind::kLayerNorm; }
  bool swiglu() const { return shape_.mlp == MlpKind::kSwiGLU; }
  bool rope() const { return shape_.position == PositionKind::kRope; }
  // Without biases and dropout a branch's gradient is the residual gradient itself.
  bool branch_grad_is_residual() const { return !shape_.bias && shape_.dropout == 0.0f; }
  ParamId embedding_last() const { return wpe_ >= 0 ? wpe_ : wte_; }
  ParamId final_norm_last() const { return lnf_beta_ >= 0 ? lnf_beta_ : lnf_gamma_; }
  const __nv_bfloat16* head_weight() const;
  // The norms the shape selects; mean is unused by RMSNorm, beta and dbeta are -1 there.
  void norm_forward(__nv_bfloat16* out, const TensorView& mean, const TensorView& rstd,
                    const __nv_bfloat16* x, ParamId gamma, ParamId beta, cudaStream_t s) const;
  void norm_backward(__nv_bfloat16* dx, ParamId gamma, ParamId beta, const __nv_bfloat16* dout,
                     const __nv_bfloat16* x, const TensorView& mean, const TensorView& rstd,
                     bool accumulate_dx, bool accumulate, cudaStream_t s) const;
  // The branch gradient before a residual add: dropout's backward (with the bias gradient), or G.
  const __nv_bfloat16* branch_grad(ParamId bias, const std::vector<RngArgs>& rng, int mb, int layer,
                                   cudaStream_t s) const;
  void rope_apply(void* qkv, bool backward, cudaStream_t s) const;
  // Tensor and sequence parallelism (no-ops in a one-process run). With sequence parallelism the
  // residual stream holds this rank's seq_tokens() rows; the buffers that feed or leave the
  // tensor-parallel GEMMs hold every token.
  bool sp() const { return shape_.sequence_parallel; }
  // This rank's rows of a buffer of every token: its slice with SP, the whole buffer without.
  __nv_bfloat16* seq_slice(const TensorView& v) const;
  // SP: all-gathers, in place, the slices of `v` each rank wrote at seq_slice(v).
  void sp_gather(const TensorView& v, cudaStream_t s) const;
  // SP: this rank's rows `src` gathered from every rank into `all` (returned); otherwise `src`.
  const __nv_bfloat16* sp_gather_to(const __nv_bfloat16* src, const TensorView& all,
                                    cudaStream_t s) const;
  // The sum over the group of a row-parallel layer's partial [tokens, hidden] output (or a
  // column-parallel layer's partial input gradient) in place: an all-reduce, or with SP a
  // reduce-scatter onto this rank's slice. Returns the rows this rank goes on with.
  const __nv_bfloat16* tp_reduce(const TensorView& v, cudaStream_t s) const;
  // SP, after a step's last micro-batch: the gradients of parameters computed from token slices
  // (the norms, the row-parallel biases) summed over the group, one NCCL group.
  void sp_reduce_grads(std::initializer_list<ParamId> ids, cudaStream_t s) const;

  const Context& ctx_;
  TransformerShape shape_;
  int microbatches_;
  comm::Communicator* tp_ = nullptr;
  ParamStore params_;
  ParamId wte_ = -1, wpe_ = -1, lnf_gamma_ = -1, lnf_beta_ = -1, lm_head_w_ = -1;
  std::vector<LayerParams> layers_;

  Linear qkv_, proj_, fc1_, fc2_, lm_head_;
  const AttentionPlan* attention_ = nullptr;
  size_t gemm_ws_bytes_ = 0, attention_ws_bytes_ = 0, norm_ws_bytes_ = 0, dropout_ws_bytes_ = 0,
         embedding_ws_bytes_ = 0;
  std::vector<RngArgs> rng_attention_, rng_attn_dropout_,
      rng_mlp_dropout_;  // [mb * layers + layer]
  float* step_loss_ = nullptr;

  std::vector<Planned> planned_;
  // Inputs and constants.
  TensorView tokens_, targets_, dloss_, mb_loss_, rope_table_;
  // Forward.
  std::vector<TensorView> x_;  // residual stream: x_[0] embedding output, x_[i + 1] layer i output
  std::vector<LayerActs> acts_;
  TensorView fwd_tmp_;
  // Head.
  TensorView hf_, lnf_mean_, lnf_rstd_, logits_, ce_stats_, ce_gathered_, row_loss_, count_, d_hf_;
  // Backward.
  TensorView grad_, d_branch_, d_h_, d_fc1_, d_act_, d_attn_, d_qkv_, bias_scratch_;
  TensorView d_all_;  // SP: a branch's (or the embedding's) gradient gathered over every token
  // Workspaces.
  TensorView gemm_ws_, attention_ws_, norm_ws_, dropout_ws_, embedding_ws_;
};

}  // namespace replay::transformer
