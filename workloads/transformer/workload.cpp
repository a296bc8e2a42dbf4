// workload.cpp: the transformer shards as train/ workloads: presets and flags, token data, the
// model's step regions, its cost and its MLPerf events.
#include "workloads/transformer/workload.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cinttypes>
#include <functional>

#include "common/bench/harness.h"
#include "common/bench/mllog.h"
#include "common/check.h"
#include "train/trainer.h"

namespace replay::transformer {

data::MarkovDatasetParams dataset_params(const TransformerShape& shape, int64_t sequences,
                                         int64_t vocab) {
  data::MarkovDatasetParams p;
  p.num_sequences = sequences;
  p.vocab_size = vocab > 0 ? vocab : shape.vocab;
  p.seq_len = shape.seq;
  p.order = 1;
  p.branching = 4;
  return p;
}

train::LrSchedule tiny_schedule() {
  train::LrSchedule s;
  s.kind = train::LrKind::kWarmupCosine;
  s.base_lr = 3e-3f;
  s.min_lr = 3e-4f;
  s.warmup_steps = 20;
  s.total_steps = 400;
  return s;
}

int64_t held_out_rows(int64_t rows, int64_t micro_batch) {
  const int64_t h = std::min<int64_t>(64, rows / 16) / micro_batch * micro_batch;
  return rows - h >= micro_batch ? h : 0;
}

// ---- The model ---------------------------------------------------------------------------------

TransformerModel::TransformerModel(const Context& ctx, const TransformerShape& shape,
                                   int microbatches, std::shared_ptr<PlanCaches> caches,
                                   comm::Communicator* tp)
    : caches_(std::move(caches)),
      transformer_(ctx, shape, microbatches, caches_->gemms, caches_->attention, tp),
      tp_run_(tp != nullptr) {}

void TransformerModel::set_data(data::TokenFile file, uint64_t seed, double loss_floor,
                                int64_t held_out, bool shuffle) {
  const int64_t rows = file.info().num_sequences;
  if (held_out > 0)
    held_out_ = std::make_unique<data::HeldOutRows>(file, rows - held_out, held_out);
  data::StreamOptions options;
  options.shuffle = shuffle;
  options.seed = seed;
  options.num_rows = rows - held_out;
  batches_.emplace(std::move(file), options);
  loss_floor_ = loss_floor;
}

void TransformerModel::plan(ArenaPlan& plan) {
  transformer_.plan(plan);
  eval_id_ = plan.add("eval.loss", DType::kFP32, 8, "eval");
}

void TransformerModel::bind(const Arena& arena) {
  transformer_.bind(arena);
  eval_batch_loss_ = arena.as<float>(eval_id_);
  eval_loss_sum_ = eval_batch_loss_ + 4;
}

void TransformerModel::initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) {
  transformer_.initialize(seed, io.loss, stream);
}

std::vector<graphs::Region> TransformerModel::regions() {
  std::vector<graphs::Region> out;
  Transformer& m = transformer_;
  auto region = [&out](std::string name, graphs::RegionKind kind,
                       std::function<void(cudaStream_t)> work,
                       std::function<graphs::RegionArgs()> args) {
    graphs::Region r;
    r.name = std::move(name);
    r.kind = kind;
    r.enqueue = [work = std::move(work)](cudaStream_t s, const graphs::RegionArgs&) { work(s); };
    r.args = std::move(args);
    out.push_back(std::move(r));
  };
  using graphs::RegionKind;
  const int n = m.microbatches(), L = m.num_layers();
  for (int mb = 0; mb < n; ++mb) {
    const std::string p = n > 1 ? "mb" + std::to_string(mb) + "." : "";
    region(
        p + "embedding.fwd", RegionKind::kOther,
        [&m, mb](cudaStream_t s) { m.embedding_forward(mb, s); },
        [&m, mb] { return m.embedding_forward_args(mb); });
    for (int l = 0; l < L; ++l)
      region(
          p + "layer" + std::to_string(l) + ".fwd", RegionKind::kForwardLayer,
          [&m, mb, l](cudaStream_t s) { m.layer_forward(mb, l, s); },
          [&m, mb, l] { return m.layer_forward_args(mb, l); });
    region(
        p + "head", RegionKind::kOther, [&m, mb](cudaStream_t s) { m.head(mb, s); },
        [&m, mb] { return m.head_args(mb); });
    for (int l = L - 1; l >= 0; --l)
      region(
          p + "layer" + std::to_string(l) + ".bwd", RegionKind::kBackwardLayer,
          [&m, mb, l](cudaStream_t s) { m.layer_backward(mb, l, s); },
          [&m, mb, l] { return m.layer_backward_args(mb, l); });
    region(
        p + "embedding.bwd", RegionKind::kOther,
        [&m, mb](cudaStream_t s) { m.embedding_backward(mb, s); },
        [&m, mb] { return m.embedding_backward_args(mb); });
  }
  return out;
}

int64_t TransformerModel::train_samples() const {
  REPLAY_REQUIRE(batches_.has_value(), "TransformerModel: set_data first");
  return batches_->num_rows();
}

std::optional<train::EvalInfo> TransformerModel::evaluation() const {
  // The forward with dropout is not the model's evaluation (resolve refuses --eval-interval then).
  if (!held_out_ || transformer_.shape().dropout > 0.0f) return std::nullopt;
  train::EvalInfo e;
  e.metric = "loss";  // nats per token: the log perplexity MLPerf's language models report
  e.higher_is_better = false;
  e.samples_per_batch = transformer_.shape().micro_batch;
  e.default_samples = held_out_->count();
  e.available_samples = held_out_->count();
  return e;
}

std::vector<graphs::Region> TransformerModel::eval_regions() {
  std::vector<graphs::Region> out;
  for (graphs::Region& r : regions()) {  // micro-batch 0's forward
    const bool forward = r.kind == graphs::RegionKind::kForwardLayer || r.name == "embedding.fwd" ||
                         r.name == "mb0.embedding.fwd";
    if (!forward || (transformer_.microbatches() > 1 && r.name.rfind("mb0.", 0) != 0)) continue;
    r.name = "eval." + r.name;
    out.push_back(std::move(r));
  }
  graphs::Region head;
  head.name = "eval.head";
  head.enqueue = [this](cudaStream_t s, const graphs::RegionArgs&) {
    transformer_.eval_head(eval_batch_loss_, eval_loss_sum_, s);
  };
  head.args = [this] { return transformer_.eval_head_args(eval_batch_loss_, eval_loss_sum_); };
  out.push_back(std::move(head));
  return out;
}

void TransformerModel::begin_eval(cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaMemsetAsync(eval_loss_sum_, 0, sizeof(float), stream));
  next_eval_ = 0;
  evaluated_ = 0;
}

void TransformerModel::load_eval_batch(cudaStream_t stream) {
  REPLAY_REQUIRE(held_out_ != nullptr, "this model's data has no held-out split");
  const int64_t mb = transformer_.shape().micro_batch;
  held_out_->copy(next_eval_, mb, stream, transformer_.tokens(0), transformer_.targets(0));
  next_eval_ = (next_eval_ + 1) % (held_out_->count() / mb);
  evaluated_ += 1;
}

double TransformerModel::end_eval(cudaStream_t stream) {
  float sum = 0;
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(&sum, eval_loss_sum_, sizeof(float), cudaMemcpyDeviceToHost, stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  return evaluated_ > 0 ? static_cast<double>(sum) / static_cast<double>(evaluated_) : NAN;
}

int TransformerModel::load_batch(cudaStream_t stream) {
  REPLAY_REQUIRE(batches_.has_value(), "TransformerModel: set_data before load_batch");
  for (int mb = 0; mb < transformer_.microbatches(); ++mb)
    batches_->next(stream, transformer_.tokens(mb), transformer_.targets(mb));
  return 0;
}

int64_t TransformerModel::data_position() const {
  REPLAY_REQUIRE(batches_.has_value(), "TransformerModel: set_data before data_position");
  return batches_->position();
}

void TransformerModel::seek_data(int64_t position) {
  REPLAY_REQUIRE(batches_.has_value(), "TransformerModel: set_data before seek_data");
  batches_->seek(position);
}

bool TransformerModel::shard_data(int rank, int count) {
  REPLAY_REQUIRE(batches_.has_value(), "TransformerModel: set_data before shard_data");
  batches_->shard(count, rank);
  return true;
}

std::vector<train::Model::NamedTensor> TransformerModel::batch_tensors() const {
  const TransformerShape& s = transformer_.shape();
  std::vector<NamedTensor> out;
  for (int mb = 0; mb < transformer_.microbatches(); ++mb) {
    out.push_back({"tokens." + std::to_string(mb),
                   TensorView(transformer_.tokens(mb), DType::kINT32, {s.micro_batch, s.seq})});
    out.push_back({"targets." + std::to_string(mb),
                   TensorView(transformer_.targets(mb), DType::kINT32, {s.micro_batch, s.seq})});
  }
  return out;
}

double TransformerModel::units_per_step() const {
  return static_cast<double>(transformer_.shape().tokens() * transformer_.microbatches());
}

double TransformerModel::samples_per_step() const {
  return static_cast<double>(transformer_.shape().micro_batch * transformer_.microbatches());
}

double TransformerModel::flops_per_step() const {
  const TransformerShape& s = transformer_.shape();
  const double n = static_cast<double>(transformer_.params().total_numel());
  const double per_token = 6.0 * n + 12.0 * static_cast<double>(s.layers) *
                                         static_cast<double>(s.seq) *
                                         static_cast<double>(s.attn_width());
  return per_token * units_per_step();
}

std::string TransformerModel::flops_formula() const {
  return "6*N*tokens + 12*L*s*d*tokens (per GPU shard: N = this shard's parameters, d = this "
         "shard's attention width, heads per GPU x head dim)";
}

std::string TransformerModel::collectives() const {
  const int tp = transformer_.shape().tp;
  if (tp == 1) return "none (tp 1)";
  if (!tp_run_) return "not run (1 process)";
  return "run (tp " + std::to_string(tp) +
         (transformer_.shape().sequence_parallel ? ", sequence parallel" : "") + ", NCCL)";
}

// ---- The workload ------------------------------------------------------------------------------

TransformerWorkload::TransformerWorkload(Recipe recipe) : recipe_(std::move(recipe)) {
  for (const Preset& p : recipe_.presets) preset_infos_.push_back(p.info);
}

void TransformerWorkload::add_flags(CLI::App& app) {
  app.add_option("--layers", layers_flag_,
                 "transformer layers of this shard (0: the preset's default)")
      ->check(train::integer_in(0, train::kMaxInt));
  app.add_option("--microbatches", microbatches_, "gradient-accumulation micro-batches per step")
      ->check(train::integer_in(1, 1024));
  app.add_flag("--sequence-parallel", sequence_parallel_,
               "Megatron's sequence parallelism with --tp: norms and hidden dropout on 1/tp of the "
               "tokens, reduce-scatters and all-gathers in place of the all-reduces");
  app.add_option("--dropout", dropout_flag_,
                 "hidden and attention dropout probability in [0, 1) (default: the preset's)")
      ->check(train::number_in(0.0, 1.0));
  app.add_option(
         "--data-order", data_order_,
         "training batches: shuffled (a permutation per epoch, from the seed) or sequential "
         "(the file's order, as the PyTorch baseline reads it)")
      ->check(CLI::IsMember({"shuffled", "sequential"}));
}

void TransformerWorkload::resolve(const train::RunFlags& flags) {
  const Preset* preset = nullptr;
  for (const Preset& p : recipe_.presets)
    if (p.info.name == flags.preset) preset = &p;
  REPLAY_REQUIRE(preset != nullptr, "the driver resolves known presets only");
  preset_ = preset;
  if (dropout_flag_ == 1.0)
    throw bench::UsageError("--dropout: must be below 1 (1 drops everything)");
  shape_ = preset->shape;
  if (layers_flag_ > recipe_.model_layers)
    throw bench::UsageError(std::string("--layers: ") + recipe_.model + " has " +
                            std::to_string(recipe_.model_layers) + " layers, got " +
                            std::to_string(layers_flag_));
  if (layers_flag_ > 0) shape_.layers = layers_flag_;
  if (flags.tp > 0) shape_.tp = flags.tp;
  shape_.sequence_parallel = sequence_parallel_;
  if (sequence_parallel_ && shape_.tp < 2)
    throw bench::UsageError("--sequence-parallel: needs tensor parallelism (--tp 2 or more)");
  if (sequence_parallel_ && comm::world().size < shape_.tp)
    throw bench::UsageError(
        "--sequence-parallel: needs one process per tensor-parallel rank "
        "(mpiexec -n " +
        std::to_string(shape_.tp) + " ... --tp " + std::to_string(shape_.tp) +
        "); one process runs no collectives");
  if (sequence_parallel_ && shape_.tokens() % shape_.tp != 0)
    throw bench::UsageError("--sequence-parallel: micro_batch x seq (" +
                            std::to_string(shape_.tokens()) + ") must be a multiple of --tp " +
                            std::to_string(shape_.tp));
  dropout_ = std::isnan(dropout_flag_) ? static_cast<double>(shape_.dropout) : dropout_flag_;
  shape_.dropout = static_cast<float>(dropout_);
  if (flags.eval_interval > 0 && dropout_ > 0.0)
    throw bench::UsageError(
        "--eval-interval: evaluation runs the forward without dropout, which "
        "needs --dropout 0");
  data_path_ = flags.data;
}

nlohmann::ordered_json TransformerWorkload::config() const {
  const TransformerShape& s = shape_;
  nlohmann::ordered_json c = {
      {"layers", s.layers}, {"hidden", s.hidden}, {"heads", s.heads_shard()}};
  if (recipe_.report_kv_heads) c["kv_heads"] = s.kv_heads_shard();
  c.update(nlohmann::ordered_json{{"head_dim", s.head_dim},
                                  {"ffn", s.ffn_shard()},
                                  {"seq", s.seq},
                                  {"micro_batch", s.micro_batch},
                                  {"microbatches", microbatches_},
                                  {"vocab", s.padded_vocab()},
                                  {"vocab_shard", s.vocab_shard()},
                                  {"tp", s.tp},
                                  {"sequence_parallel", s.sequence_parallel},
                                  {"dropout", dropout_},
                                  {"data_order", data_order_}});
  // The whole model, for tools that build the same shard (replay-ops, the PyTorch baselines).
  c["model"] = {{"layers", recipe_.model_layers},
                {"heads", s.heads},
                {"kv_heads", s.kv_heads()},
                {"ffn", s.ffn},
                {"data_vocab", s.vocab},
                {"norm", s.norm == NormKind::kLayerNorm ? "layernorm" : "rmsnorm"},
                {"norm_eps", bench::decimal(s.norm_eps)},
                {"mlp", s.mlp == MlpKind::kGelu ? "gelu" : "swiglu"},
                {"position", s.position == PositionKind::kLearned ? "learned" : "rope"},
                {"rope_theta", s.rope_theta},
                {"rope_llama31_scaling", s.rope_llama31_scaling},
                {"bias", s.bias},
                {"tied_embedding", s.tied_embedding}};
  return c;
}

train::TrainingConfig TransformerWorkload::training() const {
  train::TrainingConfig t = recipe_.mlperf_training(shape_.micro_batch * microbatches_);
  if (preset_ != nullptr && preset_->schedule) {
    t.schedule = *preset_->schedule;
    t.schedule_source =
        "the " + preset_->info.name +
        " preset's own, made to learn on its Markov data (the rest of the optimizer "
        "is MLPerf's)";
  }
  return t;
}

void TransformerWorkload::open_data(const train::RunFlags& flags, std::FILE* out) {
  std::string path = data_path_;
  if (path.empty())
    path = data::ensure_dataset(
        preset_ ? dataset_params(shape_, preset_->data_sequences, preset_->data_vocab)
                : dataset_params(shape_));
  file_.emplace(path, data::BatchShape{shape_.micro_batch, shape_.seq, shape_.padded_vocab()});
  const data::TokenFileInfo& info = file_->info();
  std::fprintf(out,
               "# data: %s (%" PRId64 " sequences, vocabulary %" PRId64
               "); loss floor %.4f nats/token\n",
               path.c_str(), info.num_sequences, info.vocab_size, info.provenance.entropy_rate);
}

int TransformerWorkload::layers_for_budget(Context& ctx, const std::shared_ptr<PlanCaches>& caches,
                                           const train::TrainingConfig& training,
                                           size_t budget) const {
  int best = 0;
  for (int64_t layers = 1; layers <= recipe_.model_layers; ++layers) {
    TransformerShape s = shape_;
    s.layers = layers;
    TransformerModel planned(ctx, s, microbatches_, caches);
    train::TrainerOptions options;  // plans only: no device memory
    const train::Trainer trainer(ctx, planned, training, options);
    if (trainer.arena_plan().total_bytes() > budget) break;
    best = static_cast<int>(layers);
  }
  if (best == 0)
    throw Error("replay", "out of memory",
                "not even one layer of this shard fits the " + std::to_string(budget >> 30) +
                    " GiB budget");
  return best;
}

std::unique_ptr<TransformerModel> TransformerWorkload::build_model(
    Context& ctx, const train::TrainingConfig& training, uint64_t seed, std::FILE* out) {
  REPLAY_REQUIRE(file_.has_value(), "TransformerWorkload: open_data before build");
  auto caches = std::make_shared<PlanCaches>(ctx);
  if (shape_.layers == 0) {
    shape_.layers = layers_for_budget(ctx, caches, training);
    std::fprintf(out,
                 "# layers: %" PRId64
                 " (the most whose arena fits %zu GiB: an 80 GiB H100 less a margin)\n",
                 shape_.layers, kMemoryBudgetBytes >> 30);
  }
  auto model = std::make_unique<TransformerModel>(ctx, shape_, microbatches_, caches, tp_comm_);
  caches->gemms.seal();  // every plan of the run exists: none may be made on the step path
  const double floor = file_->info().provenance.entropy_rate;
  const int64_t held_out = held_out_rows(file_->info().num_sequences, shape_.micro_batch);
  model->set_data(std::move(*file_), seed, floor, held_out, data_order_ == "shuffled");
  file_.reset();
  if (shape_.tp > 1 && tp_comm_ == nullptr)
    std::fprintf(
        out,
        "# tensor parallelism %d: one process computes rank 0's shard; the TP all-reduces and "
        "all-gathers are not run\n",
        shape_.tp);
  return model;
}

bool TransformerWorkload::set_tensor_parallel(int rank, int size, comm::Communicator* comm) {
  REPLAY_REQUIRE(size > 1 || !shape_.sequence_parallel,
                 "resolve refuses sequence parallelism without the group's processes");
  if (size == 1) return true;
  if (shape_.tp != size)
    throw bench::UsageError("--tp " + std::to_string(size) + ": the " + preset_->info.name +
                            " shard is cut for tp " + std::to_string(shape_.tp));
  shape_.tp_rank = rank;
  tp_comm_ = comm;
  return true;
}

std::unique_ptr<train::Model> TransformerWorkload::build(Context& ctx,
                                                         const train::TrainingConfig& training,
                                                         const train::RunFlags& flags,
                                                         std::FILE* out) {
  return build_model(ctx, training, flags.seed, out);
}

void TransformerWorkload::log_config(bench::MlLogger& log, const train::Model& model,
                                     const train::TrainingConfig& opt) const {
  namespace k = bench::mlkey;
  const auto& m = static_cast<const TransformerModel&>(model);
  const TransformerShape& shape = m.transformer().shape();
  log.event(k::kGlobalBatchSize, shape.micro_batch * microbatches_);
  log.event(k::kMicroBatchSize, shape.micro_batch);
  log.event(k::kGradientAccumulationSteps, microbatches_);
  log.event(k::kMaxSequenceLength, shape.seq);
  log.event(k::kTensorParallelism, shape.tp);
  log.event(k::kPipelineParallelism, 1);
  log.event(k::kContextParallelism, 1);
  log.event(k::kExpertParallelism, 1);
  log.event(k::kPrecisionLinear, "bfloat16");
  log.event(k::kPrecisionAttn, "bfloat16");
  log.event(k::kPrecisionComm, "bfloat16");
  log.event(k::kReplayNumLayers, shape.layers);
  const OptimizerLogKeys& ok = recipe_.optimizer_keys;
  log.event(k::kOptName, ok.name);
  log.event(k::kOptBaseLearningRate, static_cast<double>(opt.schedule.base_lr));
  log.event(k::kOptEndLearningRate, static_cast<double>(opt.schedule.min_lr));
  log.event(k::kOptLearningRateWarmupSteps, opt.schedule.warmup_steps);
  log.event(k::kOptLearningRateDecaySteps, opt.schedule.total_steps);
  log.event(k::kOptLearningRateDecaySchedule, "cosine with linear warmup");
  log.event(ok.beta1, static_cast<double>(opt.adam.beta1));
  log.event(ok.beta2, static_cast<double>(opt.adam.beta2));
  log.event(ok.epsilon, static_cast<double>(opt.adam.eps));
  log.event(ok.weight_decay, static_cast<double>(opt.adam.weight_decay));
  log.event(k::kOptGradientClipNorm, static_cast<double>(opt.clip_norm));
  log.event(k::kTrainSamples, m.train_samples());
}

}  // namespace replay::transformer
