// moe_workload.cpp: replay-moe's presets, flags, configuration, data line, model and MLPerf events.
#include "workloads/moe/moe_workload.h"

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cinttypes>
#include <sstream>

#include "common/bench/harness.h"
#include "common/bench/mllog.h"
#include "common/check.h"

namespace replay::moe {

namespace {

// 671b-ep32: one GPU of the H100 layout TP2 x PP8 x EP32. 61 blocks over 8 pipeline stages is
// about 8 blocks a stage; a middle stage holds MoE blocks only. TP2 gives it 64 of the 128 MLA
// heads and half of the shared expert (1024 of 2048); EP32 gives it 8 of the 256 routed experts.
// The input is the activation the previous stage sends and the loss is taken against the gradient
// the next stage sends (HeadKind::kPipelineStage). With one process the all-to-all is not run: the
// router routes this GPU's 4096 tokens over all 256 experts and the assignments fold onto the 8
// local experts (expert e to local e mod 8), so each local expert receives the assignments of 32
// global experts, 4096 on average (4096 tokens x 8 / 256 x 32): what a rank of EP32 receives from
// the 32 ranks' tokens, with the router's own imbalance.
MoeShape shape_671b_ep32() {
  MoeShape s;
  s.micro_batch = 1, s.seq = 4096, s.hidden = 7168, s.vocab = 0;
  s.head = HeadKind::kPipelineStage;
  s.heads = 64, s.q_lora = 1536, s.kv_lora = 512, s.nope_dim = 128, s.rope_dim = 64;
  s.v_dim = 128;
  s.dense_layers = 0, s.moe_layers = 8, s.dense_ffn = 18432;
  s.experts = 256, s.local_experts = 8, s.groups = 8, s.topk_groups = 4, s.topk = 8;
  s.expert_ffn = 2048, s.shared_ffn = 1024;
  s.capacity_factor = 1.0;
  s.yarn = YarnScaling::deepseek_v3();  // the released config's rope_scaling
  return s;
}

// small: a few hundred million parameters (about 0.3 B) for convergence runs on one GPU.
MoeShape shape_small() {
  MoeShape s;
  s.micro_batch = 4, s.seq = 512, s.hidden = 1024, s.vocab = 8192;
  s.heads = 8, s.q_lora = 384, s.kv_lora = 256, s.nope_dim = 128, s.rope_dim = 64, s.v_dim = 128;
  s.dense_layers = 1, s.moe_layers = 7, s.dense_ffn = 2816;
  s.experts = 32, s.local_experts = 32, s.groups = 8, s.topk_groups = 4, s.topk = 6;
  s.expert_ffn = 384, s.shared_ffn = 384;
  s.capacity_factor = 1.25;
  s.yarn = YarnScaling::deepseek_v3();
  return s;
}

// tiny-ep: 671b-ep32's structure at the tiny preset's sizes (tests): the pipeline-stage head, MoE
// blocks only, 32 experts in 8 groups (keep 4, top-4) folded onto 4 local experts.
MoeShape shape_tiny_ep() {
  MoeShape s;
  s.head = HeadKind::kPipelineStage, s.vocab = 0;
  s.dense_layers = 0, s.moe_layers = 2;
  s.experts = 32, s.local_experts = 4, s.groups = 8, s.topk_groups = 4, s.topk = 4;
  return s;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

const std::vector<std::string>& graph_scope_names() {
  static const std::vector<std::string> names = {"attn", "mlp", "moe_router", "moe_preprocess",
                                                 "moe_experts"};
  return names;
}

MoeWorkload::MoeWorkload()
    : info_{"replay-moe", "moe", "DeepSeek-V3", "tiny", "tokens", "tok", "deepseekv3_671b"},
      presets_{
          {"tiny",
           "2 blocks (1 dense, 1 MoE: 8 experts top-2 in 4 groups), hidden 128, 2 MLA heads "
           "(192/128), 2 x 64 tokens",
           20},
          {"tiny-ep",
           "671b-ep32's structure at tiny sizes: a pipeline-stage head, 2 MoE blocks, 32 "
           "experts (top-4 of 8 groups keep 4) folded onto 4 local experts",
           20},
          {"small",
           "8 blocks (1 dense, 7 MoE: 32 experts top-6), hidden 1024, 8 MLA heads, "
           "4 x 512 tokens, about 0.3 B parameters",
           20},
          {"671b-ep32",
           "one GPU of TP2 x PP8 x EP32: a middle stage's 8 MoE blocks (as many as fit), 64 of "
           "128 heads, 8 of 256 experts receiving a rank's assignments, 4096 tokens",
           10}} {}

void MoeWorkload::add_flags(CLI::App& app) {
  app.add_option("--capacity-factor", capacity_flag_,
                 "rows per local expert = ceil(F * tokens * topk / local experts); tokens over "
                 "capacity are dropped (default: the preset's)")
      ->check(train::number_in(1e-3, 64));
  app.add_flag("--dropless", dropless_,
               "dispatch without drops: buffers sized for the most an expert can receive");
  app.add_option("--graph-scope", scope_flag_,
                 "with --graphs layer: capture only these parts of each block, the others eager "
                 "(comma-separated: attn, mlp, moe_router, moe_preprocess, moe_experts)");
  app.add_option("--ep", ep_flag_,
                 "expert parallelism over N processes (mpiexec -n N): experts / N local experts "
                 "each, the dispatch and combine as NCCL all-to-alls inside the graphs, each rank "
                 "its own micro-batch; --ep 1: every expert on this GPU (the one-GPU reference)")
      ->check(train::integer_in(1, 512));
  app.add_option("--micro-batch", micro_batch_flag_,
                 "sequences per step on this GPU (0: the preset's)")
      ->check(train::integer_in(0, 4096));
  app.add_option("--rope-scaling", rope_scaling_flag_,
                 "RoPE frequency scaling: yarn (DeepSeek-V3's released config: factor 40 over 4096 "
                 "positions, beta 32/1, mscale 1; the softmax scale times mscale^2) or none "
                 "(default: the preset's; yarn for 671b-ep32 and small)")
      ->check(CLI::IsMember({"yarn", "none"}));
  app.add_option("--layers", layers_flag_,
                 "MoE blocks (0: the preset's; 671b-ep32: as many of its 8 as fit the GPU)")
      ->check(train::integer_in(0, 64));
}

void MoeWorkload::resolve(const train::RunFlags& flags) {
  preset_ = flags.preset;
  if (preset_ == "671b-ep32")
    shape_ = shape_671b_ep32();
  else if (preset_ == "tiny-ep")
    shape_ = shape_tiny_ep();
  else if (preset_ == "small")
    shape_ = shape_small();
  else
    shape_ = MoeShape{};
  if (dropless_ && capacity_flag_ >= 0)
    throw bench::UsageError("--dropless and --capacity-factor: choose one");
  if (capacity_flag_ >= 0) shape_.capacity_factor = capacity_flag_;
  if (dropless_) shape_.capacity_factor = 0;
  if (layers_flag_ > 0) shape_.moe_layers = layers_flag_;
  if (rope_scaling_flag_ == "yarn") shape_.yarn = YarnScaling::deepseek_v3();
  if (rope_scaling_flag_ == "none") shape_.yarn = YarnScaling{};
  if (micro_batch_flag_ > 0) shape_.micro_batch = micro_batch_flag_;
  if (ep_flag_ > 0) {
    const std::string n = std::to_string(ep_flag_);
    if (shape_.experts % ep_flag_ != 0)
      throw bench::UsageError("--ep " + n + ": does not divide the " +
                              std::to_string(shape_.experts) + " experts of " + preset_);
    if (dropless_ && ep_flag_ > 1)
      throw bench::UsageError("--ep " + n +
                              " with --dropless: the expert-parallel exchange sends "
                              "capacity-sized buffers; give --capacity-factor (dropless is "
                              "single-process)");
    shape_.ep = ep_flag_;
    shape_.local_experts = shape_.experts / ep_flag_;
  }
  scopes_ = split(scope_flag_);
  if (!scope_flag_.empty() && scopes_.empty())
    throw bench::UsageError("--graph-scope: no scope named in '" + scope_flag_ + "'");
  for (const std::string& s : scopes_) {
    const auto& names = graph_scope_names();
    if (std::find(names.begin(), names.end(), s) == names.end())
      throw bench::UsageError("--graph-scope: '" + s +
                              "' is not a scope (attn, mlp, moe_router, moe_preprocess, "
                              "moe_experts)");
  }
  if (!scopes_.empty() && flags.graphs != "layer")
    throw bench::UsageError("--graph-scope applies to --graphs layer (got --graphs " +
                            flags.graphs + ")");
  try {
    shape_.validate();
  } catch (const Error& e) {
    throw bench::UsageError(std::string("replay-moe: ") + e.what());
  }
}

// Per MoE block: the parameters (18 bytes each: bf16 weight, fp32 master, gradient and two Adam
// moments) and the saved activations (moe_model.cpp's plan).
int64_t MoeWorkload::block_bytes() const {
  const MoeShape& s = shape_;
  const int64_t C = s.hidden, M = s.tokens(), H = s.heads, QK = s.qk_dim(), Dv = s.v_dim;
  const int64_t rows = s.local_experts * s.capacity();
  const int64_t params = s.q_lora * C + H * QK * s.q_lora + s.kv_lora * C + s.rope_dim * C +
                         H * (s.nope_dim + Dv) * s.kv_lora + C * H * Dv + s.experts * C +
                         3 * s.local_experts * s.expert_ffn * C + 3 * s.shared_ffn * C;
  const int64_t acts = 2 * (5 * M * C + 2 * M * (s.q_lora + s.kv_lora) + 2 * M * H * QK +
                            2 * M * H * Dv + 3 * M * s.shared_ffn) +
                       4 * M * (2 * s.experts + 3 * s.topk) + 2 * rows * (2 * C + 3 * s.expert_ffn);
  return 18 * params + acts;
}

// The backward's scratch (the expert buffers dominate), the deterministic attention backward's
// workspace (about B * H * S^2 * 2 bytes), the input and the head, and a margin for the library
// workspaces and the CUDA context.
int64_t MoeWorkload::fixed_bytes() const {
  const MoeShape& s = shape_;
  const int64_t C = s.hidden, M = s.tokens(), H = s.heads;
  const int64_t rows = s.local_experts * s.capacity();
  const int64_t scratch = 2 * rows * (2 * C + 3 * s.expert_ffn) +
                          2 * M * (3 * H * s.qk_dim() + 3 * H * s.v_dim + 4 * C) +
                          4 * M * s.experts * 2;
  const int64_t attention = 4 * s.micro_batch * H * s.seq * s.seq;
  return scratch + attention + 6 * M * C + (int64_t{3} << 30);
}

nlohmann::ordered_json MoeWorkload::config() const {
  const MoeShape& s = shape_;
  nlohmann::ordered_json scopes = nlohmann::ordered_json::array();
  for (const std::string& x : scopes_) scopes.push_back(x);
  nlohmann::ordered_json rope = {{"theta", s.rope_theta}, {"yarn", nullptr}};
  if (s.yarn.enabled)
    rope["yarn"] = {
        {"factor", s.yarn.factor},       {"original_max_position", s.yarn.original_max_position},
        {"beta_fast", s.yarn.beta_fast}, {"beta_slow", s.yarn.beta_slow},
        {"mscale", s.yarn.mscale},       {"mscale_all_dim", s.yarn.mscale_all_dim}};
  return {{"micro_batch", s.micro_batch},
          {"seq", s.seq},
          {"hidden", s.hidden},
          {"vocab", s.vocab},
          {"head", s.head == HeadKind::kLmHead ? "lm" : "pipeline_stage"},
          {"heads", s.heads},
          {"q_lora_rank", s.q_lora},
          {"kv_lora_rank", s.kv_lora},
          {"qk_nope_head_dim", s.nope_dim},
          {"qk_rope_head_dim", s.rope_dim},
          {"v_head_dim", s.v_dim},
          {"norm_eps", s.norm_eps},
          {"rope", rope},
          {"softmax_scale", mla_softmax_scale(s.qk_dim(), s.yarn)},
          {"dense_layers", s.dense_layers},
          {"moe_layers", s.moe_layers},
          {"dense_ffn", s.dense_ffn},
          {"experts", s.experts},
          {"local_experts", s.local_experts},
          {"expert_parallel", s.ep},
          {"groups", s.groups},
          {"topk_groups", s.topk_groups},
          {"topk", s.topk},
          {"expert_ffn", s.expert_ffn},
          {"shared_ffn", s.shared_ffn},
          {"route_scale", s.route_scale},
          {"bias_update_rate", s.bias_rate},
          {"aux_loss_coeff", s.aux_coeff},
          {"dispatch", s.dropless() ? "dropless" : "capacity"},
          {"capacity_factor", s.capacity_factor},
          {"capacity_rows_per_expert", s.capacity()},
          {"expert_gemm",
           "cuBLASLt strided batch over the capacity layout (no grouped GEMM in "
           "cuBLASLt 13.x)"},
          {"graph_scopes", scopes},
          {"layers_note", layers_note_}};
}

train::TrainingConfig MoeWorkload::training() const {
  train::TrainingConfig t;
  t.adam = AdamWHyper{0.9f, 0.95f, 1e-8f, 0.1f};
  t.schedule.kind = train::LrKind::kWarmupCosine;
  if (preset_ == "671b-ep32") {
    // DeepSeek-V3's peak rate and warm-up (2.2e-4 after 2000 steps).
    t.schedule.base_lr = 2.2e-4f;
    t.schedule.min_lr = 2.2e-5f;
    t.schedule.warmup_steps = 2000;
    t.schedule.total_steps = 100000;
    t.schedule_source = "DeepSeek-V3: peak 2.2e-4 after 2000 warm-up steps (cosine here)";
  } else {
    t.schedule.base_lr = 3e-3f;
    t.schedule.min_lr = 3e-4f;
    t.schedule.warmup_steps = 5;
    t.schedule.total_steps = 300;
    t.schedule_source = "replay's small-model schedule (fast learning on synthetic data)";
  }
  t.clip_norm = 1.0f;
  return t;
}

void MoeWorkload::open_data(const train::RunFlags& flags, std::FILE* out) {
  if (!flags.data.empty())
    throw bench::UsageError("--data: replay-moe generates its data; it reads no file");
  if (shape_.head == HeadKind::kLmHead)
    std::fprintf(out,
                 "# data: synthetic tokens, %" PRId64
                 " batches: x' = (5x + 3 + r) mod K over the "
                 "first K = %" PRId64 " of %" PRId64 " ids, r uniform in 0..3 (floor ln 4)\n",
                 shape_.data_batches, std::min<int64_t>(shape_.vocab, 64), shape_.vocab);
  else
    std::fprintf(out,
                 "# data: a pipeline middle stage: the previous stage's activation and the next "
                 "stage's gradient, drawn once from the seed\n");
}

std::unique_ptr<train::Model> MoeWorkload::build(Context& ctx, const train::TrainingConfig&,
                                                 const train::RunFlags& flags, std::FILE* out) {
  if (preset_ == "671b-ep32") {
    // As many of the stage's blocks as the GPU holds (the shard keeps every block's optimizer
    // state: the distributed optimizer of the full layout is not run).
    size_t free_bytes = 0, total_bytes = 0;
    REPLAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const int64_t per = block_bytes(), fixed = fixed_bytes();
    const auto fit = static_cast<int64_t>((static_cast<int64_t>(free_bytes) - fixed) / per);
    const int64_t wanted = shape_.moe_layers;
    REPLAY_REQUIRE(fit >= 1, "671b-ep32: one MoE block needs about " + std::to_string(per >> 20) +
                                 " MiB besides " + std::to_string(fixed >> 20) +
                                 " MiB, and the GPU has " + std::to_string(free_bytes >> 20) +
                                 " MiB free");
    if (layers_flag_ == 0 && fit < wanted) shape_.moe_layers = fit;
    REPLAY_REQUIRE(layers_flag_ == 0 || fit >= wanted,
                   "--layers " + std::to_string(wanted) + ": about " +
                       std::to_string((fixed + wanted * per) >> 30) + " GiB needed, " +
                       std::to_string(free_bytes >> 30) + " GiB free (at most " +
                       std::to_string(fit) + " blocks fit)");
    layers_note_ = std::to_string(shape_.moe_layers) + " of the stage's " +
                   std::to_string(layers_flag_ > 0 ? layers_flag_ : 8) + " blocks (about " +
                   std::to_string(per >> 20) + " MiB each with optimizer state; " +
                   std::to_string(free_bytes >> 30) + " GiB free)";
    std::fprintf(out, "# layers: %s\n", layers_note_.c_str());
  }
  REPLAY_REQUIRE(shape_.ep == 1 || ep_comm_ != nullptr,
                 "replay-moe: --ep " + std::to_string(shape_.ep) + " without its communicator");
  return std::make_unique<MoeModel>(ctx, shape_, flags.seed, scopes_, ep_comm_);
}

void MoeWorkload::set_expert_parallel(int rank, int size, comm::Communicator* comm) {
  REPLAY_REQUIRE(size == shape_.ep && comm != nullptr && comm->size() == size,
                 "replay-moe: an expert-parallel group of " + std::to_string(size) +
                     " ranks for --ep " + std::to_string(shape_.ep));
  shape_.ep_rank = rank;
  ep_comm_ = comm;
}

void MoeWorkload::log_config(bench::MlLogger& log, const train::Model&,
                             const train::TrainingConfig& t) const {
  namespace k = bench::mlkey;
  log.event(k::kGlobalBatchSize, shape_.micro_batch);
  log.event(k::kMaxSequenceLength, shape_.seq);
  log.event(k::kOptName, "adamw");
  log.event(k::kOptBaseLearningRate, static_cast<double>(t.schedule.base_lr));
  log.event(k::kOptLearningRateWarmupSteps, t.schedule.warmup_steps);
  log.event(k::kOptAdamBeta1, static_cast<double>(t.adam.beta1));
  log.event(k::kOptAdamBeta2, static_cast<double>(t.adam.beta2));
}

}  // namespace replay::moe
