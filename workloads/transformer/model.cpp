// model.cpp: the GPT-3 style shard: parameters, plans, buffers, forward and backward.
#include "workloads/transformer/model.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/kernels/cross_entropy.h"
#include "common/kernels/dropout.h"
#include "common/kernels/embedding.h"
#include "common/kernels/init.h"
#include "common/kernels/norms.h"
#include "workloads/transformer/accumulate.h"

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
                         GemmCache& gemms, AttentionCache& attention, const bench::HostDelay* delay)
    : ctx_(ctx), shape_(shape), microbatches_(microbatches), delay_(delay) {
  shape_.validate();
  REPLAY_REQUIRE(microbatches >= 1, "at least one micro-batch per step");
  const int64_t C = shape_.hidden, A = shape_.attn_width(), F = shape_.ffn_shard(),
                V = shape_.vocab_shard();
  const int64_t M = shape_.tokens(), L = shape_.layers;

  // Parameters: GPT-2/Megatron initialization, N(0, 0.02) with the residual-branch output layers
  // scaled by 1/sqrt(2L); biases and LayerNorm shifts zero, LayerNorm scales one. Weight decay on
  // matrices and embeddings only.
  const float out_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto add_param = [&](std::string name, std::vector<int64_t> dims, ParamInit init, float stddev,
                       bool decay) {
    return params_.add(ParamSpec{std::move(name), std::move(dims), init, stddev, decay});
  };
  wte_ = add_param("embedding.token", {V, C}, ParamInit::kNormal, 0.02f, true);
  wpe_ = add_param("embedding.position", {shape_.seq, C}, ParamInit::kNormal, 0.02f, true);
  for (int64_t l = 0; l < L; ++l) {
    const std::string n = "layer" + std::to_string(l) + ".";
    LayerParams p{};
    p.ln1_gamma = add_param(n + "ln1.weight", {C}, ParamInit::kOnes, 0, false);
    p.ln1_beta = add_param(n + "ln1.bias", {C}, ParamInit::kZeros, 0, false);
    p.qkv_weight = add_param(n + "attn.qkv.weight", {3 * A, C}, ParamInit::kNormal, 0.02f, true);
    p.qkv_bias = add_param(n + "attn.qkv.bias", {3 * A}, ParamInit::kZeros, 0, false);
    p.proj_weight = add_param(n + "attn.proj.weight", {C, A}, ParamInit::kNormal, out_std, true);
    p.proj_bias = add_param(n + "attn.proj.bias", {C}, ParamInit::kZeros, 0, false);
    p.ln2_gamma = add_param(n + "ln2.weight", {C}, ParamInit::kOnes, 0, false);
    p.ln2_beta = add_param(n + "ln2.bias", {C}, ParamInit::kZeros, 0, false);
    p.fc1_weight = add_param(n + "mlp.fc1.weight", {F, C}, ParamInit::kNormal, 0.02f, true);
    p.fc1_bias = add_param(n + "mlp.fc1.bias", {F}, ParamInit::kZeros, 0, false);
    p.fc2_weight = add_param(n + "mlp.fc2.weight", {C, F}, ParamInit::kNormal, out_std, true);
    p.fc2_bias = add_param(n + "mlp.fc2.bias", {C}, ParamInit::kZeros, 0, false);
    layers_.push_back(p);
  }
  lnf_gamma_ = add_param("final_norm.weight", {C}, ParamInit::kOnes, 0, false);
  lnf_beta_ = add_param("final_norm.bias", {C}, ParamInit::kZeros, 0, false);

  // GEMM plans (gemm.h's linear layer): the QKV and fc1 bias gradients from their wgrad (BGRADA,
  // fp32); fc1's forward keeps the GeLU pre-activation, fc2's dgrad applies its derivative.
  qkv_ = make_linear(gemms, linear_gemms(M, C, 3 * A, true, false));
  proj_ = make_linear(gemms, linear_gemms(M, A, C, false, false));
  LinearGemms fc1 = linear_gemms(M, C, F, true, false);
  fc1.forward.epilogue = Epilogue::kBiasGeluAux;
  fc1_ = make_linear(gemms, fc1);
  LinearGemms fc2 = linear_gemms(M, F, C, false, false);
  fc2.dgrad.epilogue = Epilogue::kDGelu;
  fc2_ = make_linear(gemms, fc2);
  // The tied LM head: logits = h W_emb^T; its wgrad always adds to the embedding backward's rows.
  const LinearGemms head = linear_gemms(M, C, V, false, true);
  lm_head_.forward = &gemms.get(head.forward);
  lm_head_.dgrad = &gemms.get(head.dgrad);
  lm_head_.wgrad[0] = lm_head_.wgrad[1] = &gemms.get(head.wgrad);

  AttentionDesc att;
  att.batch = shape_.micro_batch;
  att.heads_q = att.heads_kv = shape_.heads_shard();
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
  norm_ws_bytes_ = layernorm_backward_workspace_bytes(M, static_cast<int>(C));
  dropout_ws_bytes_ = dropout_residual_backward_workspace_bytes(M, static_cast<int>(C));
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
  const int64_t C = shape_.hidden, A = shape_.attn_width(), F = shape_.ffn_shard(),
                V = shape_.vocab_shard();
  const int64_t M = shape_.tokens(), n = microbatches_;
  const int L = num_layers();
  const Lifetime forever{};
  const Lifetime head{phase_head(), phase_head()};
  const Lifetime head_to_end{phase_head(), phase_embedding_backward()};
  const Lifetime backward{phase_layer_backward(L - 1), phase_layer_backward(0)};
  const DType kBF = DType::kBF16, kF32 = DType::kFP32, kI32 = DType::kINT32, kU8 = DType::kUINT8;

  params_.plan(plan, {phase_optimizer(), phase_optimizer()});
  add(plan, tokens_, "input.tokens", kI32, n * M, "inputs", forever);
  add(plan, targets_, "input.targets", kI32, n * M, "inputs", forever);
  add(plan, dloss_, "loss.dloss", kF32, 1, "inputs", forever);
  add(plan, mb_loss_, "loss.micro_batches", kF32, n, "inputs", forever);

  add(plan, x_[0], "x0", kBF, M * C, "activations",
      {phase_embedding_forward(), phase_layer_backward(0)});
  for (int l = 0; l < L; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    const Lifetime life{phase_layer_forward(l), phase_layer_backward(l)};
    LayerActs& a = acts_[static_cast<size_t>(l)];
    add(plan, a.ln1_mean, p + "ln1.mean", kF32, M, "activations", life);
    add(plan, a.ln1_rstd, p + "ln1.rstd", kF32, M, "activations", life);
    add(plan, a.h1, p + "ln1.out", kBF, M * C, "activations", life);
    add(plan, a.qkv, p + "attn.qkv", kBF, M * 3 * A, "activations", life);
    add(plan, a.attn_o, p + "attn.out", kBF, M * A, "activations", life);
    add(plan, a.attn_stats, p + "attn.lse", kF32, M * shape_.heads_shard(), "activations", life);
    add(plan, a.x_mid, p + "x_mid", kBF, M * C, "activations", life);
    add(plan, a.ln2_mean, p + "ln2.mean", kF32, M, "activations", life);
    add(plan, a.ln2_rstd, p + "ln2.rstd", kF32, M, "activations", life);
    add(plan, a.h2, p + "ln2.out", kBF, M * C, "activations", life);
    add(plan, a.fc1_out, p + "mlp.fc1.out", kBF, M * F, "activations", life);
    add(plan, a.fc1_aux, p + "mlp.fc1.preact", kBF, M * F, "activations", life);
    const int end = l + 1 < L ? phase_layer_backward(l + 1) : phase_head();
    add(plan, x_[static_cast<size_t>(l) + 1], "x" + std::to_string(l + 1), kBF, M * C,
        "activations", {phase_layer_forward(l), end});
  }
  add(plan, fwd_tmp_, "forward.scratch", kBF, M * C, "activations",
      {phase_layer_forward(0), phase_layer_forward(L - 1)});

  add(plan, hf_, "head.norm.out", kBF, M * C, "activations", head_to_end);
  add(plan, logits_, "head.logits", kBF, M * V, "activations", head_to_end);
  add(plan, lnf_mean_, "head.norm.mean", kF32, M, "activations", head);
  add(plan, lnf_rstd_, "head.norm.rstd", kF32, M, "activations", head);
  add(plan, ce_stats_, "head.ce.stats", kF32, cross_entropy_stats_floats(M), "activations", head);
  add(plan, row_loss_, "head.ce.row_loss", kF32, M, "activations", head);
  add(plan, count_, "head.ce.count", kI32, 1, "activations", head);
  add(plan, d_hf_, "head.norm.dout", kBF, M * C, "activations", head);

  add(plan, grad_, "backward.residual_grad", kBF, M * C, "activations", head_to_end);
  add(plan, d_branch_, "backward.branch_grad", kBF, M * C, "activations", backward);
  add(plan, d_h_, "backward.norm_out_grad", kBF, M * C, "activations", backward);
  add(plan, d_fc1_, "backward.fc1_grad", kBF, M * F, "activations", backward);
  add(plan, d_attn_, "backward.attn_out_grad", kBF, M * A, "activations", backward);
  add(plan, d_qkv_, "backward.qkv_grad", kBF, M * 3 * A, "activations", backward);
  if (n > 1)
    add(plan, bias_scratch_, "backward.bias_grad", kF32, std::max(F, 3 * A), "activations",
        backward);

  add(plan, gemm_ws_, "gemm.workspace", kU8, static_cast<int64_t>(gemm_ws_bytes_), "workspace",
      {phase_embedding_forward(), phase_embedding_backward()});
  add(plan, attention_ws_, "attention.workspace", kU8, static_cast<int64_t>(attention_ws_bytes_),
      "workspace", {phase_layer_forward(0), phase_layer_backward(0)});
  add(plan, norm_ws_, "layernorm.workspace", kU8, static_cast<int64_t>(norm_ws_bytes_), "workspace",
      {phase_head(), phase_layer_backward(0)});
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

void Transformer::initialize(uint64_t seed, cudaStream_t stream) {
  params_.initialize(seed, stream);
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
  REPLAY_REQUIRE(step_loss_ != nullptr, "Transformer: set_loss_output before running a step");
  return microbatches_ == 1 ? step_loss_ : ptr<float>(mb_loss_) + mb;
}

int32_t* Transformer::tokens(int mb) const {
  return ptr<int32_t>(tokens_) + mb * shape_.tokens();
}
int32_t* Transformer::targets(int mb) const {
  return ptr<int32_t>(targets_) + mb * shape_.tokens();
}

void Transformer::gemm(GemmPlan* plan, GemmArgs args, cudaStream_t stream) const {
  hook();
  args.workspace = gemm_ws_.data;
  args.workspace_bytes = gemm_ws_.bytes();
  plan->run(stream, args);
}

// ---- Forward ----------------------------------------------------------------------------------

void Transformer::embedding_forward(int mb, cudaStream_t s) const {
  hook();
  replay::embedding_forward(ptr<bf16>(x_[0]), tokens(mb), params_.weight(wte_),
                            params_.weight(wpe_),
                            EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden,
                                           shape_.vocab_start(), shape_.vocab_shard()},
                            s);
}

void Transformer::layer_forward(int mb, int layer, cudaStream_t s) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  const LayerActs& a = acts_[static_cast<size_t>(layer)];
  const bf16* x = ptr<bf16>(x_[static_cast<size_t>(layer)]);
  bf16* out = ptr<bf16>(x_[static_cast<size_t>(layer) + 1]);
  const int64_t M = shape_.tokens();
  const int C = static_cast<int>(shape_.hidden);
  const float eps = shape_.norm_eps, drop = shape_.dropout;
  const ParamStore& w = params_;

  hook();
  layernorm_forward(ptr<bf16>(a.h1), ptr<float>(a.ln1_mean), ptr<float>(a.ln1_rstd), x,
                    w.weight(p.ln1_gamma), w.weight(p.ln1_beta), M, C, eps, s);
  GemmArgs qkv;
  qkv.a = a.h1.data, qkv.b = w.weight(p.qkv_weight), qkv.d = a.qkv.data,
  qkv.bias = w.weight(p.qkv_bias);
  gemm(qkv_.forward, qkv, s);
  const AttentionDesc& ad = attention_->desc();
  const AttentionIO io{a.qkv.data, offset(a.qkv, ad.k_offset()), offset(a.qkv, ad.v_offset()),
                       a.attn_o.data, ptr<float>(a.attn_stats)};
  hook();
  attention_->forward(ctx_, s, io, rng_of(rng_attention_, mb, layer), attention_ws_.data,
                      attention_ws_.bytes());
  GemmArgs proj;
  proj.a = a.attn_o.data, proj.b = w.weight(p.proj_weight), proj.d = fwd_tmp_.data;
  gemm(proj_.forward, proj, s);
  hook();
  dropout_residual_forward(ptr<bf16>(a.x_mid), ptr<bf16>(fwd_tmp_), w.weight(p.proj_bias), x, M, C,
                           drop, rng_of(rng_attn_dropout_, mb, layer), s);
  hook();
  layernorm_forward(ptr<bf16>(a.h2), ptr<float>(a.ln2_mean), ptr<float>(a.ln2_rstd),
                    ptr<bf16>(a.x_mid), w.weight(p.ln2_gamma), w.weight(p.ln2_beta), M, C, eps, s);
  GemmArgs fc1;
  fc1.a = a.h2.data, fc1.b = w.weight(p.fc1_weight), fc1.d = a.fc1_out.data,
  fc1.bias = w.weight(p.fc1_bias);
  fc1.aux = a.fc1_aux.data;
  gemm(fc1_.forward, fc1, s);
  GemmArgs fc2;
  fc2.a = a.fc1_out.data, fc2.b = w.weight(p.fc2_weight), fc2.d = fwd_tmp_.data;
  gemm(fc2_.forward, fc2, s);
  hook();
  dropout_residual_forward(out, ptr<bf16>(fwd_tmp_), w.weight(p.fc2_bias), ptr<bf16>(a.x_mid), M, C,
                           drop, rng_of(rng_mlp_dropout_, mb, layer), s);
}

// ---- Head: final norm, tied LM head, cross-entropy, and their backward ------------------------

void Transformer::head(int mb, cudaStream_t s) const {
  const int64_t M = shape_.tokens();
  const int C = static_cast<int>(shape_.hidden);
  const CrossEntropyShape ce{M, shape_.vocab_shard(), shape_.vocab_start()};
  const ParamStore& w = params_;
  bf16* logits = ptr<bf16>(logits_);

  hook();
  layernorm_forward(ptr<bf16>(hf_), ptr<float>(lnf_mean_), ptr<float>(lnf_rstd_),
                    ptr<bf16>(x_.back()), w.weight(lnf_gamma_), w.weight(lnf_beta_), M, C,
                    shape_.norm_eps, s);
  GemmArgs fwd;
  fwd.a = hf_.data, fwd.b = w.weight(wte_), fwd.d = logits;
  gemm(lm_head_.forward, fwd, s);
  // Vocab-parallel cross-entropy; under tensor parallelism the statistics would be all-gathered and
  // combined here (cross_entropy_combine_stats) before the loss.
  hook();
  cross_entropy_stats(ptr<float>(ce_stats_), logits, targets(mb), ce, s);
  hook();
  cross_entropy_loss(ptr<float>(row_loss_), loss_of(mb), ptr<int32_t>(count_),
                     ptr<float>(ce_stats_), targets(mb), M, s);
  hook();
  cross_entropy_backward(logits, logits, ptr<float>(ce_stats_), targets(mb), ptr<int32_t>(count_),
                         ptr<float>(dloss_), ce, s);  // dlogits in place
  GemmArgs dgrad;
  dgrad.a = logits, dgrad.b = w.weight(wte_), dgrad.d = d_hf_.data;
  gemm(lm_head_.dgrad, dgrad, s);
  hook();
  layernorm_backward(ptr<bf16>(grad_), w.grad(lnf_gamma_), w.grad(lnf_beta_), ptr<bf16>(d_hf_),
                     ptr<bf16>(x_.back()), w.weight(lnf_gamma_), ptr<float>(lnf_mean_),
                     ptr<float>(lnf_rstd_), M, C, false, mb > 0, norm_ws_.data, norm_ws_.bytes(),
                     s);
  if (microbatches_ > 1 && mb == microbatches_ - 1) {
    hook();
    mean_of(step_loss_, ptr<float>(mb_loss_), microbatches_, s);
  }
}

// ---- Backward ---------------------------------------------------------------------------------

void Transformer::layer_backward(int mb, int layer, cudaStream_t s) const {
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  const LayerActs& a = acts_[static_cast<size_t>(layer)];
  const bf16* x = ptr<bf16>(x_[static_cast<size_t>(layer)]);
  const int64_t M = shape_.tokens();
  const int C = static_cast<int>(shape_.hidden);
  const float drop = shape_.dropout;
  const int acc = mb > 0 ? 1 : 0;  // later micro-batches add to the first's gradients
  const ParamStore& w = params_;
  bf16* G = ptr<bf16>(grad_);
  float* scratch = ptr<float>(bias_scratch_);

  // MLP: G is dL/d(layer output).
  hook();
  dropout_residual_backward(ptr<bf16>(d_branch_), w.grad(p.fc2_bias), G, M, C, drop,
                            rng_of(rng_mlp_dropout_, mb, layer), acc, dropout_ws_.data,
                            dropout_ws_.bytes(), s);
  GemmArgs fc2_d;
  fc2_d.a = d_branch_.data, fc2_d.b = w.weight(p.fc2_weight), fc2_d.d = d_fc1_.data,
  fc2_d.aux = a.fc1_aux.data;
  gemm(fc2_.dgrad, fc2_d, s);  // dL/d(fc1 pre-activation) = (dY W2) * gelu'(aux)
  GemmArgs fc2_w;
  fc2_w.a = d_branch_.data, fc2_w.b = a.fc1_out.data, fc2_w.d = w.grad(p.fc2_weight);
  gemm(fc2_.wgrad[acc], fc2_w, s);
  GemmArgs fc1_d;
  fc1_d.a = d_fc1_.data, fc1_d.b = w.weight(p.fc1_weight), fc1_d.d = d_h_.data;
  gemm(fc1_.dgrad, fc1_d, s);
  GemmArgs fc1_w;
  fc1_w.a = d_fc1_.data, fc1_w.b = a.h2.data, fc1_w.d = w.grad(p.fc1_weight);
  fc1_w.bias_grad = acc ? scratch : w.grad(p.fc1_bias);
  gemm(fc1_.wgrad[acc], fc1_w, s);
  if (acc) {
    hook();
    accumulate(w.grad(p.fc1_bias), scratch, shape_.ffn_shard(), s);
  }
  hook();
  layernorm_backward(G, w.grad(p.ln2_gamma), w.grad(p.ln2_beta), ptr<bf16>(d_h_),
                     ptr<bf16>(a.x_mid), w.weight(p.ln2_gamma), ptr<float>(a.ln2_mean),
                     ptr<float>(a.ln2_rstd), M, C, true, acc, norm_ws_.data, norm_ws_.bytes(),
                     s);  // G is now dL/dx_mid

  // Attention.
  hook();
  dropout_residual_backward(ptr<bf16>(d_branch_), w.grad(p.proj_bias), G, M, C, drop,
                            rng_of(rng_attn_dropout_, mb, layer), acc, dropout_ws_.data,
                            dropout_ws_.bytes(), s);
  GemmArgs proj_d;
  proj_d.a = d_branch_.data, proj_d.b = w.weight(p.proj_weight), proj_d.d = d_attn_.data;
  gemm(proj_.dgrad, proj_d, s);
  GemmArgs proj_w;
  proj_w.a = d_branch_.data, proj_w.b = a.attn_o.data, proj_w.d = w.grad(p.proj_weight);
  gemm(proj_.wgrad[acc], proj_w, s);
  const AttentionDesc& ad = attention_->desc();
  const AttentionIO io{a.qkv.data, offset(a.qkv, ad.k_offset()), offset(a.qkv, ad.v_offset()),
                       a.attn_o.data, ptr<float>(a.attn_stats)};
  const AttentionGrads dio{d_attn_.data, d_qkv_.data, offset(d_qkv_, ad.k_offset()),
                           offset(d_qkv_, ad.v_offset())};
  hook();
  attention_->backward(ctx_, s, io, dio, rng_of(rng_attention_, mb, layer), attention_ws_.data,
                       attention_ws_.bytes());
  GemmArgs qkv_d;
  qkv_d.a = d_qkv_.data, qkv_d.b = w.weight(p.qkv_weight), qkv_d.d = d_h_.data;
  gemm(qkv_.dgrad, qkv_d, s);
  GemmArgs qkv_w;
  qkv_w.a = d_qkv_.data, qkv_w.b = a.h1.data, qkv_w.d = w.grad(p.qkv_weight);
  qkv_w.bias_grad = acc ? scratch : w.grad(p.qkv_bias);
  gemm(qkv_.wgrad[acc], qkv_w, s);
  if (acc) {
    hook();
    accumulate(w.grad(p.qkv_bias), scratch, shape_.qkv_width(), s);
  }
  hook();
  layernorm_backward(G, w.grad(p.ln1_gamma), w.grad(p.ln1_beta), ptr<bf16>(d_h_), x,
                     w.weight(p.ln1_gamma), ptr<float>(a.ln1_mean), ptr<float>(a.ln1_rstd), M, C,
                     true, acc, norm_ws_.data, norm_ws_.bytes(),
                     s);  // G is now dL/dx (the layer's input)
}

void Transformer::embedding_backward(int mb, cudaStream_t s) const {
  const ParamStore& w = params_;
  hook();
  replay::embedding_backward(w.grad(wte_), w.grad(wpe_), ptr<bf16>(grad_), tokens(mb),
                             EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden,
                                            shape_.vocab_start(), shape_.vocab_shard()},
                             mb > 0, embedding_ws_.data, embedding_ws_.bytes(), s);
  // The tied LM head's weight gradient, added to the token rows just written: dW += dlogits^T h.
  GemmArgs wgrad;
  wgrad.a = logits_.data, wgrad.b = hf_.data, wgrad.d = w.grad(wte_);
  gemm(lm_head_.wgrad[0], wgrad, s);
}

// ---- Region arguments -------------------------------------------------------------------------

graphs::RegionArgs Transformer::embedding_forward_args(int mb) const {
  const int64_t M = shape_.tokens();
  return graphs::RegionArgs()
      .read("tokens", TensorView(tokens(mb), DType::kINT32, {M}))
      .read("embedding", params_.weight_range(wte_, wpe_))
      .write("x0", x_[0]);
}

graphs::RegionArgs Transformer::layer_forward_args(int mb, int layer) const {
  const LayerActs& a = acts_.at(static_cast<size_t>(layer));
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  return graphs::RegionArgs()
      .read("x", x_[static_cast<size_t>(layer)])
      .read("params", params_.weight_range(p.first(), p.last()))
      .write("ln1.mean", a.ln1_mean)
      .write("ln1.rstd", a.ln1_rstd)
      .write("ln1.out", a.h1)
      .write("qkv", a.qkv)
      .write("attn.out", a.attn_o)
      .write("attn.lse", a.attn_stats)
      .write("x_mid", a.x_mid)
      .write("ln2.mean", a.ln2_mean)
      .write("ln2.rstd", a.ln2_rstd)
      .write("ln2.out", a.h2)
      .write("fc1.out", a.fc1_out)
      .write("fc1.preact", a.fc1_aux)
      .write("scratch", fwd_tmp_)
      .write("out", x_[static_cast<size_t>(layer) + 1]);
}

graphs::RegionArgs Transformer::head_args(int mb) const {
  const int64_t M = shape_.tokens();
  graphs::RegionArgs args;
  args.read("x", x_.back())
      .read("final_norm", params_.weight_range(lnf_gamma_, lnf_beta_))
      .read("embedding.token", params_.weight_range(wte_, wte_))
      .read("targets", TensorView(targets(mb), DType::kINT32, {M}))
      .read("dloss", dloss_)
      .write("norm.out", hf_)
      .write("norm.mean", lnf_mean_)
      .write("norm.rstd", lnf_rstd_)
      .write("logits", logits_)
      .write("ce.stats", ce_stats_)
      .write("ce.row_loss", row_loss_)
      .write("ce.count", count_)
      .write("norm.dout", d_hf_)
      .write("residual_grad", grad_)
      .write("loss", TensorView(loss_of(mb), DType::kFP32, {1}));
  if (mb == 0)
    args.write("final_norm.grad", params_.grad_range(lnf_gamma_, lnf_beta_));
  else
    args.read_write("final_norm.grad", params_.grad_range(lnf_gamma_, lnf_beta_));
  if (microbatches_ > 1 && mb == microbatches_ - 1)
    args.write("step_loss", TensorView(step_loss_, DType::kFP32, {1}));
  return args;
}

graphs::RegionArgs Transformer::layer_backward_args(int mb, int layer) const {
  const LayerActs& a = acts_.at(static_cast<size_t>(layer));
  const LayerParams& p = layers_.at(static_cast<size_t>(layer));
  graphs::RegionArgs args;
  args.read("x", x_[static_cast<size_t>(layer)])
      .read("params", params_.weight_range(p.first(), p.last()))
      .read("ln1.mean", a.ln1_mean)
      .read("ln1.rstd", a.ln1_rstd)
      .read("ln1.out", a.h1)
      .read("qkv", a.qkv)
      .read("attn.out", a.attn_o)
      .read("attn.lse", a.attn_stats)
      .read("x_mid", a.x_mid)
      .read("ln2.mean", a.ln2_mean)
      .read("ln2.rstd", a.ln2_rstd)
      .read("ln2.out", a.h2)
      .read("fc1.out", a.fc1_out)
      .read("fc1.preact", a.fc1_aux)
      .read_write("residual_grad", grad_)
      .write("branch_grad", d_branch_)
      .write("norm_out_grad", d_h_)
      .write("fc1_grad", d_fc1_)
      .write("attn_out_grad", d_attn_)
      .write("qkv_grad", d_qkv_);
  if (mb == 0) {
    args.write("grads", params_.grad_range(p.first(), p.last()));
  } else {
    args.read_write("grads", params_.grad_range(p.first(), p.last()));
    args.write("bias_scratch", bias_scratch_);
  }
  return args;
}

graphs::RegionArgs Transformer::embedding_backward_args(int mb) const {
  const int64_t M = shape_.tokens();
  graphs::RegionArgs args;
  args.read("tokens", TensorView(tokens(mb), DType::kINT32, {M}))
      .read("residual_grad", grad_)
      .read("dlogits", logits_)
      .read("norm.out", hf_);
  if (mb == 0)
    args.write("embedding.grad", params_.grad_range(wte_, wpe_));
  else
    args.read_write("embedding.grad", params_.grad_range(wte_, wpe_));
  return args;
}

}  // namespace replay::transformer
