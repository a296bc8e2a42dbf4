// model.cpp: the transformer shard (GPT-3 or Llama options): parameters, plans, buffers, forward
// and backward.
#include "workloads/transformer/model.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/kernels/cross_entropy.h"
#include "common/kernels/dropout.h"
#include "common/kernels/embedding.h"
#include "common/kernels/init.h"
#include "common/kernels/norms.h"
#include "common/kernels/activations.h"
#include "common/kernels/rope.h"
#include "common/kernels/accumulate.h"

namespace replay::transformer {

namespace {

using bf16 = __nv_bfloat16;

template <typename T>
T* ptr(const TensorView& v) {
  return static_cast<T*>(v.data);
}

bf16* offset(const TensorView& v, int64_t elements) {
  return ptr<bf16>(v) + elements;
}

}  // namespace

Transformer::Transformer(const Context& ctx, const TransformerShape& shape, int microbatches,
                         GemmCache& gemms, AttentionCache& attention, comm::Communicator* tp)
    : ctx_(ctx), shape_(shape), microbatches_(microbatches), tp_(tp) {
  shape_.validate();
  REPLAY_REQUIRE(tp == nullptr || (tp->size() == shape_.tp && tp->rank() == shape_.tp_rank),
                 "Transformer: the tensor-parallel group does not match the shape's tp and rank");
  REPLAY_REQUIRE(!shape_.sequence_parallel || tp != nullptr,
                 "Transformer: sequence parallelism needs the tensor-parallel group's processes");
  if (tp_ != nullptr) params_.set_tensor_parallel(shape_.tp_rank, shape_.tp);
  REPLAY_REQUIRE(microbatches >= 1, "at least one micro-batch per step");
  const int64_t C = shape_.hidden, A = shape_.attn_width(), W = shape_.qkv_width(),
                F = shape_.ffn_shard(), F1 = shape_.fc1_width(), V = shape_.vocab_shard();
  const int64_t M = shape_.tokens(), Ms = shape_.seq_tokens(), L = shape_.layers;
  const bool bias = shape_.bias, ln = layernorm();

  // Parameters: GPT-2/Megatron initialization, N(0, 0.02) with the residual-branch output layers
  // scaled by 1/sqrt(2L); biases and LayerNorm shifts zero, LayerNorm scales one. Weight decay on
  // matrices and embeddings only.
  const float out_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  // Replicated under tensor parallelism: the norms, the row-parallel biases, the position table.
  auto replicated = [](const std::string& name) {
    return name.find(".ln") != std::string::npos || name.rfind("final_norm", 0) == 0 ||
           name == "embedding.position" || name.find("attn.proj.bias") != std::string::npos ||
           name.find("mlp.fc2.bias") != std::string::npos;
  };
  // Sharded ones say where they sit in the full tensor (train/params.h TpSplit), so a
  // tensor-parallel run starts from the weights one process draws for the whole model.
  auto add_param = [&](std::string name, std::vector<int64_t> dims, ParamInit init, float stddev,
                       bool decay, TpSplit split = TpSplit::kNone,
                       std::vector<int64_t> sections = {}) {
    const bool rep = replicated(name);
    return params_.add(ParamSpec{std::move(name), std::move(dims), init, stddev, decay, rep, split,
                                 std::move(sections)});
  };
  const int64_t hd = shape_.head_dim;
  const std::vector<int64_t> qkv_sections = {
      shape_.heads_shard() * hd, shape_.kv_heads_shard() * hd, shape_.kv_heads_shard() * hd};
  const std::vector<int64_t> fc1_sections =
      swiglu() ? std::vector<int64_t>{F, F} : std::vector<int64_t>{};
  wte_ = add_param("embedding.token", {V, C}, ParamInit::kNormal, 0.02f, true, TpSplit::kRows);
  if (shape_.position == PositionKind::kLearned)
    wpe_ = add_param("embedding.position", {shape_.seq, C}, ParamInit::kNormal, 0.02f, true);
  // A weight or bias the shape leaves out stays -1.
  // The column-parallel biases split as their weight's rows (a checkpoint puts them together).
  auto add_if = [&](bool present, std::string name, std::vector<int64_t> dims, ParamInit init,
                    TpSplit split = TpSplit::kNone, std::vector<int64_t> sections = {}) {
    return present ? add_param(std::move(name), std::move(dims), init, 0, false, split,
                               std::move(sections))
                   : ParamId{-1};
  };
  for (int64_t l = 0; l < L; ++l) {
    const std::string n = "layer" + std::to_string(l) + ".";
    LayerParams p{};
    p.ln1_gamma = add_param(n + "ln1.weight", {C}, ParamInit::kOnes, 0, false);
    p.ln1_beta = add_if(ln, n + "ln1.bias", {C}, ParamInit::kZeros);
    p.qkv_weight = add_param(n + "attn.qkv.weight", {W, C}, ParamInit::kNormal, 0.02f, true,
                             TpSplit::kRows, qkv_sections);
    p.qkv_bias =
        add_if(bias, n + "attn.qkv.bias", {W}, ParamInit::kZeros, TpSplit::kRows, qkv_sections);
    p.proj_weight = add_param(n + "attn.proj.weight", {C, A}, ParamInit::kNormal, out_std, true,
                              TpSplit::kCols);
    p.proj_bias = add_if(bias, n + "attn.proj.bias", {C}, ParamInit::kZeros);
    p.ln2_gamma = add_param(n + "ln2.weight", {C}, ParamInit::kOnes, 0, false);
    p.ln2_beta = add_if(ln, n + "ln2.bias", {C}, ParamInit::kZeros);
    p.fc1_weight = add_param(n + "mlp.fc1.weight", {F1, C}, ParamInit::kNormal, 0.02f, true,
                             TpSplit::kRows, fc1_sections);
    p.fc1_bias =
        add_if(bias, n + "mlp.fc1.bias", {F1}, ParamInit::kZeros, TpSplit::kRows, fc1_sections);
    p.fc2_weight =
        add_param(n + "mlp.fc2.weight", {C, F}, ParamInit::kNormal, out_std, true, TpSplit::kCols);
    p.fc2_bias = add_if(bias, n + "mlp.fc2.bias", {C}, ParamInit::kZeros);
    layers_.push_back(p);
  }
  lnf_gamma_ = add_param("final_norm.weight", {C}, ParamInit::kOnes, 0, false);
  lnf_beta_ = add_if(ln, "final_norm.bias", {C}, ParamInit::kZeros);
  if (!shape_.tied_embedding)
    lm_head_w_ =
        add_param("lm_head.weight", {V, C}, ParamInit::kNormal, 0.02f, true, TpSplit::kRows);

  // GEMM plans (gemm.h's linear layer): the QKV and fc1 bias gradients from their wgrad (BGRADA,
  // fp32). GeLU: fc1's forward keeps the pre-activation, fc2's dgrad applies its derivative.
  // SwiGLU: fc1 writes the fused gate and up pre-activation, the swiglu kernels do the rest.
  qkv_ = make_linear(gemms, linear_gemms(M, C, W, bias, false));
  proj_ = make_linear(gemms, linear_gemms(M, A, C, false, false));
  LinearGemms fc1 = linear_gemms(M, C, F1, bias, false);
  if (!swiglu()) fc1.forward.epilogue = bias ? Epilogue::kBiasGeluAux : Epilogue::kGeluAux;
  fc1_ = make_linear(gemms, fc1);
  LinearGemms fc2 = linear_gemms(M, F, C, false, false);
  if (!swiglu()) fc2.dgrad.epilogue = Epilogue::kDGelu;
  fc2_ = make_linear(gemms, fc2);
  if (shape_.tied_embedding) {
    // The tied LM head: logits = h W_emb^T; its wgrad always adds to the embedding backward's
    // rows.
    const LinearGemms head = linear_gemms(M, C, V, false, true);
    lm_head_.forward = &gemms.get(head.forward);
    lm_head_.dgrad = &gemms.get(head.dgrad);
    lm_head_.wgrad[0] = lm_head_.wgrad[1] = &gemms.get(head.wgrad);
  } else {
    lm_head_ = make_linear(gemms, linear_gemms(M, C, V, false, false));
  }

  AttentionDesc att;
  att.batch = shape_.micro_batch;
  att.heads_q = shape_.heads_shard();
  att.heads_kv = shape_.kv_heads_shard();
  att.seq_q = shape_.seq;
  att.head_dim_qk = shape_.head_dim;
  att.causal = true;
  att.dropout = shape_.dropout;
  att.layout = AttentionLayout::kFusedQKV;
  att.dtype = DType::kBF16;
  attention_ = &attention.get(ctx_, att);

  gemm_ws_bytes_ = std::max<size_t>(gemms.max_workspace_bytes(), 256);
  attention_ws_bytes_ = std::max<size_t>(
      {attention_->forward_workspace_bytes(), attention_->backward_workspace_bytes(), size_t{256}});
  norm_ws_bytes_ = ln ? layernorm_backward_workspace_bytes(Ms, static_cast<int>(C))
                      : rmsnorm_backward_workspace_bytes(Ms, static_cast<int>(C));
  dropout_ws_bytes_ = dropout_residual_backward_workspace_bytes(Ms, static_cast<int>(C));
  embedding_ws_bytes_ = embedding_backward_workspace_bytes(
      EmbeddingShape{shape_.micro_batch, shape_.seq, C, shape_.vocab_start(), V});

  x_.resize(static_cast<size_t>(L) + 1);
  acts_.resize(static_cast<size_t>(L));
}

Transformer::Linear Transformer::make_linear(GemmCache& gemms, LinearGemms g) {
  Linear l;
  l.forward = &gemms.get(g.forward);
  l.dgrad = &gemms.get(g.dgrad);
  l.wgrad[0] = &gemms.get(g.wgrad);
  g.wgrad.beta = 1.0f;
  l.wgrad[1] = microbatches_ > 1 ? &gemms.get(g.wgrad) : nullptr;
  return l;
}

void Transformer::add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype,
                      int64_t elements, const char* group, Lifetime life) {
  planned_.push_back(Planned{plan.add(name, dtype, elements, group, life), dtype, elements, &view});
}

void Transformer::plan(ArenaPlan& plan) {
  REPLAY_REQUIRE(planned_.empty(), "Transformer::plan called twice");
  const int64_t C = shape_.hidden, A = shape_.attn_width(), W = shape_.qkv_width(),
                F = shape_.ffn_shard(), F1 = shape_.fc1_width(), V = shape_.vocab_shard();
  const int64_t M = shape_.tokens(), Ms = shape_.seq_tokens(), n = microbatches_;
  const int L = num_layers();
  const bool ln = layernorm();
  const Lifetime forever{};
  const Lifetime head{phase_head(), phase_head()};
  const Lifetime head_to_end{phase_head(), phase_embedding_backward()};
  // The tied LM head's wgrad runs in the embedding backward: its inputs live until then.
  const Lifetime head_wgrad_inputs = shape_.tied_embedding ? head_to_end : head;
  const Lifetime backward{phase_layer_backward(L - 1), phase_layer_backward(0)};
  const DType kBF = DType::kBF16, kF32 = DType::kFP32, kI32 = DType::kINT32, kU8 = DType::kUINT8;

  params_.plan(plan, {phase_optimizer(), phase_optimizer()});
  add(plan, tokens_, "input.tokens", kI32, n * M, "inputs", forever);
  add(plan, targets_, "input.targets", kI32, n * M, "inputs", forever);
  add(plan, dloss_, "loss.dloss", kF32, 1, "inputs", forever);
  add(plan, mb_loss_, "loss.micro_batches", kF32, n, "inputs", forever);
  if (rope())  // (cos, sin) per position and frequency, built at set-up
    add(plan, rope_table_, "rope.table", kF32, shape_.seq * shape_.head_dim, "inputs", forever);

  // The residual stream and what the norms and the hidden dropout write hold Ms rows (this rank's
  // slice of the tokens under sequence parallelism); the norms' outputs, gathered for the
  // column-parallel GEMMs, hold every token.
  add(plan, x_[0], "x0", kBF, Ms * C, "activations",
      {phase_embedding_forward(), phase_layer_backward(0)});
  for (int l = 0; l < L; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    const Lifetime life{phase_layer_forward(l), phase_layer_backward(l)};
    LayerActs& a = acts_[static_cast<size_t>(l)];
    if (ln) add(plan, a.ln1_mean, p + "ln1.mean", kF32, Ms, "activations", life);
    add(plan, a.ln1_rstd, p + "ln1.rstd", kF32, Ms, "activations", life);
    add(plan, a.h1, p + "ln1.out", kBF, M * C, "activations", life);
    add(plan, a.qkv, p + "attn.qkv", kBF, M * W, "activations", life);
    add(plan, a.attn_o, p + "attn.out", kBF, M * A, "activations", life);
    add(plan, a.attn_stats, p + "attn.lse", kF32, M * shape_.heads_shard(), "activations", life);
    add(plan, a.x_mid, p + "x_mid", kBF, Ms * C, "activations", life);
    if (ln) add(plan, a.ln2_mean, p + "ln2.mean", kF32, Ms, "activations", life);
    add(plan, a.ln2_rstd, p + "ln2.rstd", kF32, Ms, "activations", life);
    add(plan, a.h2, p + "ln2.out", kBF, M * C, "activations", life);
    add(plan, a.fc1_out, p + "mlp.fc1.out", kBF, M * F, "activations", life);
    add(plan, a.fc1_aux, p + "mlp.fc1.preact", kBF, M * F1, "activations", life);
    const int end = l + 1 < L ? phase_layer_backward(l + 1) : phase_head();
    add(plan, x_[static_cast<size_t>(l) + 1], "x" + std::to_string(l + 1), kBF, Ms * C,
        "activations", {phase_layer_forward(l), end});
  }
  // With SP the embedding's partial sums are reduce-scattered from here too.
  add(plan, fwd_tmp_, "forward.scratch", kBF, M * C, "activations",
      {sp() ? phase_embedding_forward() : phase_layer_forward(0), phase_layer_forward(L - 1)});

  add(plan, hf_, "head.norm.out", kBF, M * C, "activations", head_wgrad_inputs);
  add(plan, logits_, "head.logits", kBF, M * V, "activations", head_wgrad_inputs);
  if (ln) add(plan, lnf_mean_, "head.norm.mean", kF32, Ms, "activations", head);
  add(plan, lnf_rstd_, "head.norm.rstd", kF32, Ms, "activations", head);
  add(plan, ce_stats_, "head.ce.stats", kF32, cross_entropy_stats_floats(M), "activations", head);
  if (tp_ != nullptr)  // every rank's statistics, in rank order (an all-gather)
    add(plan, ce_gathered_, "head.ce.stats_gathered", kF32,
        cross_entropy_stats_floats(M) * shape_.tp, "activations", head);
  add(plan, row_loss_, "head.ce.row_loss", kF32, M, "activations", head);
  add(plan, count_, "head.ce.count", kI32, 1, "activations", head);
  add(plan, d_hf_, "head.norm.dout", kBF, M * C, "activations", head);

  add(plan, grad_, "backward.residual_grad", kBF, Ms * C, "activations", head_to_end);
  if (!branch_grad_is_residual())
    add(plan, d_branch_, "backward.branch_grad", kBF, Ms * C, "activations", backward);
  if (sp())
    add(plan, d_all_, "backward.gathered_grad", kBF, M * C, "activations",
        {phase_layer_backward(L - 1), phase_embedding_backward()});
  add(plan, d_h_, "backward.norm_out_grad", kBF, M * C, "activations", backward);
  add(plan, d_fc1_, "backward.fc1_grad", kBF, M * F1, "activations", backward);
  if (swiglu()) add(plan, d_act_, "backward.swiglu_out_grad", kBF, M * F, "activations", backward);
  add(plan, d_attn_, "backward.attn_out_grad", kBF, M * A, "activations", backward);
  add(plan, d_qkv_, "backward.qkv_grad", kBF, M * W, "activations", backward);
  if (n > 1 && shape_.bias)
    add(plan, bias_scratch_, "backward.bias_grad", kF32, std::max(F1, W), "activations", backward);

  add(plan, gemm_ws_, "gemm.workspace", kU8, static_cast<int64_t>(gemm_ws_bytes_), "workspace",
      {phase_embedding_forward(), phase_embedding_backward()});
  add(plan, attention_ws_, "attention.workspace", kU8, static_cast<int64_t>(attention_ws_bytes_),
      "workspace", {phase_layer_forward(0), phase_layer_backward(0)});
  add(plan, norm_ws_, ln ? "layernorm.workspace" : "rmsnorm.workspace", kU8,
      static_cast<int64_t>(norm_ws_bytes_), "workspace", {phase_head(), phase_layer_backward(0)});
  if (!branch_grad_is_residual())
    add(plan, dropout_ws_, "dropout.workspace", kU8, static_cast<int64_t>(dropout_ws_bytes_),
        "workspace", backward);
  add(plan, embedding_ws_, "embedding.workspace", kU8, static_cast<int64_t>(embedding_ws_bytes_),
      "workspace", {phase_embedding_backward(), phase_embedding_backward()});
}

void Transformer::bind(const Arena& arena) {
  REPLAY_REQUIRE(!planned_.empty(), "Transformer::bind before plan");
  params_.bind(arena);
  for (const Planned& p : planned_) *p.view = arena.view(p.id, p.dtype, {p.elements});
}

void Transformer::initialize(uint64_t seed, float* step_loss, cudaStream_t stream) {
  REPLAY_REQUIRE(step_loss != nullptr, "Transformer::initialize: where the step's loss goes");
  step_loss_ = step_loss;
  params_.initialize(seed, stream);
  if (rope()) {
    const RopeScaling scaling =
        shape_.rope_llama31_scaling ? RopeScaling::llama31() : RopeScaling{};
    rope_build_table(static_cast<float2*>(rope_table_.data), static_cast<int>(shape_.seq),
                     static_cast<int>(shape_.head_dim), shape_.rope_theta, scaling, stream);
  }
  // The gradient of the step's loss with respect to each micro-batch's mean loss.
  init_constant(dloss_, 1.0f / static_cast<float>(microbatches_), stream);
  REPLAY_CUDA_CHECK(cudaMemsetAsync(mb_loss_.data, 0, mb_loss_.bytes(), stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void Transformer::register_rng(graphs::RngTracker& rng) {
  if (shape_.dropout == 0.0f) return;
  for (int mb = 0; mb < microbatches_; ++mb) {
    for (int l = 0; l < num_layers(); ++l) {
      const std::string op = "mb" + std::to_string(mb) + ".layer" + std::to_string(l);
      rng_attention_.push_back(rng.register_op(graphs::kTensorParallelRng, op + ".attention"));
      rng_attn_dropout_.push_back(rng.register_op(graphs::kDataParallelRng, op + ".attn.dropout"));
      rng_mlp_dropout_.push_back(rng.register_op(graphs::kDataParallelRng, op + ".mlp.dropout"));
    }
  }
}

RngArgs Transformer::rng_of(const std::vector<RngArgs>& ops, int mb, int layer) const {
  if (ops.empty()) return RngArgs{};  // dropout 0: no random op reads its slot
  return ops.at(static_cast<size_t>(mb * num_layers() + layer));
}

float* Transformer::loss_of(int mb) const {
  REPLAY_REQUIRE(step_loss_ != nullptr, "Transformer: initialize before running a step");
  return microbatches_ == 1 ? step_loss_ : ptr<float>(mb_loss_) + mb;
}

int32_t* Transformer::tokens(int mb) const {
  return ptr<int32_t>(tokens_) + mb * shape_.tokens();
}
int32_t* Transformer::targets(int mb) const {
  return ptr<int32_t>(targets_) + mb * shape_.tokens();
}

void Transformer::gemm(GemmPlan* plan, GemmArgs args, cudaStream_t stream) const {
  args.workspace = gemm_ws_.data;
  args.workspace_bytes = gemm_ws_.bytes();
  plan->run(stream, args);
}

// ---- Shared pieces ----------------------------------------------------------------------------

const bf16* Transformer::head_weight() const {
  return weight(shape_.tied_embedding ? wte_ : lm_head_w_);
}

void Transformer::norm_forward(bf16* out, const TensorView& mean, const TensorView& rstd,
                               const bf16* x, ParamId gamma, ParamId beta, cudaStream_t s) const {
  const int64_t M = shape_.seq_tokens();  // the norms run on the residual stream's rows
  const int C = static_cast<int>(shape_.hidden);
  if (layernorm())
    layernorm_forward(out, ptr<float>(mean), ptr<float>(rstd), x, weight(gamma), weight(beta), M, C,
                      shape_.norm_eps, s);
  else
    rmsnorm_forward(out, ptr<float>(rstd), x, weight(gamma), M, C, shape_.norm_eps, s);
}

void Transformer::norm_backward(bf16* dx, ParamId gamma, ParamId beta, const bf16* dout,
                                const bf16* x, const TensorView& mean, const TensorView& rstd,
                                bool accumulate_dx, bool accumulate, cudaStream_t s) const {
  const int64_t M = shape_.seq_tokens();
  const int C = static_cast<int>(shape_.hidden);
  const ParamStore& w = params_;
  if (layernorm())
    layernorm_backward(dx, w.grad(gamma), w.grad(beta), dout, x, weight(gamma), ptr<float>(mean),
                       ptr<float>(rstd), M, C, accumulate_dx, accumulate, norm_ws_.data,
                       norm_ws_.bytes(), s);
  else
    rmsnorm_backward(dx, w.grad(gamma), dout, x, weight(gamma), ptr<float>(rstd), M, C,
                     accumulate_dx, accumulate, norm_ws_.data, norm_ws_.bytes(), s);
}

const bf16* Transformer::branch_grad(ParamId bias, const std::vector<RngArgs>& rng, int mb,
                                     int layer, cudaStream_t s) const {
  if (branch_grad_is_residual()) return ptr<bf16>(grad_);
  dropout_residual_backward(ptr<bf16>(d_branch_), bias >= 0 ? params_.grad(bias) : nullptr,
                            ptr<bf16>(grad_), shape_.seq_tokens(), static_cast<int>(shape_.hidden),
                            shape_.dropout, rng_of(rng, mb, layer), mb > 0, dropout_ws_.data,
                            dropout_ws_.bytes(), s, shape_.seq_first_token());
  return ptr<bf16>(d_branch_);
}

// Rotates the q and k heads of a fused QKV buffer (or of its gradient) in place: they are the first
// Hq + Hkv heads of each token's row of width qkv_width(); the v heads pass untouched.
void Transformer::rope_apply(void* qkv, bool backward, cudaStream_t s) const {
  RopeLayout layout;
  layout.batch = shape_.micro_batch;
  layout.seq = shape_.seq;
  layout.heads = static_cast<int>(shape_.heads_shard() + shape_.kv_heads_shard());
  layout.head_dim = static_cast<int>(shape_.head_dim);
  layout.rope_dim = layout.head_dim;
  layout.token_stride = shape_.qkv_width();
  const auto* table = static_cast<const float2*>(rope_table_.data);
  const int positions = static_cast<int>(shape_.seq);
  auto* x = static_cast<bf16*>(qkv);
  if (backward)
    rope_backward(x, x, table, positions, nullptr, layout, s);
  else
    rope_forward(x, x, table, positions, nullptr, layout, s);
}

// ---- Forward ----------------------------------------------------------------------------------

bf16* Transformer::seq_slice(const TensorView& v) const {
  return ptr<bf16>(v) + shape_.seq_first_token() * shape_.hidden;
}

void Transformer::sp_gather(const TensorView& v, cudaStream_t s) const {
  if (!sp()) return;
  tp_->all_gather(seq_slice(v), v.data, static_cast<size_t>(shape_.seq_tokens() * shape_.hidden),
                  ncclBfloat16, s);
}

const bf16* Transformer::sp_gather_to(const bf16* src, const TensorView& all,
                                      cudaStream_t s) const {
  if (!sp()) return src;
  tp_->all_gather(src, all.data, static_cast<size_t>(shape_.seq_tokens() * shape_.hidden),
                  ncclBfloat16, s);
  return ptr<bf16>(all);
}

const bf16* Transformer::tp_reduce(const TensorView& v, cudaStream_t s) const {
  if (tp_ == nullptr) return ptr<bf16>(v);
  if (sp()) {
    tp_->reduce_scatter(v.data, seq_slice(v),
                        static_cast<size_t>(shape_.seq_tokens() * shape_.hidden), ncclBfloat16,
                        ncclSum, s);
    return seq_slice(v);
  }
  tp_->all_reduce(v.data, v.data, static_cast<size_t>(shape_.tokens() * shape_.hidden),
                  ncclBfloat16, ncclSum, s);
  return ptr<bf16>(v);
}

void Transformer::sp_reduce_grads(std::initializer_list<ParamId> ids, cudaStream_t s) const {
  if (!sp()) return;
  std::vector<std::pair<void*, size_t>> grads;
  for (const ParamId id : ids)
    if (id >= 0) grads.emplace_back(params_.grad(id), static_cast<size_t>(params_.numel(id)));
  tp_->all_reduce_group(grads, ncclFloat32, ncclSum, s);
}

void Transformer::embedding_forward(int mb, cudaStream_t s) const {
  // Vocab-parallel: ids outside this rank's rows give zero; the position table is added by rank 0
  // only, so the sum over the group adds it once.
  const bool positions = wpe_ >= 0 && shape_.tp_rank == 0;
  // With SP every token's partial sums go to the scratch, and this rank keeps its slice's sums.
  const TensorView& partial = sp() ? fwd_tmp_ : x_[0];
  replay::embedding_forward(ptr<bf16>(partial), tokens(mb), weight(wte_),
                            positions ? weight(wpe_) : nullptr,
                            EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden,
                                           shape_.vocab_start(), shape_.vocab_shard()},
                            s);
  if (sp())
    tp_->reduce_scatter(partial.data, x_[0].data,
                        static_cast<size_t>(shape_.seq_tokens() * shape_.hidden), ncclBfloat16,
                        ncclSum, s);
  else
    tp_reduce(x_[0], s);
}

void Transformer::layer_forward(int mb, int layer, cudaStream_t s) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  const LayerActs& a = acts_[static_cast<size_t>(layer)];
  const bf16* x = ptr<bf16>(x_[static_cast<size_t>(layer)]);
  bf16* out = ptr<bf16>(x_[static_cast<size_t>(layer) + 1]);
  const int64_t M = shape_.tokens(), Ms = shape_.seq_tokens(), first = shape_.seq_first_token();
  const int C = static_cast<int>(shape_.hidden);
  const float drop = shape_.dropout;
  auto bias = [this](ParamId id) { return id >= 0 ? weight(id) : nullptr; };

  norm_forward(seq_slice(a.h1), a.ln1_mean, a.ln1_rstd, x, p.ln1_gamma, p.ln1_beta, s);
  sp_gather(a.h1, s);
  GemmArgs qkv;
  qkv.a = a.h1.data, qkv.b = weight(p.qkv_weight), qkv.d = a.qkv.data, qkv.bias = bias(p.qkv_bias);
  gemm(qkv_.forward, qkv, s);
  if (rope()) rope_apply(a.qkv.data, false, s);
  const AttentionDesc& ad = attention_->desc();
  const AttentionIO io{a.qkv.data, offset(a.qkv, ad.k_offset()), offset(a.qkv, ad.v_offset()),
                       a.attn_o.data, ptr<float>(a.attn_stats)};
  attention_->forward(ctx_, s, io, rng_of(rng_attention_, mb, layer), attention_ws_.data,
                      attention_ws_.bytes());
  GemmArgs proj;
  proj.a = a.attn_o.data, proj.b = weight(p.proj_weight), proj.d = fwd_tmp_.data;
  gemm(proj_.forward, proj, s);
  const bf16* attn_sum = tp_reduce(fwd_tmp_, s);  // row-parallel: every rank's partial products
  dropout_residual_forward(ptr<bf16>(a.x_mid), attn_sum, bias(p.proj_bias), x, Ms, C, drop,
                           rng_of(rng_attn_dropout_, mb, layer), s, first);
  norm_forward(seq_slice(a.h2), a.ln2_mean, a.ln2_rstd, ptr<bf16>(a.x_mid), p.ln2_gamma, p.ln2_beta,
               s);
  sp_gather(a.h2, s);
  GemmArgs fc1;
  fc1.a = a.h2.data, fc1.b = weight(p.fc1_weight), fc1.bias = bias(p.fc1_bias);
  if (swiglu()) {
    fc1.d = a.fc1_aux.data;  // [M, 2F]: gate, then up
    gemm(fc1_.forward, fc1, s);
    swiglu_forward(ptr<bf16>(a.fc1_out), ptr<bf16>(a.fc1_aux), M,
                   static_cast<int>(shape_.ffn_shard()), s);
  } else {
    fc1.d = a.fc1_out.data, fc1.aux = a.fc1_aux.data;
    gemm(fc1_.forward, fc1, s);
  }
  GemmArgs fc2;
  fc2.a = a.fc1_out.data, fc2.b = weight(p.fc2_weight), fc2.d = fwd_tmp_.data;
  gemm(fc2_.forward, fc2, s);
  const bf16* mlp_sum = tp_reduce(fwd_tmp_, s);
  dropout_residual_forward(out, mlp_sum, bias(p.fc2_bias), ptr<bf16>(a.x_mid), Ms, C, drop,
                           rng_of(rng_mlp_dropout_, mb, layer), s, first);
}

// ---- Head: final norm, LM head, cross-entropy, and their backward -----------------------------

// The final norm, the logits and the mean cross-entropy over micro-batch `mb` into *loss: the
// training head's forward and the whole of the evaluation's.
void Transformer::head_forward(int mb, float* loss, cudaStream_t s) const {
  const CrossEntropyShape ce{shape_.tokens(), shape_.vocab_shard(), shape_.vocab_start()};
  norm_forward(seq_slice(hf_), lnf_mean_, lnf_rstd_, ptr<bf16>(x_.back()), lnf_gamma_, lnf_beta_,
               s);
  sp_gather(hf_, s);
  GemmArgs fwd;
  fwd.a = hf_.data, fwd.b = head_weight(), fwd.d = logits_.data;
  gemm(lm_head_.forward, fwd, s);
  if (tp_ == nullptr) {  // this shard's vocabulary is the whole vocabulary
    cross_entropy_forward(ptr<float>(ce_stats_), ptr<float>(row_loss_), loss, ptr<int32_t>(count_),
                          ptr<bf16>(logits_), targets(mb), ce, s);
    return;
  }
  // Vocab-parallel: every rank's row statistics (max, sum of exponentials, target logit), combined
  // in rank order into the whole vocabulary's, then the loss (the same on every rank).
  cross_entropy_stats(ptr<float>(ce_stats_), ptr<bf16>(logits_), targets(mb), ce, s);
  const auto floats = static_cast<size_t>(cross_entropy_stats_floats(shape_.tokens()));
  tp_->all_gather(ce_stats_.data, ce_gathered_.data, floats, ncclFloat32, s);
  cross_entropy_combine_stats(ptr<float>(ce_stats_), ptr<float>(ce_gathered_), shape_.tp,
                              shape_.tokens(), s);
  cross_entropy_loss(ptr<float>(row_loss_), loss, ptr<int32_t>(count_), ptr<float>(ce_stats_),
                     targets(mb), shape_.tokens(), s);
}

void Transformer::head(int mb, cudaStream_t s) const {
  const CrossEntropyShape ce{shape_.tokens(), shape_.vocab_shard(), shape_.vocab_start()};
  bf16* logits = ptr<bf16>(logits_);
  head_forward(mb, loss_of(mb), s);
  cross_entropy_backward(logits, logits, ptr<float>(ce_stats_), targets(mb), ptr<int32_t>(count_),
                         ptr<float>(dloss_), ce, s);  // dlogits in place
  GemmArgs dgrad;
  dgrad.a = logits, dgrad.b = head_weight(), dgrad.d = d_hf_.data;
  gemm(lm_head_.dgrad, dgrad, s);
  const bf16* d_hf = tp_reduce(d_hf_, s);  // the vocab-parallel head's partial input gradients
  if (!shape_.tied_embedding) {            // the untied head's weight gradient: dW (+)= dlogits^T h
    GemmArgs wgrad;
    wgrad.a = logits, wgrad.b = hf_.data, wgrad.d = params_.grad(lm_head_w_);
    gemm(lm_head_.wgrad[mb > 0 ? 1 : 0], wgrad, s);
  }
  norm_backward(ptr<bf16>(grad_), lnf_gamma_, lnf_beta_, d_hf, ptr<bf16>(x_.back()), lnf_mean_,
                lnf_rstd_, false, mb > 0, s);
  if (mb == microbatches_ - 1) sp_reduce_grads({lnf_gamma_, lnf_beta_}, s);
  if (microbatches_ > 1 && mb == microbatches_ - 1) {
    mean_of(step_loss_, ptr<float>(mb_loss_), microbatches_, s);
  }
}

void Transformer::eval_head(float* batch_loss, float* loss_sum, cudaStream_t s) const {
  REPLAY_REQUIRE(shape_.dropout == 0.0f, "evaluation runs the forward without dropout");
  head_forward(0, batch_loss, s);
  accumulate(loss_sum, batch_loss, 1, s);
}

// ---- Backward ---------------------------------------------------------------------------------

// A linear layer's weight gradient (added to on later micro-batches) and, with a bias (bias >= 0),
// its bias gradient from the same GEMM's BGRADA epilogue. cuBLASLt writes that one rather than
// adding to it, so on later micro-batches it goes to scratch and is added in a second step.
void Transformer::wgrad(const Linear& linear, GemmArgs args, ParamId bias, int64_t width, int mb,
                        cudaStream_t s) const {
  const int acc = mb > 0 ? 1 : 0;
  float* scratch = ptr<float>(bias_scratch_);
  if (bias >= 0) args.bias_grad = acc ? scratch : params_.grad(bias);
  gemm(linear.wgrad[acc], args, s);
  if (bias >= 0 && acc) {
    accumulate(params_.grad(bias), scratch, width, s);
  }
}

void Transformer::layer_backward(int mb, int layer, cudaStream_t s) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  const LayerActs& a = acts_[static_cast<size_t>(layer)];
  const bf16* x = ptr<bf16>(x_[static_cast<size_t>(layer)]);
  const int64_t M = shape_.tokens();
  const int acc = mb > 0 ? 1 : 0;  // later micro-batches add to the first's gradients
  const bool bias = shape_.bias;
  const ParamStore& w = params_;
  bf16* G = ptr<bf16>(grad_);

  // MLP: G is dL/d(layer output) (this rank's rows with SP; gathered for the GEMMs).
  const bf16* d_mlp =
      sp_gather_to(branch_grad(p.fc2_bias, rng_mlp_dropout_, mb, layer, s), d_all_, s);
  GemmArgs fc2_d;
  fc2_d.a = d_mlp, fc2_d.b = weight(p.fc2_weight);
  if (swiglu()) {
    fc2_d.d = d_act_.data;
    gemm(fc2_.dgrad, fc2_d, s);  // dL/d(silu(gate) * up)
    swiglu_backward(ptr<bf16>(d_fc1_), ptr<bf16>(d_act_), ptr<bf16>(a.fc1_aux), M,
                    static_cast<int>(shape_.ffn_shard()), s);
  } else {
    fc2_d.d = d_fc1_.data, fc2_d.aux = a.fc1_aux.data;
    gemm(fc2_.dgrad, fc2_d, s);  // dL/d(fc1 pre-activation) = (dY W2) * gelu'(aux)
  }
  GemmArgs fc2_w;
  fc2_w.a = d_mlp, fc2_w.b = a.fc1_out.data, fc2_w.d = w.grad(p.fc2_weight);
  wgrad(fc2_, fc2_w, -1, 0, mb, s);  // a bias gradient comes from the dropout backward
  GemmArgs fc1_d;
  fc1_d.a = d_fc1_.data, fc1_d.b = weight(p.fc1_weight), fc1_d.d = d_h_.data;
  gemm(fc1_.dgrad, fc1_d, s);
  // Column-parallel: the partial input gradients of every rank.
  const bf16* d_h2 = tp_reduce(d_h_, s);
  GemmArgs fc1_w;
  fc1_w.a = d_fc1_.data, fc1_w.b = a.h2.data, fc1_w.d = w.grad(p.fc1_weight);
  wgrad(fc1_, fc1_w, bias ? p.fc1_bias : -1, shape_.fc1_width(), mb, s);
  norm_backward(G, p.ln2_gamma, p.ln2_beta, d_h2, ptr<bf16>(a.x_mid), a.ln2_mean, a.ln2_rstd, true,
                acc, s);  // G is now dL/dx_mid

  // Attention.
  const bf16* d_attn_branch =
      sp_gather_to(branch_grad(p.proj_bias, rng_attn_dropout_, mb, layer, s), d_all_, s);
  GemmArgs proj_d;
  proj_d.a = d_attn_branch, proj_d.b = weight(p.proj_weight), proj_d.d = d_attn_.data;
  gemm(proj_.dgrad, proj_d, s);
  GemmArgs proj_w;
  proj_w.a = d_attn_branch, proj_w.b = a.attn_o.data, proj_w.d = w.grad(p.proj_weight);
  wgrad(proj_, proj_w, -1, 0, mb, s);  // a bias gradient comes from the dropout backward
  const AttentionDesc& ad = attention_->desc();
  const AttentionIO io{a.qkv.data, offset(a.qkv, ad.k_offset()), offset(a.qkv, ad.v_offset()),
                       a.attn_o.data, ptr<float>(a.attn_stats)};
  const AttentionGrads dio{d_attn_.data, d_qkv_.data, offset(d_qkv_, ad.k_offset()),
                           offset(d_qkv_, ad.v_offset())};
  attention_->backward(ctx_, s, io, dio, rng_of(rng_attention_, mb, layer), attention_ws_.data,
                       attention_ws_.bytes());
  if (rope()) rope_apply(d_qkv_.data, true, s);  // gradients of the q and k before the rotation
  GemmArgs qkv_d;
  qkv_d.a = d_qkv_.data, qkv_d.b = weight(p.qkv_weight), qkv_d.d = d_h_.data;
  gemm(qkv_.dgrad, qkv_d, s);
  const bf16* d_h1 = tp_reduce(d_h_, s);
  GemmArgs qkv_w;
  qkv_w.a = d_qkv_.data, qkv_w.b = a.h1.data, qkv_w.d = w.grad(p.qkv_weight);
  wgrad(qkv_, qkv_w, bias ? p.qkv_bias : -1, shape_.qkv_width(), mb, s);
  norm_backward(G, p.ln1_gamma, p.ln1_beta, d_h1, x, a.ln1_mean, a.ln1_rstd, true, acc,
                s);             // G is now dL/dx (the layer's input)
  if (mb == microbatches_ - 1)  // SP: the slices' partial gradients of the replicated parameters
    sp_reduce_grads({p.ln1_gamma, p.ln1_beta, p.ln2_gamma, p.ln2_beta, p.proj_bias, p.fc2_bias}, s);
}

void Transformer::embedding_backward(int mb, cudaStream_t s) const {
  const ParamStore& w = params_;
  // Every token's gradient: the lookup is vocab-parallel over all of them.
  const bf16* d_x0 = sp_gather_to(ptr<bf16>(grad_), d_all_, s);
  replay::embedding_backward(w.grad(wte_), wpe_ >= 0 ? w.grad(wpe_) : nullptr, d_x0, tokens(mb),
                             EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden,
                                            shape_.vocab_start(), shape_.vocab_shard()},
                             mb > 0, embedding_ws_.data, embedding_ws_.bytes(), s);
  if (!shape_.tied_embedding) return;
  // The tied LM head's weight gradient, added to the token rows just written: dW += dlogits^T h.
  GemmArgs wgrad;
  wgrad.a = logits_.data, wgrad.b = hf_.data, wgrad.d = w.grad(wte_);
  gemm(lm_head_.wgrad[0], wgrad, s);
}

// ---- Region arguments -------------------------------------------------------------------------

graphs::RegionArgs Transformer::embedding_forward_args(int mb) const {
  const int64_t M = shape_.tokens();
  graphs::RegionArgs args;
  args.read("tokens", TensorView(tokens(mb), DType::kINT32, {M}))
      .read("embedding", params_.weight_range(wte_, embedding_last()))
      .write("x0", x_[0]);
  if (sp()) args.write("scratch", fwd_tmp_);  // every token's partial sums
  return args;
}

// What a layer's forward saves for its backward: written by the one, read by the other.
void Transformer::saved_activations(graphs::RegionArgs& args, const LayerActs& a,
                                    graphs::Access access) const {
  if (layernorm()) args.add("ln1.mean", a.ln1_mean, access);
  args.add("ln1.rstd", a.ln1_rstd, access)
      .add("ln1.out", a.h1, access)
      .add("qkv", a.qkv, access)
      .add("attn.out", a.attn_o, access)
      .add("attn.lse", a.attn_stats, access)
      .add("x_mid", a.x_mid, access);
  if (layernorm()) args.add("ln2.mean", a.ln2_mean, access);
  args.add("ln2.rstd", a.ln2_rstd, access)
      .add("ln2.out", a.h2, access)
      .add("fc1.out", a.fc1_out, access)
      .add("fc1.preact", a.fc1_aux, access);
}

graphs::RegionArgs Transformer::layer_args(int layer, graphs::Access activations) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  graphs::RegionArgs args;
  args.read("x", x_[static_cast<size_t>(layer)])
      .read("params", params_.weight_range(p.first(), p.last()));
  if (rope()) args.read("rope.table", rope_table_);
  saved_activations(args, acts_.at(static_cast<size_t>(layer)), activations);
  return args;
}

graphs::RegionArgs Transformer::layer_forward_args(int /*mb*/, int layer) const {
  graphs::RegionArgs args = layer_args(layer, graphs::Access::kWrite);
  args.write("scratch", fwd_tmp_).write("out", x_[static_cast<size_t>(layer) + 1]);
  return args;
}

// What head_forward reads and writes.
graphs::RegionArgs Transformer::head_forward_args(int mb) const {
  const int64_t M = shape_.tokens();
  graphs::RegionArgs args;
  args.read("x", x_.back()).read("final_norm", params_.weight_range(lnf_gamma_, final_norm_last()));
  if (shape_.tied_embedding)
    args.read("embedding.token", params_.weight_range(wte_, wte_));
  else
    args.read("lm_head", params_.weight_range(lm_head_w_, lm_head_w_));
  args.read("targets", TensorView(targets(mb), DType::kINT32, {M})).write("norm.out", hf_);
  if (layernorm()) args.write("norm.mean", lnf_mean_);
  return args.write("norm.rstd", lnf_rstd_)
      .write("logits", logits_)
      .write("ce.stats", ce_stats_)
      .write("ce.row_loss", row_loss_)
      .write("ce.count", count_);
}

graphs::RegionArgs Transformer::head_args(int mb) const {
  graphs::RegionArgs args = head_forward_args(mb);
  args.read("dloss", dloss_)
      .write("norm.dout", d_hf_)
      .write("residual_grad", grad_)
      .write("loss", TensorView(loss_of(mb), DType::kFP32, {1}));
  if (mb == 0)
    args.write("final_norm.grad", params_.grad_range(lnf_gamma_, final_norm_last()));
  else
    args.read_write("final_norm.grad", params_.grad_range(lnf_gamma_, final_norm_last()));
  if (!shape_.tied_embedding) {
    if (mb == 0)
      args.write("lm_head.grad", params_.grad_range(lm_head_w_, lm_head_w_));
    else
      args.read_write("lm_head.grad", params_.grad_range(lm_head_w_, lm_head_w_));
  }
  if (microbatches_ > 1 && mb == microbatches_ - 1)
    args.write("step_loss", TensorView(step_loss_, DType::kFP32, {1}));
  return args;
}

graphs::RegionArgs Transformer::eval_head_args(float* batch_loss, float* loss_sum) const {
  return head_forward_args(0)
      .write("eval.batch_loss", TensorView(batch_loss, DType::kFP32, {1}))
      .read_write("eval.loss_sum", TensorView(loss_sum, DType::kFP32, {1}));
}

graphs::RegionArgs Transformer::layer_backward_args(int mb, int layer) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  graphs::RegionArgs args = layer_args(layer, graphs::Access::kRead);
  args.read_write("residual_grad", grad_);
  if (!branch_grad_is_residual()) args.write("branch_grad", d_branch_);
  args.write("norm_out_grad", d_h_).write("fc1_grad", d_fc1_);
  if (swiglu()) args.write("swiglu_out_grad", d_act_);
  args.write("attn_out_grad", d_attn_).write("qkv_grad", d_qkv_);
  if (sp()) args.write("gathered_grad", d_all_);
  if (mb == 0) {
    args.write("grads", params_.grad_range(p.first(), p.last()));
  } else {
    args.read_write("grads", params_.grad_range(p.first(), p.last()));
    if (shape_.bias) args.write("bias_scratch", bias_scratch_);
  }
  return args;
}

graphs::RegionArgs Transformer::embedding_backward_args(int mb) const {
  const int64_t M = shape_.tokens();
  graphs::RegionArgs args;
  args.read("tokens", TensorView(tokens(mb), DType::kINT32, {M})).read("residual_grad", grad_);
  if (sp()) args.write("gathered_grad", d_all_);
  if (shape_.tied_embedding) args.read("dlogits", logits_).read("norm.out", hf_);
  if (mb == 0)
    args.write("embedding.grad", params_.grad_range(wte_, embedding_last()));
  else
    args.read_write("embedding.grad", params_.grad_range(wte_, embedding_last()));
  return args;
}

}  // namespace replay::transformer
