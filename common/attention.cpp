// attention.cpp: AttentionDesc, AttentionPlan and AttentionCache over the cuDNN frontend's SDPA
// graphs (samples/cpp/sdpa/fp16_cached.cpp and fp16_bwd.cpp show the same steps); the frontend's
// plumbing (errors, staged builds, the handle on a stream) is common/cudnn_fe.h's.

// Set-up code and one variant pack per call: -O1 costs nothing measurable and cuts GCC's code
// generation for the frontend's headers by almost half.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif

#include "common/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <tuple>
#include <unordered_map>

#include "common/cudnn_fe.h"

namespace fe = cudnn_frontend;

namespace replay {

namespace detail {
// attention_rng.cu: writes cuDNN's dropout {seed, offset} from a PhiloxSlot, on `stream`.
void launch_attention_dropout_state(const PhiloxSlot* slot, uint64_t op_offset,
                                    uint64_t counters_per_position, int64_t* seed, int64_t* offset,
                                    cudaStream_t stream);
}  // namespace detail

namespace {

// Variant-pack uids; the forward and backward graphs use the same uid for the same tensor.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kSeed, kOffset, kDO, kDQ, kDK, kDV };

// Dropout scratch at the end of the workspace: seed at +0, offset at +16 (each 16-byte aligned, the
// alignment the frontend declares for every tensor).
constexpr size_t kWorkspaceAlign = 256;
constexpr size_t kRngScratchBytes = 32;
constexpr size_t kRngOffsetAt = 16;

size_t round_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

// cuDNN always sees [B, H, S, D]; the strides say where the elements are. Token-major buffers with
// `row` elements between consecutive tokens put heads d apart, tokens row apart, batches s*row
// apart.
std::vector<int64_t> token_major_strides(int64_t s, int64_t d, int64_t row) {
  return {s * row, d, row, 1};
}

fe::graph::Tensor_attributes token_major(const char* name, Uid uid, int64_t b, int64_t h, int64_t s,
                                         int64_t d, int64_t row) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, h, s, d})
      .set_stride(token_major_strides(s, d, row));
}

// Softmax stats: fp32 [B, Hq, Sq, 1], packed (what cuDNN's backward reads before 9.26).
fe::graph::Tensor_attributes& as_stats(fe::graph::Tensor_attributes& t, const AttentionDesc& d) {
  return t.set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({d.batch, d.heads_q, d.seq_q, 1})
      .set_stride({d.heads_q * d.seq_q, d.seq_q, 1, 1});
}

// Graph-wide types: storage in bf16/fp16, softmax and accumulation in fp32.
std::shared_ptr<fe::graph::Graph> new_graph(const AttentionDesc& d) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(cudnn_fe::io_type(d.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The int64 seed and offset cuDNN reads from device memory (written by attention_rng.cu).
std::pair<std::shared_ptr<fe::graph::Tensor_attributes>,
          std::shared_ptr<fe::graph::Tensor_attributes>>
dropout_tensors(fe::graph::Graph& g) {
  auto scalar = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT64));
  };
  return {scalar("seed", kSeed), scalar("offset", kOffset)};
}

std::shared_ptr<fe::graph::Graph> forward_graph(const AttentionDesc& d,
                                                fe::AttentionImplementation_t impl) {
  const int64_t b = d.batch, hq = d.heads_q, hkv = d.heads_kv, sq = d.seq_q, skv = d.kv_len();
  const int64_t dqk = d.head_dim_qk, dv = d.dim_v();
  auto g = new_graph(d);
  auto q = g->tensor(token_major("Q", kQ, b, hq, sq, dqk, d.q_row()));
  auto k = g->tensor(token_major("K", kK, b, hkv, skv, dqk, d.k_row()));
  auto v = g->tensor(token_major("V", kV, b, hkv, skv, dv, d.v_row()));

  auto options = fe::graph::SDPA_attributes()
                     .set_name("sdpa")
                     .set_generate_stats(true)
                     .set_attn_scale(d.softmax_scale())
                     .set_implementation(impl);
  if (d.causal)
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(0);
  if (d.dropout > 0.0f) {
    auto [seed, offset] = dropout_tensors(*g);
    options.set_dropout(d.dropout, seed, offset);
  }

  auto [o, stats] = g->sdpa(q, k, v, options);
  o->set_output(true)
      .set_uid(kO)
      .set_dim({b, hq, sq, dv})
      .set_stride(token_major_strides(sq, dv, hq * dv));
  as_stats(stats->set_output(true), d);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const AttentionDesc& d) {
  const int64_t b = d.batch, hq = d.heads_q, hkv = d.heads_kv, sq = d.seq_q, skv = d.kv_len();
  const int64_t dqk = d.head_dim_qk, dv = d.dim_v();
  auto g = new_graph(d);
  auto q = g->tensor(token_major("Q", kQ, b, hq, sq, dqk, d.q_row()));
  auto k = g->tensor(token_major("K", kK, b, hkv, skv, dqk, d.k_row()));
  auto v = g->tensor(token_major("V", kV, b, hkv, skv, dv, d.v_row()));
  auto o = g->tensor(token_major("O", kO, b, hq, sq, dv, hq * dv));
  auto d_o = g->tensor(token_major("dO", kDO, b, hq, sq, dv, hq * dv));
  fe::graph::Tensor_attributes stats_attributes;
  auto stats = g->tensor(as_stats(stats_attributes.set_name("Stats"), d));

  // Deterministic: no atomic accumulation of dQ, so the backward is bit-reproducible.
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("sdpa_backward")
                     .set_attn_scale(d.softmax_scale())
                     .set_deterministic_algorithm(d.deterministic);
  if (d.causal)
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(0);
  if (d.dropout > 0.0f) {
    auto [seed, offset] = dropout_tensors(*g);
    options.set_dropout(d.dropout, seed, offset);
  }

  auto [dq, dk, dvt] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
  dq->set_output(true)
      .set_uid(kDQ)
      .set_dim({b, hq, sq, dqk})
      .set_stride(token_major_strides(sq, dqk, d.q_row()));
  dk->set_output(true)
      .set_uid(kDK)
      .set_dim({b, hkv, skv, dqk})
      .set_stride(token_major_strides(skv, dqk, d.k_row()));
  dvt->set_output(true)
      .set_uid(kDV)
      .set_dim({b, hkv, skv, dv})
      .set_stride(token_major_strides(skv, dv, d.v_row()));
  return g;
}

[[noreturn]] void throw_unsupported(const char* direction, const AttentionDesc& d,
                                    const std::string& why) {
  throw Error(
      "cuDNN frontend", "not supported",
      std::string("cuDNN cannot run the ") + direction + " of " + d.describe() + ": " + why);
}

void require_aligned(const void* p, const char* name) {
  REPLAY_REQUIRE(p != nullptr, std::string("attention: ") + name + " is null");
  REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 std::string("attention: ") + name + " must be 16-byte aligned");
}

}  // namespace

// -------------------------------------------------------------------------------------------------
// AttentionDesc

float AttentionDesc::softmax_scale() const {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim_qk));
}

int64_t AttentionDesc::q_row() const {
  return layout == AttentionLayout::kFusedQKV ? fused_row() : heads_q * head_dim_qk;
}
int64_t AttentionDesc::k_row() const {
  return layout == AttentionLayout::kFusedQKV ? fused_row() : heads_kv * head_dim_qk;
}
int64_t AttentionDesc::v_row() const {
  return layout == AttentionLayout::kFusedQKV ? fused_row() : heads_kv * dim_v();
}

void AttentionDesc::validate() const {
  const std::string at = " (" + describe() + ")";
  REPLAY_REQUIRE(batch > 0 && heads_q > 0 && heads_kv > 0 && seq_q > 0 && seq_kv >= 0,
                 "attention sizes must be positive" + at);
  REPLAY_REQUIRE(heads_q % heads_kv == 0,
                 "attention heads_q must be a multiple of heads_kv (GQA/MQA)" + at);
  REPLAY_REQUIRE(head_dim_qk > 0 && head_dim_qk % 8 == 0 && head_dim_v >= 0 && dim_v() % 8 == 0,
                 "attention head dims must be positive multiples of 8 (16-byte rows)" + at);
  REPLAY_REQUIRE(std::isfinite(scale) && scale >= 0.0f, "attention scale must be >= 0" + at);
  REPLAY_REQUIRE(dropout >= 0.0f && dropout < 1.0f, "attention dropout must be in [0, 1)" + at);
  REPLAY_REQUIRE(dtype == DType::kBF16 || dtype == DType::kFP16,
                 "attention storage must be bf16 or fp16" + at);
  REPLAY_REQUIRE(layout == AttentionLayout::kSeparate || kv_len() == seq_q,
                 "the fused QKV layout needs seq_kv == seq_q" + at);
}

std::string AttentionDesc::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "attention B=%lld Hq=%lld Hkv=%lld Sq=%lld Skv=%lld Dqk=%lld Dv=%lld%s scale=%g "
                "dropout=%g %s %s%s",
                static_cast<long long>(batch), static_cast<long long>(heads_q),
                static_cast<long long>(heads_kv), static_cast<long long>(seq_q),
                static_cast<long long>(kv_len()), static_cast<long long>(head_dim_qk),
                static_cast<long long>(dim_v()), causal ? " causal" : "",
                static_cast<double>(softmax_scale()), static_cast<double>(dropout),
                layout == AttentionLayout::kFusedQKV ? "fused-qkv" : "separate", dtype_name(dtype),
                deterministic ? "" : " non-deterministic");
  return buf;
}

bool AttentionDesc::operator<(const AttentionDesc& o) const {
  auto key = [](const AttentionDesc& d) {
    return std::make_tuple(d.batch, d.heads_q, d.heads_kv, d.seq_q, d.seq_kv, d.head_dim_qk,
                           d.head_dim_v, d.causal, d.scale, d.dropout, d.layout, d.dtype,
                           d.deterministic);
  };
  return key(*this) < key(o);
}

// -------------------------------------------------------------------------------------------------
// AttentionPlan

struct AttentionPlan::Impl {
  std::shared_ptr<fe::graph::Graph> forward, backward;
  size_t forward_cudnn_bytes = 0, backward_cudnn_bytes = 0;
  std::string forward_engine, backward_engine;
  uint64_t counters_per_position = 0;  // Philox counters reserved per RNG position (attention.h)

  // cuDNN's workspace, then (with dropout) the RNG scratch at the next 256-byte boundary.
  size_t total(size_t cudnn_bytes, bool dropout) const {
    return dropout ? round_up(cudnn_bytes, kWorkspaceAlign) + kRngScratchBytes : cudnn_bytes;
  }
};

AttentionPlan::AttentionPlan(const Context& ctx, const AttentionDesc& desc)
    : desc_(desc), impl_(std::make_unique<Impl>()) {
  cudnnHandle_t handle = ctx.cudnn();

  // The frontend's preferred implementation first (AUTO picks its unified SDPA node where that
  // node's support surface allows), then the composite graph that every cuDNN 9 version can run.
  cudnn_fe::Built fwd = cudnn_fe::build(
      [&] { return forward_graph(desc_, fe::AttentionImplementation_t::AUTO); }, handle);
  if (!fwd.graph) {
    cudnn_fe::Built composite = cudnn_fe::build(
        [&] { return forward_graph(desc_, fe::AttentionImplementation_t::COMPOSITE); }, handle);
    if (!composite.graph)
      throw_unsupported("forward", desc_, fwd.failure + "; composite: " + composite.failure);
    fwd = std::move(composite);
  }
  cudnn_fe::Built bwd = cudnn_fe::build([&] { return backward_graph(desc_); }, handle);
  if (!bwd.graph) throw_unsupported("backward", desc_, bwd.failure);

  impl_->forward = std::move(fwd.graph);
  impl_->backward = std::move(bwd.graph);
  int64_t bytes = 0;
  REPLAY_FE_CHECK(impl_->forward->get_workspace_size(bytes), "attention forward workspace");
  impl_->forward_cudnn_bytes = static_cast<size_t>(bytes);
  REPLAY_FE_CHECK(impl_->backward->get_workspace_size(bytes), "attention backward workspace");
  impl_->backward_cudnn_bytes = static_cast<size_t>(bytes);
  REPLAY_FE_CHECK(impl_->forward->get_plan_name(impl_->forward_engine),
                  "attention forward plan name");
  REPLAY_FE_CHECK(impl_->backward->get_plan_name(impl_->backward_engine),
                  "attention backward plan name");
  const uint64_t weights = static_cast<uint64_t>(desc_.batch * desc_.heads_q) *
                           static_cast<uint64_t>(desc_.seq_q * desc_.kv_len());
  impl_->counters_per_position = round_up(weights, 16);
}

AttentionPlan::~AttentionPlan() = default;

size_t AttentionPlan::forward_workspace_bytes() const {
  return impl_->total(impl_->forward_cudnn_bytes, desc_.dropout > 0.0f);
}
size_t AttentionPlan::backward_workspace_bytes() const {
  return impl_->total(impl_->backward_cudnn_bytes, desc_.dropout > 0.0f);
}
const std::string& AttentionPlan::forward_engine() const {
  return impl_->forward_engine;
}
const std::string& AttentionPlan::backward_engine() const {
  return impl_->backward_engine;
}

namespace {

// Checks the workspace and, with dropout, launches the RNG kernel on `stream` and adds the seed and
// offset pointers (inside the workspace) to the variant pack.
void prepare_call(const AttentionDesc& d, uint64_t counters_per_position, size_t cudnn_bytes,
                  size_t required, RngArgs rng, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream, std::unordered_map<int64_t, void*>& pack) {
  REPLAY_REQUIRE(workspace_bytes >= required,
                 "attention workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                     std::to_string(required) + " needed (" + d.describe() + ")");
  if (required > 0) require_aligned(workspace, "workspace");
  if (d.dropout <= 0.0f) return;
  char* scratch = static_cast<char*>(workspace) + round_up(cudnn_bytes, kWorkspaceAlign);
  auto* seed = reinterpret_cast<int64_t*>(scratch);
  auto* offset = reinterpret_cast<int64_t*>(scratch + kRngOffsetAt);
  detail::launch_attention_dropout_state(rng.slot, rng.op_offset, counters_per_position, seed,
                                         offset, stream);
  pack[kSeed] = seed;
  pack[kOffset] = offset;
}

// The forward's tensors (the backward's inputs), checked for alignment, by graph uid.
std::unordered_map<int64_t, void*> io_pack(const AttentionIO& io) {
  require_aligned(io.q, "q");
  require_aligned(io.k, "k");
  require_aligned(io.v, "v");
  require_aligned(io.o, "o");
  require_aligned(io.stats, "stats");
  return {{kQ, const_cast<void*>(io.q)},
          {kK, const_cast<void*>(io.k)},
          {kV, const_cast<void*>(io.v)},
          {kO, io.o},
          {kStats, io.stats}};
}

}  // namespace

void AttentionPlan::forward(const Context& ctx, cudaStream_t stream, const AttentionIO& io,
                            RngArgs rng, void* workspace, size_t workspace_bytes) const {
  std::unordered_map<int64_t, void*> pack = io_pack(io);
  prepare_call(desc_, impl_->counters_per_position, impl_->forward_cudnn_bytes,
               forward_workspace_bytes(), rng, workspace, workspace_bytes, stream, pack);
  cudnn_fe::execute(*impl_->forward, ctx.cudnn(), stream, pack, workspace,
                    [&] { return "attention forward " + desc_.describe(); });
}

void AttentionPlan::backward(const Context& ctx, cudaStream_t stream, const AttentionIO& io,
                             const AttentionGrads& grads, RngArgs rng, void* workspace,
                             size_t workspace_bytes) const {
  std::unordered_map<int64_t, void*> pack = io_pack(io);
  require_aligned(grads.d_o, "d_o");
  require_aligned(grads.dq, "dq");
  require_aligned(grads.dk, "dk");
  require_aligned(grads.dv, "dv");
  pack[kDO] = const_cast<void*>(grads.d_o);
  pack[kDQ] = grads.dq;
  pack[kDK] = grads.dk;
  pack[kDV] = grads.dv;
  prepare_call(desc_, impl_->counters_per_position, impl_->backward_cudnn_bytes,
               backward_workspace_bytes(), rng, workspace, workspace_bytes, stream, pack);
  cudnn_fe::execute(*impl_->backward, ctx.cudnn(), stream, pack, workspace,
                    [&] { return "attention backward " + desc_.describe(); });
}

// -------------------------------------------------------------------------------------------------
// AttentionCache

AttentionCache::AttentionCache() = default;
AttentionCache::~AttentionCache() = default;

const AttentionPlan& AttentionCache::get(const Context& ctx, const AttentionDesc& desc) {
  desc.validate();  // before the lookup: the key's ordering needs finite scale and dropout
  auto it = plans_.find(desc);
  if (it == plans_.end())
    it = plans_.emplace(desc, std::unique_ptr<AttentionPlan>(new AttentionPlan(ctx, desc))).first;
  return *it->second;
}

size_t AttentionCache::max_workspace_bytes() const {
  size_t bytes = 0;
  for (const auto& [desc, plan] : plans_)
    bytes = std::max({bytes, plan->forward_workspace_bytes(), plan->backward_workspace_bytes()});
  return bytes;
}

}  // namespace replay
