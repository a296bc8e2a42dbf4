// moe_model.cpp: the DeepSeek-V3 shard (moe_model.h): parameters, plans, buffers, the blocks'
// parts forward and backward, the head, the regions and the synthetic data.
#include "workloads/moe/moe_model.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>

#include "common/check.h"
#include "common/data/splitmix.h"
#include "common/kernels/cross_entropy.h"
#include "common/kernels/activations.h"
#include "common/kernels/embedding.h"
#include "common/kernels/init.h"
#include "common/kernels/norms.h"
#include "common/kernels/rope.h"
#include "workloads/moe/expert_gemm.h"
#include "workloads/moe/moe_kernels.h"

namespace replay::moe {

namespace {

using bf16 = __nv_bfloat16;
using graphs::Access;
using graphs::RegionArgs;
using train::ParamId;
using train::ParamInit;
using train::ParamSpec;

template <typename T>
T* ptr(const TensorView& v) {
  return static_cast<T*>(v.data);
}

// The synthetic token data: x_{t+1} = (5 x_t + 3 + r_t) mod K with r_t uniform in {0, 1, 2, 3}
// over the first K = min(V, 64) ids of the vocabulary, so the next token given the current one
// has entropy ln 4 (the loss floor). The unused ids give a fresh model a fast first lesson (their
// logits fall), so the loss moves within a few dozen steps, as on real text.
constexpr int kNoise = 4;
constexpr int64_t kActiveIds = 64;

}  // namespace

// ---- Shape
// ----------------------------------------------------------------------------------------

int64_t MoeShape::max_per_expert() const {
  // A token sends at most one assignment to each global expert, so at most
  // min(topk, experts / local) of its assignments fold onto one local expert.
  const int64_t per_token = std::min<int64_t>(topk, experts / local_experts);
  return tokens() * per_token;
}

int64_t MoeShape::ep_capacity() const {
  REPLAY_REQUIRE(!dropless(), "MoE shape: expert parallelism needs a capacity factor");
  return moe_capacity(capacity_factor, tokens(), topk, experts);
}

DispatchShape MoeShape::dispatch_shape() const {
  if (ep > 1) return DispatchShape{tokens(), experts, topk, DispatchMode::kCapacity, ep_capacity()};
  return DispatchShape{tokens(), local_experts, topk, DispatchMode::kCapacity, capacity()};
}

int64_t MoeShape::capacity() const {
  if (ep > 1) return ep * ep_capacity();
  if (dropless()) return max_per_expert();
  const double exact =
      capacity_factor * static_cast<double>(tokens() * topk) / static_cast<double>(local_experts);
  const auto c = static_cast<int64_t>(std::ceil(exact - 1e-9));
  return std::min(std::max<int64_t>(c, 1), max_per_expert());
}

void MoeShape::validate() const {
  auto need = [](bool ok, const std::string& what) { REPLAY_REQUIRE(ok, "MoE shape: " + what); };
  need(micro_batch >= 1 && seq >= 1, "micro-batch and sequence must be positive");
  need(hidden % 8 == 0 && hidden >= 8, "hidden must be a positive multiple of 8");
  need(q_lora % 8 == 0 && kv_lora % 8 == 0 && q_lora >= 8 && kv_lora >= 8,
       "the LoRA ranks must be positive multiples of 8");
  need(nope_dim % 8 == 0 && v_dim % 8 == 0 && rope_dim % 16 == 0 && rope_dim >= 16,
       "the head dims must be multiples of 8 (RoPE's of 16)");
  need(heads >= 1, "at least one head");
  need(dense_layers >= 0 && moe_layers >= 0 && layers() >= 1, "at least one block");
  need(dense_ffn % 8 == 0 && expert_ffn % 8 == 0 && shared_ffn % 8 == 0 && expert_ffn >= 8,
       "the FFN widths must be multiples of 8");
  need(local_experts >= 1 && experts % local_experts == 0,
       "the local experts must divide the experts");
  need(head == HeadKind::kPipelineStage || (vocab >= 8 && vocab % 8 == 0),
       "the vocabulary must be a positive multiple of 8");
  check_router_shape(RouterShape{tokens(), experts, groups, topk_groups, topk, route_scale});
  check_yarn(yarn);
  need(std::isfinite(capacity_factor) && capacity_factor >= 0.0,
       "the capacity factor must be positive (0: dropless)");
  need(ep >= 1 && ep_rank >= 0 && ep_rank < ep, "the expert-parallel rank must be in [0, ep)");
  if (ep > 1) {
    need(!dropless(), "expert parallelism exchanges capacity-sized buffers: no dropless");
    need(experts % ep == 0 && local_experts * ep == experts,
         "the expert-parallel ranks must divide the experts (local experts = experts / ep)");
  }
  check_dispatch_shape(dispatch_shape());
}

// ---- Plans and blocks
// -----------------------------------------------------------------------------

struct MoeModel::Plans {
  struct Linear {
    GemmPlan *fwd = nullptr, *fwd_acc = nullptr, *dgrad = nullptr, *dgrad_acc = nullptr,
             *wgrad = nullptr;
  };
  Linear qa, qb, kva, kpe, kvb, wo, w1, w2, router, sw1, sw2, ew1, ew2, head;
};

struct MoeModel::Block {
  bool moe = false;
  int moe_index = -1;
  ParamId norm1 = -1, qa = -1, qnorm = -1, qb = -1, kva = -1, kvnorm = -1, kpe = -1, kvb = -1,
          wo = -1;
  ParamId norm2 = -1, w1 = -1, w2 = -1;                         // dense
  ParamId router = -1, ew1 = -1, ew2 = -1, sw1 = -1, sw2 = -1;  // MoE (norm2 too)
  // Saved activations.
  TensorView h1, rstd1, q_lat, q_rstd, q_latn, q, kv_lat, kv_rstd, kv_latn, k, v, o, lse, x_mid;
  TensorView h2, rstd2, a, s;  // dense SwiGLU, or the shared expert's
  TensorView logits, indices, weights, aux_ws, local_idx, routed, kept, offsets, slot_row,
      row_source, dropped, x_sorted, up, act, y_sorted;
  TensorView recv_counts;  // expert parallelism: [ep, local experts] rows received
  // State carried from step to step.
  TensorView bias, load;
  ParamId attn_last() const { return wo; }
  ParamId ffn_last() const { return moe ? sw2 : w2; }
};

struct MoeModel::Part {
  std::string name;   // "attn", "mlp", "router", "preprocess", "experts"
  std::string scope;  // "attn", "mlp", "moe_router", "moe_preprocess", "moe_experts"
  std::function<void(cudaStream_t)> run;
  std::function<RegionArgs()> args;
};

MoeModel::MoeModel(const Context& ctx, const MoeShape& shape, uint64_t data_seed,
                   std::vector<std::string> scopes, comm::Communicator* ep_comm)
    : ctx_(ctx),
      shape_(shape),
      ep_comm_(ep_comm),
      scopes_(std::move(scopes)),
      gemms_(ctx),
      plans_(std::make_unique<Plans>()),
      data_seed_(data_seed) {
  shape_.validate();
  REPLAY_REQUIRE(shape_.ep == 1 || (ep_comm_ != nullptr && ep_comm_->size() == shape_.ep &&
                                    ep_comm_->rank() == shape_.ep_rank),
                 "MoeModel: expert parallelism over " + std::to_string(shape_.ep) +
                     " ranks needs their communicator");
  const int64_t M = shape_.tokens(), C = shape_.hidden, H = shape_.heads;
  const int64_t QK = shape_.qk_dim(), Dv = shape_.v_dim;
  const float out_std = 0.02f / std::sqrt(2.0f * static_cast<float>(shape_.layers()));
  // Expert parallelism: each rank holds its block of experts, drawn as the slice of the
  // one-process tensor [experts, ...] (TpSplit::kRows over the expert dimension), so the ranks
  // together start from the one-GPU model; everything else is replicated (drawn alike, its
  // gradient summed over the group, counted once in the grad norm).
  const bool ep = shape_.ep > 1;
  std::vector<bool> expert_param;
  auto add = [&](const std::string& name, std::vector<int64_t> dims, ParamInit init, float sd,
                 bool expert = false) {
    const bool decay = init == ParamInit::kNormal;
    ParamSpec spec;
    spec.name = name;
    spec.shape = std::move(dims);
    spec.init = init;
    spec.stddev = sd;
    spec.weight_decay = decay;
    spec.tp_replicated = ep && !expert;
    spec.tp_split = ep && expert ? train::TpSplit::kRows : train::TpSplit::kNone;
    expert_param.push_back(expert);
    return params_.add(spec);
  };
  if (shape_.head == HeadKind::kLmHead)
    wte_ = add("embedding.token", {shape_.vocab, C}, ParamInit::kNormal, 0.02f);
  int moe_index = 0;
  for (int64_t l = 0; l < shape_.layers(); ++l) {
    auto b = std::make_unique<Block>();
    const std::string n = "layer" + std::to_string(l) + ".";
    b->moe = l >= shape_.dense_layers;
    if (b->moe) b->moe_index = moe_index++;
    b->norm1 = add(n + "attn_norm.weight", {C}, ParamInit::kOnes, 0);
    b->qa = add(n + "attn.q_a.weight", {shape_.q_lora, C}, ParamInit::kNormal, 0.02f);
    b->qnorm = add(n + "attn.q_a_norm.weight", {shape_.q_lora}, ParamInit::kOnes, 0);
    b->qb = add(n + "attn.q_b.weight", {H * QK, shape_.q_lora}, ParamInit::kNormal, 0.02f);
    b->kva = add(n + "attn.kv_a.weight", {shape_.kv_lora, C}, ParamInit::kNormal, 0.02f);
    b->kvnorm = add(n + "attn.kv_a_norm.weight", {shape_.kv_lora}, ParamInit::kOnes, 0);
    b->kpe = add(n + "attn.k_rope.weight", {shape_.rope_dim, C}, ParamInit::kNormal, 0.02f);
    b->kvb = add(n + "attn.kv_b.weight", {H * (shape_.nope_dim + Dv), shape_.kv_lora},
                 ParamInit::kNormal, 0.02f);
    b->wo = add(n + "attn.o.weight", {C, H * Dv}, ParamInit::kNormal, out_std);
    b->norm2 = add(n + "ffn_norm.weight", {C}, ParamInit::kOnes, 0);
    if (!b->moe) {
      b->w1 = add(n + "mlp.gate_up.weight", {2 * shape_.dense_ffn, C}, ParamInit::kNormal, 0.02f);
      b->w2 = add(n + "mlp.down.weight", {C, shape_.dense_ffn}, ParamInit::kNormal, out_std);
    } else {
      const int64_t E = shape_.local_experts, F = shape_.expert_ffn, S = shape_.shared_ffn;
      b->router = add(n + "moe.router.weight", {shape_.experts, C}, ParamInit::kNormal, 0.02f);
      b->ew1 =
          add(n + "moe.experts.gate_up.weight", {E, 2 * F, C}, ParamInit::kNormal, 0.02f, true);
      b->ew2 = add(n + "moe.experts.down.weight", {E, C, F}, ParamInit::kNormal, out_std, true);
      b->sw1 = add(n + "moe.shared.gate_up.weight", {2 * S, C}, ParamInit::kNormal, 0.02f);
      b->sw2 = add(n + "moe.shared.down.weight", {C, S}, ParamInit::kNormal, out_std);
    }
    blocks_.push_back(std::move(b));
  }
  if (shape_.head == HeadKind::kLmHead) {
    lnf_ = add("final_norm.weight", {C}, ParamInit::kOnes, 0);
    lm_head_ = add("lm_head.weight", {shape_.vocab, C}, ParamInit::kNormal, 0.02f);
  }
  if (ep) {
    for (ParamId id = 0; id < params_.count(); ++id) {
      if (expert_param[static_cast<size_t>(id)]) continue;
      if (!replicated_.empty() && replicated_.back().second == id - 1)
        replicated_.back().second = id;
      else
        replicated_.emplace_back(id, id);
    }
    params_.set_tensor_parallel(shape_.ep_rank, shape_.ep);
  }

  // GEMM plans, shared by the blocks (one per shape, from the cache).
  auto make = [&](int64_t rows, int64_t in, int64_t out, bool fwd_acc, bool dgrad_acc) {
    const LinearGemms g = linear_gemms(rows, in, out, false, false);
    Plans::Linear l;
    l.fwd = &gemms_.get(g.forward);
    if (fwd_acc) {
      GemmDesc d = g.forward;
      d.beta = 1.0f;
      l.fwd_acc = &gemms_.get(d);
    }
    l.dgrad = &gemms_.get(g.dgrad);
    if (dgrad_acc) {
      GemmDesc d = g.dgrad;
      d.beta = 1.0f;
      l.dgrad_acc = &gemms_.get(d);
    }
    l.wgrad = &gemms_.get(g.wgrad);
    return l;
  };
  Plans& p = *plans_;
  p.qa = make(M, C, shape_.q_lora, false, true);
  p.qb = make(M, shape_.q_lora, H * QK, false, false);
  p.kva = make(M, C, shape_.kv_lora, false, false);
  p.kpe = make(M, C, shape_.rope_dim, false, true);
  p.kvb = make(M, shape_.kv_lora, H * (shape_.nope_dim + Dv), false, false);
  p.wo = make(M, H * Dv, C, true, false);
  if (shape_.dense_layers > 0) {
    p.w1 = make(M, C, 2 * shape_.dense_ffn, false, false);
    p.w2 = make(M, shape_.dense_ffn, C, true, false);
  }
  if (shape_.moe_layers > 0) {
    // The router: bf16 inputs, fp32 logits; its backward takes the gradient cast to bf16.
    LinearGemms r = linear_gemms(M, C, shape_.experts, false, false);
    r.forward.d_type = DType::kFP32;
    p.router.fwd = &gemms_.get(r.forward);
    GemmDesc rd = r.dgrad;
    rd.beta = 1.0f;
    p.router.dgrad_acc = &gemms_.get(rd);
    p.router.wgrad = &gemms_.get(r.wgrad);
    p.sw1 = make(M, C, 2 * shape_.shared_ffn, false, false);
    p.sw2 = make(M, shape_.shared_ffn, C, true, false);
    const int64_t E = shape_.local_experts, cap = shape_.capacity();
    const LinearGemms e1 = expert_linear_gemms(E, cap, C, 2 * shape_.expert_ffn, false);
    const LinearGemms e2 = expert_linear_gemms(E, cap, shape_.expert_ffn, C, false);
    p.ew1 = {&gemms_.get(e1.forward), nullptr, &gemms_.get(e1.dgrad), nullptr,
             &gemms_.get(e1.wgrad)};
    p.ew2 = {&gemms_.get(e2.forward), nullptr, &gemms_.get(e2.dgrad), nullptr,
             &gemms_.get(e2.wgrad)};
  }
  if (shape_.head == HeadKind::kLmHead) p.head = make(M, C, shape_.vocab, false, false);
  gemms_.seal();

  AttentionDesc att;
  att.batch = shape_.micro_batch;
  att.heads_q = H;
  att.heads_kv = H;
  att.seq_q = shape_.seq;
  att.head_dim_qk = QK;
  att.head_dim_v = Dv;
  att.causal = true;
  // YaRN multiplies the softmax scale by mscale^2 (yarn.h); 0 keeps the library's 1/sqrt(d_qk).
  if (shape_.yarn.enabled) att.scale = static_cast<float>(mla_softmax_scale(QK, shape_.yarn));
  att.layout = AttentionLayout::kSeparate;
  att.dtype = DType::kBF16;
  attention_ = &attention_cache_.get(ctx_, att);

  gemm_ws_bytes_ = std::max<size_t>(gemms_.max_workspace_bytes(), 256);
  attention_ws_bytes_ = std::max<size_t>(
      {attention_->forward_workspace_bytes(), attention_->backward_workspace_bytes(), size_t{256}});
  norm_ws_bytes_ = std::max({rmsnorm_backward_workspace_bytes(M, static_cast<int>(C)),
                             rmsnorm_backward_workspace_bytes(M, static_cast<int>(shape_.q_lora)),
                             rmsnorm_backward_workspace_bytes(M, static_cast<int>(shape_.kv_lora)),
                             size_t{256}});
  if (shape_.moe_layers > 0)
    dispatch_ws_bytes_ =
        std::max<size_t>(moe_dispatch_workspace_bytes(shape_.dispatch_shape()), 256);
  if (shape_.head == HeadKind::kLmHead) {
    embedding_ws_bytes_ = embedding_backward_workspace_bytes(
        EmbeddingShape{shape_.micro_batch, shape_.seq, C, 0, shape_.vocab});
    // The synthetic data, in pinned memory: per batch M tokens and M targets. Expert parallelism:
    // a global batch of ep x M tokens, of which this rank reads slice ep_rank (what one process
    // with ep times the micro-batch reads whole).
    const int64_t n = shape_.data_batches * M * shape_.ep;
    REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_tokens_),
                                    static_cast<size_t>(n) * sizeof(int32_t),
                                    cudaHostAllocDefault));
    REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_targets_),
                                    static_cast<size_t>(n) * sizeof(int32_t),
                                    cudaHostAllocDefault));
    uint64_t state = data_seed_ ^ 0x6d6f65ull;
    const auto V = static_cast<uint64_t>(std::min(shape_.vocab, kActiveIds));
    for (int64_t seqi = 0; seqi < shape_.data_batches * shape_.micro_batch * shape_.ep; ++seqi) {
      uint64_t x = data::splitmix(state) % V;
      for (int64_t t = 0; t < shape_.seq; ++t) {
        const uint64_t next = (5 * x + 3 + data::splitmix(state) % kNoise) % V;
        host_tokens_[seqi * shape_.seq + t] = static_cast<int32_t>(x);
        host_targets_[seqi * shape_.seq + t] = static_cast<int32_t>(next);
        x = next;
      }
    }
  }
}

MoeModel::~MoeModel() {
  if (host_tokens_) cudaFreeHost(host_tokens_);
  if (host_targets_) cudaFreeHost(host_targets_);
}

std::string MoeModel::describe() const {
  char buf[400];
  std::snprintf(
      buf, sizeof(buf),
      "DeepSeek-V3 shard: %" PRId64 " dense + %" PRId64 " MoE blocks, hidden %" PRId64 ", %" PRId64
      " MLA heads (q LoRA %" PRId64 ", kv LoRA %" PRId64 "), %d of %d routed experts (FFN %" PRId64
      ") top-%d in %d groups keep %d, "
      "shared FFN %" PRId64 ", %s, %" PRId64 " x %" PRId64 " tokens, %s head",
      shape_.dense_layers, shape_.moe_layers, shape_.hidden, shape_.heads, shape_.q_lora,
      shape_.kv_lora, shape_.local_experts, shape_.experts, shape_.expert_ffn, shape_.topk,
      shape_.groups, shape_.topk_groups, shape_.shared_ffn,
      shape_.dropless()
          ? "dropless"
          : ("capacity " + std::to_string(shape_.capacity()) + " rows per expert").c_str(),
      shape_.micro_batch, shape_.seq, shape_.head == HeadKind::kLmHead ? "LM" : "pipeline-stage");
  return buf;
}

// ---- Buffers
// --------------------------------------------------------------------------------------

void MoeModel::add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype,
                   int64_t elements, Lifetime life) {
  planned_.push_back(
      Planned{plan.add(name, dtype, elements, "activations", life), dtype, elements, &view});
}

void MoeModel::plan(ArenaPlan& plan) {
  REPLAY_REQUIRE(planned_.empty(), "MoeModel::plan called twice");
  const int L = static_cast<int>(shape_.layers());
  const int64_t M = shape_.tokens(), C = shape_.hidden, H = shape_.heads, QK = shape_.qk_dim(),
                Dv = shape_.v_dim, Dn = shape_.nope_dim, Dr = shape_.rope_dim;
  const int64_t E = shape_.experts, k = shape_.topk,
                rows = shape_.local_experts * shape_.capacity();
  const int fwd0 = 2, head_phase = 2 + L, emb_bwd = 3 + 2 * L, opt = 4 + 2 * L;
  auto bwd = [&](int l) { return 3 + 2 * L - 1 - l; };
  const Lifetime forever{};
  const Lifetime backward{bwd(L - 1), bwd(0)};
  const DType kBF = DType::kBF16, kF32 = DType::kFP32, kI32 = DType::kINT32, kU8 = DType::kUINT8;
  const int64_t moe_blocks = std::max<int64_t>(shape_.moe_layers, 1);

  params_.plan(plan, {opt, opt});
  const bool lm = shape_.head == HeadKind::kLmHead;
  if (lm) {
    add(plan, tokens_, "input.tokens", kI32, M, forever);
    add(plan, targets_, "input.targets", kI32, M, forever);
  } else {
    add(plan, stage_grad_, "input.stage_grad", kBF, M * C, forever);
  }
  add(plan, rope_q_table_, "rope.table", kF32, shape_.seq * Dr, forever);
  add(plan, aux_losses_, "moe.aux_losses", kF32, moe_blocks, forever);

  x_.resize(static_cast<size_t>(L) + 1);
  // A pipeline stage's input is what the previous stage sent: fixed for the run.
  add(plan, x_[0], "x0", kBF, M * C, lm ? Lifetime{1, bwd(0)} : forever);
  for (int l = 0; l < L; ++l) {
    Block& b = *blocks_[static_cast<size_t>(l)];
    const std::string p = "layer" + std::to_string(l) + ".";
    const Lifetime life{fwd0 + l, bwd(l)};
    add(plan, b.h1, p + "attn_norm.out", kBF, M * C, life);
    add(plan, b.rstd1, p + "attn_norm.rstd", kF32, M, life);
    add(plan, b.q_lat, p + "q_a.out", kBF, M * shape_.q_lora, life);
    add(plan, b.q_rstd, p + "q_a_norm.rstd", kF32, M, life);
    add(plan, b.q_latn, p + "q_a_norm.out", kBF, M * shape_.q_lora, life);
    add(plan, b.q, p + "q", kBF, M * H * QK, life);
    add(plan, b.kv_lat, p + "kv_a.out", kBF, M * shape_.kv_lora, life);
    add(plan, b.kv_rstd, p + "kv_a_norm.rstd", kF32, M, life);
    add(plan, b.kv_latn, p + "kv_a_norm.out", kBF, M * shape_.kv_lora, life);
    add(plan, b.k, p + "k", kBF, M * H * QK, life);
    add(plan, b.v, p + "v", kBF, M * H * Dv, life);
    add(plan, b.o, p + "attn.out", kBF, M * H * Dv, life);
    add(plan, b.lse, p + "attn.lse", kF32, M * H, life);
    add(plan, b.x_mid, p + "x_mid", kBF, M * C, life);
    add(plan, b.h2, p + "ffn_norm.out", kBF, M * C, life);
    add(plan, b.rstd2, p + "ffn_norm.rstd", kF32, M, life);
    const int64_t F = b.moe ? shape_.shared_ffn : shape_.dense_ffn;
    add(plan, b.a, p + (b.moe ? "shared.gate_up" : "mlp.gate_up"), kBF, M * 2 * F, life);
    add(plan, b.s, p + (b.moe ? "shared.act" : "mlp.act"), kBF, M * F, life);
    if (b.moe) {
      const AuxLossShape aux{M, shape_.seq, shape_.experts, shape_.topk, shape_.aux_coeff};
      add(plan, b.logits, p + "router.logits", kF32, M * E, life);
      add(plan, b.indices, p + "router.indices", kI32, M * k, life);
      add(plan, b.weights, p + "router.weights", kF32, M * k, life);
      add(plan, b.aux_ws, p + "router.aux_workspace", kU8,
          static_cast<int64_t>(router_aux_loss_workspace_bytes(aux)), life);
      add(plan, b.local_idx, p + "dispatch.local_indices", kI32, M * k, life);
      const int sorted = shape_.dispatch_shape().experts;  // local (ep 1) or global experts
      add(plan, b.routed, p + "dispatch.routed", kI32, sorted, life);
      add(plan, b.kept, p + "dispatch.kept", kI32, sorted, life);
      add(plan, b.offsets, p + "dispatch.offsets", kI32, sorted + 1, life);
      if (shape_.ep > 1)  // per (source rank, local expert): the rows the source filled
        add(plan, b.recv_counts, p + "dispatch.received", kI32, shape_.experts, life);
      add(plan, b.slot_row, p + "dispatch.slot_row", kI32, M * k, life);
      add(plan, b.row_source, p + "dispatch.row_source", kI32, rows, life);
      add(plan, b.dropped, p + "dispatch.dropped", kI32, 1, forever);  // read after the step
      add(plan, b.x_sorted, p + "experts.in", kBF, rows * C, life);
      add(plan, b.up, p + "experts.gate_up", kBF, rows * 2 * shape_.expert_ffn, life);
      add(plan, b.act, p + "experts.act", kBF, rows * shape_.expert_ffn, life);
      add(plan, b.y_sorted, p + "experts.out", kBF, rows * C, life);
      add(plan, b.bias, p + "router.bias", kF32, E, forever);
      add(plan, b.load, p + "router.load", kI32, E, forever);
    }
    const int end = l + 1 < L ? bwd(l + 1) : head_phase;
    add(plan, x_[static_cast<size_t>(l) + 1], "x" + std::to_string(l + 1), kBF, M * C,
        {fwd0 + l, end});
  }
  add(plan, kvb_, "forward.kv_b.out", kBF, M * H * (Dn + Dv), {fwd0, fwd0 + L - 1});
  add(plan, kpe_, "forward.k_rope", kBF, M * Dr, {fwd0, fwd0 + L - 1});

  const Lifetime head{head_phase, head_phase};
  if (lm) {
    const Lifetime head_to_emb{head_phase, emb_bwd};
    add(plan, hf_, "head.norm.out", kBF, M * C, head);
    add(plan, lnf_rstd_, "head.norm.rstd", kF32, M, head);
    add(plan, logits_, "head.logits", kBF, M * shape_.vocab, head);
    add(plan, ce_stats_, "head.ce.stats", kF32, cross_entropy_stats_floats(M), head);
    add(plan, row_loss_, "head.ce.row_loss", kF32, M, head);
    add(plan, count_, "head.ce.count", kI32, 1, head);
    add(plan, d_hf_, "head.norm.dout", kBF, M * C, head);
    add(plan, grad_, "backward.residual_grad", kBF, M * C, head_to_emb);
    add(plan, embedding_ws_, "embedding.workspace", kU8, static_cast<int64_t>(embedding_ws_bytes_),
        {emb_bwd, emb_bwd});
  } else {
    add(plan, stage_partials_, "head.partials", kF32, stage_head_partials(M * C), head);
    add(plan, grad_, "backward.residual_grad", kBF, M * C, {head_phase, bwd(0)});
  }

  add(plan, dh_, "backward.norm_out_grad", kBF, M * C, backward);
  add(plan, d_o_, "backward.attn_out_grad", kBF, M * H * Dv, backward);
  add(plan, dq_, "backward.q_grad", kBF, M * H * QK, backward);
  add(plan, dk_, "backward.k_grad", kBF, M * H * QK, backward);
  add(plan, dv_, "backward.v_grad", kBF, M * H * Dv, backward);
  add(plan, dkvb_, "backward.kv_b_grad", kBF, M * H * (Dn + Dv), backward);
  add(plan, dkpe_, "backward.k_rope_grad", kBF, M * Dr, backward);
  add(plan, d_kv_latn_, "backward.kv_norm_out_grad", kBF, M * shape_.kv_lora, backward);
  add(plan, d_kv_lat_, "backward.kv_a_grad", kBF, M * shape_.kv_lora, backward);
  add(plan, d_q_latn_, "backward.q_norm_out_grad", kBF, M * shape_.q_lora, backward);
  add(plan, d_q_lat_, "backward.q_a_grad", kBF, M * shape_.q_lora, backward);
  const int64_t F = std::max(shape_.dense_layers > 0 ? shape_.dense_ffn : 8,
                             shape_.moe_layers > 0 ? shape_.shared_ffn : 8);
  add(plan, d_s_, "backward.swiglu_out_grad", kBF, M * F, backward);
  add(plan, d_a_, "backward.gate_up_grad", kBF, M * 2 * F, backward);
  if (shape_.moe_layers > 0) {
    add(plan, dy_sorted_, "backward.experts.out_grad", kBF, rows * C, backward);
    add(plan, d_act_, "backward.experts.act_grad", kBF, rows * shape_.expert_ffn, backward);
    add(plan, d_up_, "backward.experts.gate_up_grad", kBF, rows * 2 * shape_.expert_ffn, backward);
    add(plan, dx_sorted_, "backward.experts.in_grad", kBF, rows * C, backward);
    add(plan, dweights_, "backward.router.weights_grad", kF32, M * k, backward);
    add(plan, dlogits_, "backward.router.logits_grad", kF32, M * E, backward);
    add(plan, dlogits_bf_, "backward.router.logits_grad_bf16", kBF, M * E, backward);
    add(plan, dispatch_ws_, "dispatch.workspace", kU8, static_cast<int64_t>(dispatch_ws_bytes_),
        {fwd0, fwd0 + L - 1});
    if (shape_.ep > 1) {
      add(plan, ep_a_, "expert_parallel.buffer_a", kBF, rows * C, {fwd0, bwd(0)});
      add(plan, ep_b_, "expert_parallel.buffer_b", kBF, rows * C, {fwd0, bwd(0)});
      add(plan, ep_scale_, "expert_parallel.backward_scale", kF32, 1, forever);
    }
  }
  add(plan, gemm_ws_, "gemm.workspace", kU8, static_cast<int64_t>(gemm_ws_bytes_), {1, emb_bwd});
  add(plan, attention_ws_, "attention.workspace", kU8, static_cast<int64_t>(attention_ws_bytes_),
      {fwd0, bwd(0)});
  add(plan, norm_ws_, "rmsnorm.workspace", kU8, static_cast<int64_t>(norm_ws_bytes_),
      {head_phase, bwd(0)});
}

void MoeModel::bind(const Arena& arena) {
  REPLAY_REQUIRE(!planned_.empty(), "MoeModel::bind before plan");
  params_.bind(arena);
  for (const Planned& p : planned_) *p.view = arena.view(p.id, p.dtype, {p.elements});
}

void MoeModel::initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) {
  io_ = io;
  params_.initialize(seed, stream);
  // The RoPE table: plain on the device, or with DeepSeek-V3's YaRN scaling built on the host in
  // fp64 (yarn.h) and copied once (set-up; the copy completes before the synchronize below).
  std::vector<float> yarn_table;
  if (shape_.yarn.enabled) {
    yarn_table = yarn_rope_table(static_cast<int>(shape_.seq), static_cast<int>(shape_.rope_dim),
                                 shape_.rope_theta, shape_.yarn);
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(rope_q_table_.data, yarn_table.data(),
                                      yarn_table.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream));
  } else {
    rope_build_table(static_cast<float2*>(rope_q_table_.data), static_cast<int>(shape_.seq),
                     static_cast<int>(shape_.rope_dim), shape_.rope_theta, RopeScaling{}, stream);
  }
  REPLAY_CUDA_CHECK(cudaMemsetAsync(aux_losses_.data, 0, aux_losses_.bytes(), stream));
  for (const auto& b : blocks_) {
    if (!b->moe) continue;
    REPLAY_CUDA_CHECK(cudaMemsetAsync(b->bias.data, 0, b->bias.bytes(), stream));
    REPLAY_CUDA_CHECK(cudaMemsetAsync(b->load.data, 0, b->load.bytes(), stream));
    REPLAY_CUDA_CHECK(cudaMemsetAsync(b->dropped.data, 0, b->dropped.bytes(), stream));
  }
  if (shape_.head == HeadKind::kPipelineStage) {
    // What the neighbouring stages would send: the input activation and the output gradient,
    // drawn once from the seed (Philox streams past every parameter's).
    // Expert parallelism: each rank's micro-batch is its slice of what one process running all
    // the ranks' sequences draws (so --ep 1 with ep times the micro-batch reads the same data).
    if (shape_.ep > 1) {
      InitSlice slice;
      slice.rows[0] = shape_.tokens();
      slice.full_row[0] = shape_.ep_rank * shape_.tokens();
      slice.cols = slice.full_cols = shape_.hidden;
      init_normal_slice(x_[0], slice, seed, 1u << 30, 0.0f, 1.0f, stream);
      init_normal_slice(stage_grad_, slice, seed, (1u << 30) + 1, 0.0f, 1.0f, stream);
    } else {
      init_normal(x_[0], seed, 1u << 30, 0.0f, 1.0f, stream);
      init_normal(stage_grad_, seed, (1u << 30) + 1, 0.0f, 1.0f, stream);
    }
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<train::Model::NamedTensor> MoeModel::checkpoint_state() const {
  std::vector<NamedTensor> out;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& b = *blocks_[l];
    if (b.moe) out.push_back({"layer" + std::to_string(l) + ".router.bias", b.bias});
  }
  return out;
}

int MoeModel::load_batch(cudaStream_t stream) {
  if (shape_.head == HeadKind::kLmHead) {
    const int64_t M = shape_.tokens();
    const int64_t first = ((next_batch_ % shape_.data_batches) * shape_.ep + shape_.ep_rank) * M;
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(tokens_.data, host_tokens_ + first,
                                      static_cast<size_t>(M) * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, stream));
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(targets_.data, host_targets_ + first,
                                      static_cast<size_t>(M) * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, stream));
  }
  next_batch_ += 1;
  return 0;
}

void MoeModel::seek_data(int64_t position) {
  REPLAY_REQUIRE(position >= 0, "MoeModel::seek_data: negative position");
  next_batch_ = position;
}

void MoeModel::gemm(GemmPlan* plan, const void* a, const void* b, void* d, cudaStream_t s,
                    const void* c) const {
  GemmArgs args;
  args.a = a, args.b = b, args.d = d, args.c = c;
  args.workspace = gemm_ws_.data;
  args.workspace_bytes = gemm_ws_.bytes();
  plan->run(s, args);
}

// ---- A block's parts
// ------------------------------------------------------------------------------

std::vector<MoeModel::Part> MoeModel::forward_parts(int l) {
  Block& b = *blocks_[static_cast<size_t>(l)];
  const int64_t M = shape_.tokens(), C = shape_.hidden;
  const TensorView& x = x_[static_cast<size_t>(l)];
  const TensorView& out = x_[static_cast<size_t>(l) + 1];
  auto W = [this](ParamId id) { return params_.weight<bf16>(id); };
  const float eps = shape_.norm_eps;
  std::vector<Part> parts;

  // Attention: h1, MLA, the output projection and the residual.
  Part attn{"attn", "attn", nullptr, nullptr};
  attn.run = [this, &b, x, M, C, W, eps](cudaStream_t s) {
    const Plans& p = *plans_;
    const int64_t H = shape_.heads, QK = shape_.qk_dim();
    rmsnorm_forward(ptr<bf16>(b.h1), ptr<float>(b.rstd1), ptr<bf16>(x), W(b.norm1), M,
                    static_cast<int>(C), eps, s);
    gemm(p.qa.fwd, b.h1.data, W(b.qa), b.q_lat.data, s);
    rmsnorm_forward(ptr<bf16>(b.q_latn), ptr<float>(b.q_rstd), ptr<bf16>(b.q_lat), W(b.qnorm), M,
                    static_cast<int>(shape_.q_lora), eps, s);
    gemm(p.qb.fwd, b.q_latn.data, W(b.qb), b.q.data, s);
    const auto* table = static_cast<const float2*>(rope_q_table_.data);
    const int positions = static_cast<int>(shape_.seq);
    RopeLayout ql{shape_.micro_batch,
                  shape_.seq,
                  static_cast<int>(H),
                  static_cast<int>(QK),
                  static_cast<int>(shape_.rope_dim),
                  static_cast<int>(shape_.nope_dim),
                  0};
    rope_forward(ptr<bf16>(b.q), ptr<bf16>(b.q), table, positions, nullptr, ql, s);
    gemm(p.kva.fwd, b.h1.data, W(b.kva), b.kv_lat.data, s);
    rmsnorm_forward(ptr<bf16>(b.kv_latn), ptr<float>(b.kv_rstd), ptr<bf16>(b.kv_lat), W(b.kvnorm),
                    M, static_cast<int>(shape_.kv_lora), eps, s);
    gemm(p.kvb.fwd, b.kv_latn.data, W(b.kvb), kvb_.data, s);
    gemm(p.kpe.fwd, b.h1.data, W(b.kpe), kpe_.data, s);
    RopeLayout kl{shape_.micro_batch,
                  shape_.seq,
                  1,
                  static_cast<int>(shape_.rope_dim),
                  static_cast<int>(shape_.rope_dim),
                  0,
                  0};
    rope_forward(ptr<bf16>(kpe_), ptr<bf16>(kpe_), table, positions, nullptr, kl, s);
    const MlaDims d{M, static_cast<int>(H), static_cast<int>(shape_.nope_dim),
                    static_cast<int>(shape_.rope_dim), static_cast<int>(shape_.v_dim)};
    mla_assemble_kv(ptr<bf16>(b.k), ptr<bf16>(b.v), ptr<bf16>(kvb_), ptr<bf16>(kpe_), d, s);
    const AttentionIO io{b.q.data, b.k.data, b.v.data, b.o.data, ptr<float>(b.lse)};
    attention_->forward(ctx_, s, io, RngArgs{}, attention_ws_.data, attention_ws_.bytes());
    gemm(p.wo.fwd_acc, b.o.data, W(b.wo), b.x_mid.data, s, x.data);  // x_mid = x + o Wo^T
  };
  attn.args = [this, &b, x] {
    return RegionArgs()
        .read("x", x)
        .read("params", params_.weight_range(b.norm1, b.attn_last()))
        .read("rope.table", rope_q_table_)
        .write("h1", b.h1)
        .write("rstd1", b.rstd1)
        .write("q_lat", b.q_lat)
        .write("q_rstd", b.q_rstd)
        .write("q_latn", b.q_latn)
        .write("q", b.q)
        .write("kv_lat", b.kv_lat)
        .write("kv_rstd", b.kv_rstd)
        .write("kv_latn", b.kv_latn)
        .write("kv_b.out", kvb_)
        .write("k_rope", kpe_)
        .write("k", b.k)
        .write("v", b.v)
        .write("o", b.o)
        .write("lse", b.lse)
        .write("x_mid", b.x_mid);
  };
  parts.push_back(std::move(attn));

  if (!b.moe) {
    Part mlp{"mlp", "mlp", nullptr, nullptr};
    mlp.run = [this, &b, out, M, C, W, eps](cudaStream_t s) {
      const Plans& p = *plans_;
      rmsnorm_forward(ptr<bf16>(b.h2), ptr<float>(b.rstd2), ptr<bf16>(b.x_mid), W(b.norm2), M,
                      static_cast<int>(C), eps, s);
      gemm(p.w1.fwd, b.h2.data, W(b.w1), b.a.data, s);
      swiglu_forward(ptr<bf16>(b.s), ptr<bf16>(b.a), M, static_cast<int>(shape_.dense_ffn), s);
      gemm(p.w2.fwd_acc, b.s.data, W(b.w2), out.data, s, b.x_mid.data);
    };
    mlp.args = [&b, out, this] {
      return RegionArgs()
          .read("x_mid", b.x_mid)
          .read("params", params_.weight_range(b.norm2, b.ffn_last()))
          .write("h2", b.h2)
          .write("rstd2", b.rstd2)
          .write("gate_up", b.a)
          .write("act", b.s)
          .write("out", out);
    };
    parts.push_back(std::move(mlp));
    return parts;
  }

  const RouterShape rs{M,           shape_.experts,    shape_.groups, shape_.topk_groups,
                       shape_.topk, shape_.route_scale};
  const AuxLossShape aux{M, shape_.seq, shape_.experts, shape_.topk, shape_.aux_coeff};
  // ep 1: the sort over the local experts (the fold); ep > 1: over the global experts, whose
  // sorted buffer is the all-to-all's send buffer, and the local experts' layout (N Cs rows each).
  const DispatchShape ds = shape_.dispatch_shape();
  const EpLayout el{shape_.ep, shape_.local_experts, shape_.ep > 1 ? shape_.ep_capacity() : 1};
  float* aux_loss = ptr<float>(aux_losses_) + b.moe_index;

  // Router: h2, the fp32 logits, selection and weights, the auxiliary loss, then the load of this
  // step and the bias update (the bias is read by nothing else in the step).
  Part router{"router", "moe_router", nullptr, nullptr};
  router.run = [this, &b, rs, aux, aux_loss, M, C, W, eps](cudaStream_t s) {
    const Plans& p = *plans_;
    rmsnorm_forward(ptr<bf16>(b.h2), ptr<float>(b.rstd2), ptr<bf16>(b.x_mid), W(b.norm2), M,
                    static_cast<int>(C), eps, s);
    gemm(p.router.fwd, b.h2.data, W(b.router), b.logits.data, s);
    router_forward(ptr<int32_t>(b.indices), ptr<float>(b.weights), ptr<float>(b.logits),
                   ptr<float>(b.bias), rs, s);
    router_aux_loss_forward(aux_loss, ptr<float>(b.logits), ptr<int32_t>(b.indices), aux,
                            b.aux_ws.data, b.aux_ws.bytes(), s);
    moe_count_experts(ptr<int32_t>(b.load), ptr<int32_t>(b.indices), M, shape_.topk, shape_.experts,
                      false, s);
    // Expert parallelism: the load of every rank's tokens (integers: exact), so every rank moves
    // its biases alike.
    if (ep_comm_ != nullptr)
      ep_comm_->all_reduce(b.load.data, b.load.data, static_cast<size_t>(shape_.experts), ncclInt32,
                           ncclSum, s);
    router_bias_update(ptr<float>(b.bias), ptr<int32_t>(b.load), shape_.experts, shape_.bias_rate,
                       false, s);
  };
  router.args = [this, &b, aux_loss] {
    return RegionArgs()
        .read("x_mid", b.x_mid)
        .read("params", params_.weight_range(b.norm2, b.router))
        .write("h2", b.h2)
        .write("rstd2", b.rstd2)
        .write("logits", b.logits)
        .write("indices", b.indices)
        .write("weights", b.weights)
        .write("aux_ws", b.aux_ws)
        .write("aux_loss", TensorView(aux_loss, DType::kFP32, {1}))
        .write("load", b.load)
        .read_write("bias", b.bias);
  };
  parts.push_back(std::move(router));

  // Preprocess: the fold onto the local experts, the counting sort and the gather.
  // Expert parallelism: the sort over the global experts fills the send buffer (rank d's
  // experts' rows as one block), the counts and the rows go to their ranks in two all-to-alls of
  // fixed size, and the received rows are reordered into the local experts' layout, rows past
  // their source's count zeroed.
  Part pre{"preprocess", "moe_preprocess", nullptr, nullptr};
  pre.run = [this, &b, ds, el, M, C](cudaStream_t s) {
    const bool ep = ep_comm_ != nullptr;
    if (!ep)
      moe_fold_indices(ptr<int32_t>(b.local_idx), ptr<int32_t>(b.indices), M * shape_.topk,
                       shape_.local_experts, s);
    const DispatchIndex di{ptr<int32_t>(b.routed),     ptr<int32_t>(b.kept),
                           ptr<int32_t>(b.offsets),    ptr<int32_t>(b.slot_row),
                           ptr<int32_t>(b.row_source), ptr<int32_t>(b.dropped)};
    moe_dispatch_index(di, ptr<int32_t>(ep ? b.indices : b.local_idx), ds, dispatch_ws_.data,
                       dispatch_ws_.bytes(), s);
    moe_gather(ptr<bf16>(ep ? ep_a_ : b.x_sorted), ptr<bf16>(b.h2), ptr<int32_t>(b.slot_row),
               ptr<int32_t>(b.row_source), ds, C, s);
    if (!ep) return;
    ep_comm_->all_to_all(b.kept.data, b.recv_counts.data, static_cast<size_t>(shape_.local_experts),
                         ncclInt32, s);
    ep_comm_->all_to_all(ep_a_.data, ep_b_.data,
                         static_cast<size_t>(shape_.local_experts * el.capacity * C), ncclBfloat16,
                         s);
    moe_ep_permute(ptr<bf16>(b.x_sorted), ptr<bf16>(ep_b_), ptr<int32_t>(b.recv_counts), el, C,
                   true, s);
  };
  pre.args = [this, &b] {
    RegionArgs a;
    a.read("indices", b.indices)
        .read("h2", b.h2)
        .write("local_indices", b.local_idx)
        .write("routed", b.routed)
        .write("kept", b.kept)
        .write("offsets", b.offsets)
        .write("slot_row", b.slot_row)
        .write("row_source", b.row_source)
        .write("dropped", b.dropped)
        .write("x_sorted", b.x_sorted);
    if (ep_comm_ != nullptr)
      a.write("received", b.recv_counts).write("ep.send", ep_a_).write("ep.recv", ep_b_);
    return a;
  };
  parts.push_back(std::move(pre));

  // Experts: the routed experts over the capacity layout, the shared expert, the combine.
  Part experts{"experts", "moe_experts", nullptr, nullptr};
  experts.run = [this, &b, out, ds, el, M, C, W](cudaStream_t s) {
    const Plans& p = *plans_;
    const bool ep = ep_comm_ != nullptr;
    const int64_t rows = ds.rows();
    gemm(p.ew1.fwd, b.x_sorted.data, W(b.ew1), b.up.data, s);
    swiglu_forward(ptr<bf16>(b.act), ptr<bf16>(b.up), rows, static_cast<int>(shape_.expert_ffn), s);
    // ep > 1: the outputs back to the ranks their tokens came from (into the send layout).
    gemm(p.ew2.fwd, b.act.data, W(b.ew2), ep ? ep_a_.data : b.y_sorted.data, s);
    if (ep) {
      moe_ep_permute(ptr<bf16>(ep_b_), ptr<bf16>(ep_a_), ptr<int32_t>(b.recv_counts), el, C, false,
                     s);
      ep_comm_->all_to_all(ep_b_.data, b.y_sorted.data,
                           static_cast<size_t>(shape_.local_experts * el.capacity * C),
                           ncclBfloat16, s);
    }
    gemm(p.sw1.fwd, b.h2.data, W(b.sw1), b.a.data, s);
    swiglu_forward(ptr<bf16>(b.s), ptr<bf16>(b.a), M, static_cast<int>(shape_.shared_ffn), s);
    gemm(p.sw2.fwd_acc, b.s.data, W(b.sw2), out.data, s, b.x_mid.data);  // x_mid + shared
    moe_combine(ptr<bf16>(out), ptr<bf16>(b.y_sorted), ptr<float>(b.weights),
                ptr<int32_t>(b.slot_row), ds, C, true, s);
  };
  experts.args = [&b, this, out] {
    RegionArgs a;
    a.read("x_mid", b.x_mid)
        .read("h2", b.h2)
        .read("weights", b.weights)
        .read("slot_row", b.slot_row)
        .read("x_sorted", b.x_sorted)
        .read("params", params_.weight_range(b.ew1, b.sw2))
        .write("gate_up", b.up)
        .write("act", b.act)
        .write("y_sorted", b.y_sorted)
        .write("shared.gate_up", b.a)
        .write("shared.act", b.s)
        .write("out", out);
    if (ep_comm_ != nullptr)
      a.read("received", b.recv_counts).write("ep.out", ep_a_).write("ep.send", ep_b_);
    return a;
  };
  parts.push_back(std::move(experts));
  return parts;
}

std::vector<MoeModel::Part> MoeModel::backward_parts(int l) {
  Block& b = *blocks_[static_cast<size_t>(l)];
  const int64_t M = shape_.tokens(), C = shape_.hidden;
  const TensorView x = x_[static_cast<size_t>(l)];
  auto W = [this](ParamId id) { return params_.weight<bf16>(id); };
  auto dW = [this](ParamId id) { return params_.grad(id); };
  std::vector<Part> parts;

  if (b.moe) {
    const RouterShape rs{M,           shape_.experts,    shape_.groups, shape_.topk_groups,
                         shape_.topk, shape_.route_scale};
    const AuxLossShape aux{M, shape_.seq, shape_.experts, shape_.topk, shape_.aux_coeff};
    const DispatchShape ds = shape_.dispatch_shape();
    const EpLayout el{shape_.ep, shape_.local_experts, shape_.ep > 1 ? shape_.ep_capacity() : 1};
    // Experts: the combine's backward (dweights too), the routed experts' and the shared
    // expert's backward; dh = the shared expert's input gradient (written). Expert parallelism:
    // the mirror of the forward: the outputs' gradients go to the experts' ranks, the inputs'
    // gradients come back (into ep_b_, in the send layout, for the gather's backward).
    Part experts{"experts", "moe_experts", nullptr, nullptr};
    experts.run = [this, &b, ds, el, M, C, W, dW](cudaStream_t s) {
      const Plans& p = *plans_;
      const bool ep = ep_comm_ != nullptr;
      const int64_t rows = ds.rows();
      const auto block = static_cast<size_t>(shape_.local_experts * el.capacity * C);
      moe_combine_backward(ptr<bf16>(ep ? ep_a_ : dy_sorted_), ptr<float>(dweights_),
                           ptr<bf16>(grad_), ptr<bf16>(b.y_sorted), ptr<float>(b.weights),
                           ptr<int32_t>(b.slot_row), ptr<int32_t>(b.row_source), ds, C, s);
      if (ep) {
        ep_comm_->all_to_all(ep_a_.data, ep_b_.data, block, ncclBfloat16, s);
        moe_ep_permute(ptr<bf16>(dy_sorted_), ptr<bf16>(ep_b_), ptr<int32_t>(b.recv_counts), el, C,
                       true, s);
      }
      gemm(p.ew2.dgrad, dy_sorted_.data, W(b.ew2), d_act_.data, s);
      gemm(p.ew2.wgrad, dy_sorted_.data, b.act.data, dW(b.ew2), s);
      swiglu_backward(ptr<bf16>(d_up_), ptr<bf16>(d_act_), ptr<bf16>(b.up), rows,
                      static_cast<int>(shape_.expert_ffn), s);
      gemm(p.ew1.dgrad, d_up_.data, W(b.ew1), dx_sorted_.data, s);
      gemm(p.ew1.wgrad, d_up_.data, b.x_sorted.data, dW(b.ew1), s);
      if (ep) {
        moe_ep_permute(ptr<bf16>(ep_a_), ptr<bf16>(dx_sorted_), ptr<int32_t>(b.recv_counts), el, C,
                       false, s);
        ep_comm_->all_to_all(ep_a_.data, ep_b_.data, block, ncclBfloat16, s);
      }
      gemm(p.sw2.dgrad, grad_.data, W(b.sw2), d_s_.data, s);
      gemm(p.sw2.wgrad, grad_.data, b.s.data, dW(b.sw2), s);
      swiglu_backward(ptr<bf16>(d_a_), ptr<bf16>(d_s_), ptr<bf16>(b.a), M,
                      static_cast<int>(shape_.shared_ffn), s);
      gemm(p.sw1.dgrad, d_a_.data, W(b.sw1), dh_.data, s);
      gemm(p.sw1.wgrad, d_a_.data, b.h2.data, dW(b.sw1), s);
    };
    experts.args = [this, &b] {
      return RegionArgs()
          .read("residual_grad", grad_)
          .read("h2", b.h2)
          .read("weights", b.weights)
          .read("slot_row", b.slot_row)
          .read("row_source", b.row_source)
          .read("x_sorted", b.x_sorted)
          .read("gate_up", b.up)
          .read("act", b.act)
          .read("y_sorted", b.y_sorted)
          .read("shared.gate_up", b.a)
          .read("shared.act", b.s)
          .read("params", params_.weight_range(b.ew1, b.sw2))
          .write("dy_sorted", dy_sorted_)
          .write("dweights", dweights_)
          .write("d_act", d_act_)
          .write("d_gate_up", d_up_)
          .write("dx_sorted", dx_sorted_)
          .write("shared.d_act", d_s_)
          .write("shared.d_gate_up", d_a_)
          .write("dh2", dh_)
          .write("grads", params_.grad_range(b.ew1, b.sw2));
    };
    if (shape_.ep > 1) {
      experts.args = [this, &b, inner = std::move(experts.args)] {
        RegionArgs a = inner();
        a.read("received", b.recv_counts).write("ep.send", ep_a_).write("ep.recv", ep_b_);
        return a;
      };
    }
    parts.push_back(std::move(experts));

    // Preprocess: the gather's backward adds the routed rows' gradients into dh.
    Part pre{"preprocess", "moe_preprocess", nullptr, nullptr};
    pre.run = [this, &b, ds, C](cudaStream_t s) {
      const TensorView& dx = ep_comm_ != nullptr ? ep_b_ : dx_sorted_;  // ep: what came back
      moe_gather_backward(ptr<bf16>(dh_), ptr<bf16>(dx), ptr<int32_t>(b.slot_row), ds, C, true, s);
    };
    pre.args = [this, &b] {
      return RegionArgs()
          .read("dx_sorted", ep_comm_ != nullptr ? ep_b_ : dx_sorted_)
          .read("slot_row", b.slot_row)
          .read_write("dh2", dh_);
    };
    parts.push_back(std::move(pre));

    // Router: the logits' gradient from the weights and the auxiliary loss, the router GEMM's
    // backward (adding into dh), then the norm's backward into the residual gradient.
    Part router{"router", "moe_router", nullptr, nullptr};
    router.run = [this, &b, rs, aux, M, C, W, dW](cudaStream_t s) {
      const Plans& p = *plans_;
      router_backward(ptr<float>(dlogits_), ptr<float>(dweights_), ptr<float>(b.logits),
                      ptr<int32_t>(b.indices), rs, false, s);
      router_aux_loss_backward(ptr<float>(dlogits_), backward_scale(), ptr<float>(b.logits), aux,
                               true, b.aux_ws.data, b.aux_ws.bytes(), s);
      moe_to_bf16(ptr<bf16>(dlogits_bf_), ptr<float>(dlogits_), M * shape_.experts, s);
      gemm(p.router.dgrad_acc, dlogits_bf_.data, W(b.router), dh_.data, s);
      gemm(p.router.wgrad, dlogits_bf_.data, b.h2.data, dW(b.router), s);
      rmsnorm_backward(ptr<bf16>(grad_), dW(b.norm2), ptr<bf16>(dh_), ptr<bf16>(b.x_mid),
                       W(b.norm2), ptr<float>(b.rstd2), M, static_cast<int>(C), true, false,
                       norm_ws_.data, norm_ws_.bytes(), s);
    };
    router.args = [this, &b] {
      return RegionArgs()
          .read("dweights", dweights_)
          .read("logits", b.logits)
          .read("indices", b.indices)
          .read("aux_ws", b.aux_ws)
          .read("h2", b.h2)
          .read("x_mid", b.x_mid)
          .read("rstd2", b.rstd2)
          .read("loss_scale", TensorView(const_cast<float*>(backward_scale()), DType::kFP32, {1}))
          .read("params", params_.weight_range(b.norm2, b.router))
          .write("dlogits", dlogits_)
          .write("dlogits_bf16", dlogits_bf_)
          .read_write("dh2", dh_)
          .read_write("residual_grad", grad_)
          .write("grads", params_.grad_range(b.norm2, b.router));
    };
    parts.push_back(std::move(router));
  } else {
    Part mlp{"mlp", "mlp", nullptr, nullptr};
    mlp.run = [this, &b, M, C, W, dW](cudaStream_t s) {
      const Plans& p = *plans_;
      gemm(p.w2.dgrad, grad_.data, W(b.w2), d_s_.data, s);
      gemm(p.w2.wgrad, grad_.data, b.s.data, dW(b.w2), s);
      swiglu_backward(ptr<bf16>(d_a_), ptr<bf16>(d_s_), ptr<bf16>(b.a), M,
                      static_cast<int>(shape_.dense_ffn), s);
      gemm(p.w1.dgrad, d_a_.data, W(b.w1), dh_.data, s);
      gemm(p.w1.wgrad, d_a_.data, b.h2.data, dW(b.w1), s);
      rmsnorm_backward(ptr<bf16>(grad_), dW(b.norm2), ptr<bf16>(dh_), ptr<bf16>(b.x_mid),
                       W(b.norm2), ptr<float>(b.rstd2), M, static_cast<int>(C), true, false,
                       norm_ws_.data, norm_ws_.bytes(), s);
    };
    mlp.args = [this, &b] {
      return RegionArgs()
          .read("h2", b.h2)
          .read("x_mid", b.x_mid)
          .read("rstd2", b.rstd2)
          .read("gate_up", b.a)
          .read("act", b.s)
          .read("params", params_.weight_range(b.norm2, b.w2))
          .write("d_act", d_s_)
          .write("d_gate_up", d_a_)
          .write("dh2", dh_)
          .read_write("residual_grad", grad_)
          .write("grads", params_.grad_range(b.norm2, b.w2));
    };
    parts.push_back(std::move(mlp));
  }

  Part attn{"attn", "attn", nullptr, nullptr};
  attn.run = [this, &b, x, M, C, W, dW](cudaStream_t s) {
    const Plans& p = *plans_;
    const int64_t H = shape_.heads, QK = shape_.qk_dim();
    gemm(p.wo.dgrad, grad_.data, W(b.wo), d_o_.data, s);
    gemm(p.wo.wgrad, grad_.data, b.o.data, dW(b.wo), s);
    const AttentionIO io{b.q.data, b.k.data, b.v.data, b.o.data, ptr<float>(b.lse)};
    const AttentionGrads g{d_o_.data, dq_.data, dk_.data, dv_.data};
    attention_->backward(ctx_, s, io, g, RngArgs{}, attention_ws_.data, attention_ws_.bytes());
    const auto* table = static_cast<const float2*>(rope_q_table_.data);
    const int positions = static_cast<int>(shape_.seq);
    RopeLayout ql{shape_.micro_batch,
                  shape_.seq,
                  static_cast<int>(H),
                  static_cast<int>(QK),
                  static_cast<int>(shape_.rope_dim),
                  static_cast<int>(shape_.nope_dim),
                  0};
    rope_backward(ptr<bf16>(dq_), ptr<bf16>(dq_), table, positions, nullptr, ql, s);
    const MlaDims d{M, static_cast<int>(H), static_cast<int>(shape_.nope_dim),
                    static_cast<int>(shape_.rope_dim), static_cast<int>(shape_.v_dim)};
    mla_assemble_kv_backward(ptr<bf16>(dkvb_), ptr<bf16>(dkpe_), ptr<bf16>(dk_), ptr<bf16>(dv_), d,
                             s);
    RopeLayout kl{shape_.micro_batch,
                  shape_.seq,
                  1,
                  static_cast<int>(shape_.rope_dim),
                  static_cast<int>(shape_.rope_dim),
                  0,
                  0};
    rope_backward(ptr<bf16>(dkpe_), ptr<bf16>(dkpe_), table, positions, nullptr, kl, s);
    gemm(p.kvb.dgrad, dkvb_.data, W(b.kvb), d_kv_latn_.data, s);
    gemm(p.kvb.wgrad, dkvb_.data, b.kv_latn.data, dW(b.kvb), s);
    rmsnorm_backward(ptr<bf16>(d_kv_lat_), dW(b.kvnorm), ptr<bf16>(d_kv_latn_), ptr<bf16>(b.kv_lat),
                     W(b.kvnorm), ptr<float>(b.kv_rstd), M, static_cast<int>(shape_.kv_lora), false,
                     false, norm_ws_.data, norm_ws_.bytes(), s);
    gemm(p.kva.dgrad, d_kv_lat_.data, W(b.kva), dh_.data, s);
    gemm(p.kva.wgrad, d_kv_lat_.data, b.h1.data, dW(b.kva), s);
    gemm(p.kpe.dgrad_acc, dkpe_.data, W(b.kpe), dh_.data, s);
    gemm(p.kpe.wgrad, dkpe_.data, b.h1.data, dW(b.kpe), s);
    gemm(p.qb.dgrad, dq_.data, W(b.qb), d_q_latn_.data, s);
    gemm(p.qb.wgrad, dq_.data, b.q_latn.data, dW(b.qb), s);
    rmsnorm_backward(ptr<bf16>(d_q_lat_), dW(b.qnorm), ptr<bf16>(d_q_latn_), ptr<bf16>(b.q_lat),
                     W(b.qnorm), ptr<float>(b.q_rstd), M, static_cast<int>(shape_.q_lora), false,
                     false, norm_ws_.data, norm_ws_.bytes(), s);
    gemm(p.qa.dgrad_acc, d_q_lat_.data, W(b.qa), dh_.data, s);
    gemm(p.qa.wgrad, d_q_lat_.data, b.h1.data, dW(b.qa), s);
    rmsnorm_backward(ptr<bf16>(grad_), dW(b.norm1), ptr<bf16>(dh_), ptr<bf16>(x), W(b.norm1),
                     ptr<float>(b.rstd1), M, static_cast<int>(C), true, false, norm_ws_.data,
                     norm_ws_.bytes(), s);
  };
  attn.args = [this, &b, x] {
    return RegionArgs()
        .read("x", x)
        .read("h1", b.h1)
        .read("rstd1", b.rstd1)
        .read("q_lat", b.q_lat)
        .read("q_rstd", b.q_rstd)
        .read("q_latn", b.q_latn)
        .read("q", b.q)
        .read("kv_lat", b.kv_lat)
        .read("kv_rstd", b.kv_rstd)
        .read("kv_latn", b.kv_latn)
        .read("k", b.k)
        .read("v", b.v)
        .read("o", b.o)
        .read("lse", b.lse)
        .read("rope.table", rope_q_table_)
        .read("params", params_.weight_range(b.norm1, b.attn_last()))
        .write("d_o", d_o_)
        .write("dq", dq_)
        .write("dk", dk_)
        .write("dv", dv_)
        .write("dkv_b", dkvb_)
        .write("dk_rope", dkpe_)
        .write("d_kv_latn", d_kv_latn_)
        .write("d_kv_lat", d_kv_lat_)
        .write("d_q_latn", d_q_latn_)
        .write("d_q_lat", d_q_lat_)
        .write("dh1", dh_)
        .read_write("residual_grad", grad_)
        .write("grads", params_.grad_range(b.norm1, b.attn_last()));
  };
  parts.push_back(std::move(attn));
  return parts;
}

// ---- Embedding and head
// ---------------------------------------------------------------------------

void MoeModel::embedding_forward(cudaStream_t s) const {
  replay::embedding_forward(
      ptr<bf16>(x_[0]), ptr<int32_t>(tokens_), params_.weight<bf16>(wte_), nullptr,
      EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden, 0, shape_.vocab}, s);
}

void MoeModel::embedding_backward(cudaStream_t s) const {
  replay::embedding_backward(
      params_.grad(wte_), nullptr, ptr<bf16>(grad_), ptr<int32_t>(tokens_),
      EmbeddingShape{shape_.micro_batch, shape_.seq, shape_.hidden, 0, shape_.vocab}, false,
      embedding_ws_.data, embedding_ws_.bytes(), s);
}

const float* MoeModel::backward_scale() const {
  return ep_comm_ != nullptr ? ptr<float>(ep_scale_) : io_.loss_scale;
}

void MoeModel::reduce_replicated_grads(cudaStream_t s) const {
  std::vector<std::pair<void*, size_t>> buffers;
  for (const auto& [first, last] : replicated_) {
    const TensorView g = params_.grad_range(first, last);
    buffers.emplace_back(g.data, static_cast<size_t>(g.numel()));
  }
  ep_comm_->all_reduce_group(buffers, ncclFloat32, ncclSum, s);
}

// The loss (the head's plus every MoE block's auxiliary loss) and the residual gradient of the
// last block's output. Expert parallelism: the step's loss is the mean of the ranks' (all-reduced,
// so every rank reports it), and the backward starts from the loss scale / ep (backward_scale).
void MoeModel::head(cudaStream_t s) const {
  const int64_t M = shape_.tokens(), C = shape_.hidden;
  const TensorView& y = x_.back();
  if (ep_comm_ != nullptr)
    moe_scale_scalar(ptr<float>(ep_scale_), io_.loss_scale, 1.0f / static_cast<float>(shape_.ep),
                     s);
  auto finish_loss = [&] {
    moe_add_terms(io_.loss, ptr<float>(aux_losses_), static_cast<int>(shape_.moe_layers), s);
    if (ep_comm_ != nullptr) ep_comm_->all_reduce(io_.loss, io_.loss, 1, ncclFloat32, ncclAvg, s);
  };
  if (shape_.head == HeadKind::kPipelineStage) {
    stage_head_forward(io_.loss, ptr<float>(stage_partials_), ptr<bf16>(y), ptr<bf16>(stage_grad_),
                       M * C, s);
    finish_loss();
    stage_head_backward(ptr<bf16>(grad_), ptr<bf16>(stage_grad_), backward_scale(), M * C, s);
    return;
  }
  const Plans& p = *plans_;
  const CrossEntropyShape ce{M, shape_.vocab, 0};
  rmsnorm_forward(ptr<bf16>(hf_), ptr<float>(lnf_rstd_), ptr<bf16>(y), params_.weight<bf16>(lnf_),
                  M, static_cast<int>(C), shape_.norm_eps, s);
  gemm(p.head.fwd, hf_.data, params_.weight<bf16>(lm_head_), logits_.data, s);
  cross_entropy_forward(ptr<float>(ce_stats_), ptr<float>(row_loss_), io_.loss,
                        ptr<int32_t>(count_), ptr<bf16>(logits_), ptr<int32_t>(targets_), ce, s);
  finish_loss();
  cross_entropy_backward(ptr<bf16>(logits_), ptr<bf16>(logits_), ptr<float>(ce_stats_),
                         ptr<int32_t>(targets_), ptr<int32_t>(count_), backward_scale(), ce, s);
  gemm(p.head.dgrad, logits_.data, params_.weight<bf16>(lm_head_), d_hf_.data, s);
  gemm(p.head.wgrad, logits_.data, hf_.data, params_.grad(lm_head_), s);
  rmsnorm_backward(ptr<bf16>(grad_), params_.grad(lnf_), ptr<bf16>(d_hf_), ptr<bf16>(y),
                   params_.weight<bf16>(lnf_), ptr<float>(lnf_rstd_), M, static_cast<int>(C), false,
                   false, norm_ws_.data, norm_ws_.bytes(), s);
}

// ---- Regions
// --------------------------------------------------------------------------------------

std::vector<graphs::Region> MoeModel::regions() {
  std::vector<graphs::Region> out;
  const bool lm = shape_.head == HeadKind::kLmHead;
  if (lm) {
    graphs::Region r;
    r.name = "embedding";
    r.enqueue = [this](cudaStream_t s, const RegionArgs&) { embedding_forward(s); };
    r.args = [this] {
      return RegionArgs()
          .read("tokens", tokens_)
          .read("embedding", params_.weight_range(wte_, wte_))
          .write("x0", x_[0]);
    };
    out.push_back(std::move(r));
  }
  // A block direction as one region, or (graph scopes) as one region per part.
  auto emit = [&](int l, std::vector<Part> parts, bool forward) {
    const std::string prefix = "layer" + std::to_string(l);
    const auto kind =
        forward ? graphs::RegionKind::kForwardLayer : graphs::RegionKind::kBackwardLayer;
    const char* dir = forward ? ".fwd" : ".bwd";
    if (scopes_.empty()) {
      auto shared = std::make_shared<std::vector<Part>>(std::move(parts));
      graphs::Region r;
      r.name = prefix + dir;
      r.kind = kind;
      r.enqueue = [shared](cudaStream_t s, const RegionArgs&) {
        for (const Part& part : *shared) part.run(s);
      };
      r.args = [shared] {
        RegionArgs all;
        for (const Part& part : *shared) {
          const RegionArgs args = part.args();
          for (const graphs::RegionArg& a : args.list())
            all.add(part.name + "." + a.name, a.view, a.access);
        }
        return all;
      };
      out.push_back(std::move(r));
      return;
    }
    for (Part& part : parts) {
      graphs::Region r;
      r.name = prefix + "." + part.name + dir;
      r.kind = kind;
      r.scope = part.scope;
      r.graphable = std::find(scopes_.begin(), scopes_.end(), part.scope) != scopes_.end();
      r.enqueue = [run = std::move(part.run)](cudaStream_t s, const RegionArgs&) { run(s); };
      r.args = std::move(part.args);
      out.push_back(std::move(r));
    }
  };
  const int L = static_cast<int>(shape_.layers());
  for (int l = 0; l < L; ++l) emit(l, forward_parts(l), true);
  graphs::Region h;
  h.name = "head";
  h.enqueue = [this](cudaStream_t s, const RegionArgs&) { head(s); };
  h.args = [this, lm] {
    RegionArgs a;
    a.read("y", x_.back())
        .read("aux_losses", aux_losses_)
        .read("loss_scale", TensorView(const_cast<float*>(io_.loss_scale), DType::kFP32, {1}))
        .write("loss", TensorView(io_.loss, DType::kFP32, {1}))
        .write("residual_grad", grad_);
    if (ep_comm_ != nullptr) a.write("backward_scale", ep_scale_);
    if (lm) {
      a.read("targets", targets_)
          .read("final_norm", params_.weight_range(lnf_, lm_head_))
          .write("norm.out", hf_)
          .write("norm.rstd", lnf_rstd_)
          .write("logits", logits_)
          .write("ce.stats", ce_stats_)
          .write("ce.row_loss", row_loss_)
          .write("ce.count", count_)
          .write("norm.dout", d_hf_)
          .write("grads", params_.grad_range(lnf_, lm_head_));
    } else {
      a.read("stage_grad", stage_grad_).write("partials", stage_partials_);
    }
    return a;
  };
  out.push_back(std::move(h));
  for (int l = L - 1; l >= 0; --l) emit(l, backward_parts(l), false);
  if (lm) {
    graphs::Region r;
    r.name = "embedding.bwd";
    r.enqueue = [this](cudaStream_t s, const RegionArgs&) { embedding_backward(s); };
    r.args = [this] {
      return RegionArgs()
          .read("tokens", tokens_)
          .read("residual_grad", grad_)
          .write("grads", params_.grad_range(wte_, wte_));
    };
    out.push_back(std::move(r));
  }
  if (ep_comm_ != nullptr) {
    // The replicated parameters' gradients, summed over the expert-parallel group (one NCCL group
    // of all-reduces); the experts' stay on their rank.
    graphs::Region r;
    r.name = "expert_parallel.grads";
    r.enqueue = [this](cudaStream_t s, const RegionArgs&) { reduce_replicated_grads(s); };
    r.args = [this] {
      RegionArgs a;
      for (const auto& [first, last] : replicated_)
        a.read_write("grads." + params_.spec(first).name, params_.grad_range(first, last));
      return a;
    };
    out.push_back(std::move(r));
  }
  return out;
}

// ---- Reading back, cost
// -----------------------------------------------------------------------------

namespace {
template <typename T>
std::vector<T> read_back(const TensorView& v, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  REPLAY_CUDA_CHECK(cudaMemcpy(out.data(), v.data, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}
}  // namespace

std::vector<int32_t> MoeModel::dropped() const {
  std::vector<int32_t> out;
  for (const auto& b : blocks_)
    if (b->moe) out.push_back(read_back<int32_t>(b->dropped, 1)[0]);
  return out;
}

std::vector<int32_t> MoeModel::routed_counts(int moe_block) const {
  for (const auto& b : blocks_)
    if (b->moe && b->moe_index == moe_block) return read_back<int32_t>(b->load, shape_.experts);
  REPLAY_REQUIRE(false, "routed_counts: no MoE block " + std::to_string(moe_block));
  return {};
}

std::vector<float> MoeModel::router_bias(int moe_block) const {
  for (const auto& b : blocks_)
    if (b->moe && b->moe_index == moe_block) return read_back<float>(b->bias, shape_.experts);
  REPLAY_REQUIRE(false, "router_bias: no MoE block " + std::to_string(moe_block));
  return {};
}

std::vector<int32_t> MoeModel::router_indices(int moe_block) const {
  for (const auto& b : blocks_)
    if (b->moe && b->moe_index == moe_block)
      return read_back<int32_t>(b->indices, shape_.tokens() * shape_.topk);
  REPLAY_REQUIRE(false, "router_indices: no MoE block " + std::to_string(moe_block));
  return {};
}

double MoeModel::expert_flops_routed() const {
  const double rows = static_cast<double>(shape_.tokens() * shape_.topk);
  return 3.0 * static_cast<double>(shape_.moe_layers) *
         (expert_gemm_flops(1, shape_.hidden, 2 * shape_.expert_ffn) +
          expert_gemm_flops(1, shape_.expert_ffn, shape_.hidden)) *
         rows;
}

double MoeModel::expert_flops_executed() const {
  const double rows = static_cast<double>(shape_.local_experts * shape_.capacity());
  return 3.0 * static_cast<double>(shape_.moe_layers) *
         (expert_gemm_flops(1, shape_.hidden, 2 * shape_.expert_ffn) +
          expert_gemm_flops(1, shape_.expert_ffn, shape_.hidden)) *
         rows;
}

// Model FLOPs as NVIDIA counts them for DeepSeek-V3: 6 x the active matrix parameters per token
// (attention projections, the dense or shared FFN, the router, top-k routed experts, the LM head)
// plus the attention scores and values (causal: half of S^2), forward and backward (x3).
double MoeModel::flops_per_step() const {
  const double M = static_cast<double>(shape_.tokens()), C = static_cast<double>(shape_.hidden);
  const double H = static_cast<double>(shape_.heads), QK = static_cast<double>(shape_.qk_dim()),
               Dv = static_cast<double>(shape_.v_dim), S = static_cast<double>(shape_.seq);
  const double qr = static_cast<double>(shape_.q_lora), kr = static_cast<double>(shape_.kv_lora);
  const double attn_params = C * qr + qr * H * QK + C * kr +
                             C * static_cast<double>(shape_.rope_dim) +
                             kr * H * (static_cast<double>(shape_.nope_dim) + Dv) + H * Dv * C;
  const double dense_params = 3.0 * C * static_cast<double>(shape_.dense_ffn);
  const double moe_params =
      3.0 * C * static_cast<double>(shape_.shared_ffn) + C * static_cast<double>(shape_.experts) +
      static_cast<double>(shape_.topk) * 3.0 * C * static_cast<double>(shape_.expert_ffn);
  const double L = static_cast<double>(shape_.layers());
  double per_token = L * attn_params + static_cast<double>(shape_.dense_layers) * dense_params +
                     static_cast<double>(shape_.moe_layers) * moe_params;
  if (shape_.head == HeadKind::kLmHead) per_token += C * static_cast<double>(shape_.vocab);
  const double attention = L * 2.0 * S * H * (QK + Dv) / 2.0;  // per token, forward, causal
  return 3.0 * M * (2.0 * per_token + attention);
}

std::string MoeModel::flops_formula() const {
  return "3 * tokens * (2 * active matrix params per token + layers * S * heads * (d_qk + d_v)) "
         "(NVIDIA's DeepSeek-V3 count: top-k routed experts, causal attention)";
}

std::string MoeModel::collectives() const {
  if (shape_.ep > 1)
    return "expert parallel over " + std::to_string(shape_.ep) +
           " ranks: per MoE block the load all-reduced, the counts and the rows exchanged by "
           "NCCL all-to-alls of " +
           std::to_string(shape_.ep_capacity()) +
           " rows per (rank, expert) (dispatch and combine, forward and backward); the loss and "
           "the replicated parameters' gradients all-reduced";
  if (shape_.local_experts == shape_.experts) return "none (ep 1)";
  return "not run (1 process): the expert-parallel all-to-all over " +
         std::to_string(shape_.experts / shape_.local_experts) +
         " ranks is replaced by the fold of the global expert indices onto the local experts";
}

double MoeModel::loss_floor() const {
  // The CE floor is ln 4 (moe_model.cpp's data); the auxiliary losses add to the reported loss.
  return shape_.head == HeadKind::kLmHead ? std::log(static_cast<double>(kNoise)) : NAN;
}

}  // namespace replay::moe

namespace replay::moe {

std::vector<std::pair<std::string, double>> MoeModel::time_parts(cudaStream_t s, int reps) {
  REPLAY_REQUIRE(reps >= 1, "time_parts: reps >= 1");
  std::vector<std::pair<std::string, double>> total;
  auto add_ms = [&](const std::string& key, double ms) {
    for (auto& kv : total)
      if (kv.first == key) {
        kv.second += ms / reps;
        return;
      }
    total.emplace_back(key, ms / reps);
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  REPLAY_CUDA_CHECK(cudaEventCreate(&start));
  REPLAY_CUDA_CHECK(cudaEventCreate(&stop));
  auto timed = [&](const std::string& key, const std::function<void()>& work) {
    REPLAY_CUDA_CHECK(cudaEventRecord(start, s));
    work();
    REPLAY_CUDA_CHECK(cudaEventRecord(stop, s));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    add_ms(key, ms);
  };
  const int L = static_cast<int>(shape_.layers());
  const bool lm = shape_.head == HeadKind::kLmHead;
  std::vector<std::vector<Part>> fwd, bwd;
  for (int l = 0; l < L; ++l) {
    fwd.push_back(forward_parts(l));
    bwd.push_back(backward_parts(l));
  }
  const Plans& p = *plans_;
  for (int rep = 0; rep < reps; ++rep) {
    if (lm) timed("embedding", [&] { embedding_forward(s); });
    for (int l = 0; l < L; ++l) {
      const Block& b = *blocks_[static_cast<size_t>(l)];
      for (const Part& part : fwd[static_cast<size_t>(l)]) {
        timed(part.scope + ".fwd", [&] { part.run(s); });
        if (part.name != "experts") continue;
        timed("expert_gemm.fwd", [&] {
          gemm(p.ew1.fwd, b.x_sorted.data, params_.weight<bf16>(b.ew1), b.up.data, s);
          gemm(p.ew2.fwd, b.act.data, params_.weight<bf16>(b.ew2), b.y_sorted.data, s);
        });
      }
    }
    timed("head", [&] { head(s); });
    for (int l = L - 1; l >= 0; --l) {
      const Block& b = *blocks_[static_cast<size_t>(l)];
      for (const Part& part : bwd[static_cast<size_t>(l)]) {
        timed(part.scope + ".bwd", [&] { part.run(s); });
        if (part.name != "experts") continue;
        timed("expert_gemm.bwd", [&] {
          gemm(p.ew2.dgrad, dy_sorted_.data, params_.weight<bf16>(b.ew2), d_act_.data, s);
          gemm(p.ew2.wgrad, dy_sorted_.data, b.act.data, params_.grad(b.ew2), s);
          gemm(p.ew1.dgrad, d_up_.data, params_.weight<bf16>(b.ew1), dx_sorted_.data, s);
          gemm(p.ew1.wgrad, d_up_.data, b.x_sorted.data, params_.grad(b.ew1), s);
        });
      }
    }
    if (lm) timed("embedding", [&] { embedding_backward(s); });
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return total;
}

}  // namespace replay::moe
