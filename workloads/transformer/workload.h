// workload.h: the transformer shards as train/ workloads. A Recipe is what one model family names
// (presets, depth, MLPerf optimizer and log keys); TransformerWorkload turns it into a
// train::Workload (its flags --layers, --dropout, --microbatches; its token data; its model; its
// MLPerf events), and TransformerModel is the train::Model the trainer drives: the Transformer of
// model.h, its batches and its step's regions. gpt3/ and llama31/ are tables of this.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/attention.h"
#include "common/context.h"
#include "common/data/batch_stream.h"
#include "common/data/generate.h"
#include "common/data/token_file.h"
#include "common/gemm.h"
#include "train/workload.h"
#include "workloads/transformer/model.h"
#include "workloads/transformer/shape.h"

namespace replay::transformer {

struct Preset {
  train::Preset info;      // name, description, default steps
  TransformerShape shape;  // layers 0: as many as fit kMemoryBudgetBytes
  // The preset's own schedule (the tiny presets: one that learns within a few hundred steps);
  // without one, MLPerf's at the shard's global batch.
  std::optional<train::LrSchedule> schedule;
  // The synthetic data it generates without --data (dataset_params): sequences, and the tokens the
  // Markov chain uses (0: the model's whole vocabulary). Fewer tokens put the data's floor within a
  // few thousand steps of a larger model, which is what a time-to-train benchmark needs.
  int64_t data_sequences = 1024;
  int64_t data_vocab = 0;
};

// The tiny presets' schedule: warm-up over 20 steps to 3e-3, cosine decay to 3e-4 at step 400. On
// the presets' Markov data (floor 1.07 nats) both tiny models are within about 0.2 nats of the
// floor after 300 steps (an H100; 1e-3 and 1e-2 peaks were slower).
train::LrSchedule tiny_schedule();

// The mllog keys that name the optimizer and its Adam hyperparameters (MLPerf logs GPT-3's as
// "adam" with opt_adam_*, Llama 3.1's as "adamw" with opt_adamw_*).
struct OptimizerLogKeys {
  const char* name;
  const char* beta1;
  const char* beta2;
  const char* epsilon;
  const char* weight_decay;
};

// What one model family fills in.
struct Recipe {
  train::WorkloadInfo info;     // tool, name, family, default preset, unit "tokens", benchmark
  const char* model;            // in "--layers: GPT-3 175B has 96 layers"
  int64_t model_layers;         // the full model's depth: --layers may not exceed it
  std::vector<Preset> presets;  // "tiny" among them: the default
  train::TrainingConfig (*mlperf_training)(int64_t global_batch);
  OptimizerLogKeys optimizer_keys;
  bool report_kv_heads;  // the configuration carries "kv_heads" (grouped-query attention)
};

// The synthetic data a preset trains on without --data (generated once into the data folder): a
// first-order Markov chain over the tokenizer's vocabulary with 4 successors per token, so the
// loss falls visibly within a few steps and its floor (the entropy rate) is known exactly.
data::MarkovDatasetParams dataset_params(const TransformerShape& shape, int64_t sequences = 1024,
                                         int64_t vocab = 0);

// The held-out split of a token file of `rows` sequences: its last min(64, rows / 16) sequences,
// rounded down to whole micro-batches (0 when the rest would not hold a micro-batch). Training
// batches come from the other rows; evaluations read these, in order, every time.
int64_t held_out_rows(int64_t rows, int64_t micro_batch);

// The default layer count of the full-model presets is the largest whose arena plan (parameters,
// fp32 master weights, gradients and Adam moments, activations, workspaces) fits this budget: an
// 80 GiB H100 less 6 GiB for the CUDA context, library handles and graph executables. The budget
// is fixed, so the default is the same on an H100 and an H200.
constexpr size_t kMemoryBudgetBytes = (size_t{80} - 6) << 30;

// The library plans of a run (cuBLASLt, cuDNN), shared by the models planned while the memory
// budget is searched and kept by the one that runs. They must not outlive the Context that built
// them.
struct PlanCaches {
  explicit PlanCaches(const Context& ctx) : gemms(ctx) {}
  GemmCache gemms;
  AttentionCache attention;
};

// The train::Model of one transformer shard: the model, its batches and its step's regions (per
// micro-batch: embedding forward, layer i forward, head, layer i backward in reverse, embedding
// backward).
class TransformerModel : public train::Model {
 public:
  // Plans the model (set-up, no device memory).
  TransformerModel(const Context& ctx, const TransformerShape& shape, int microbatches,
                   std::shared_ptr<PlanCaches> caches, comm::Communicator* tp = nullptr);
  // The batches it trains on (before the first load_batch), the file's last `held_out` rows kept
  // for evaluation; `loss_floor` is the data's (NaN: unknown).
  void set_data(data::TokenFile file, uint64_t seed, double loss_floor, int64_t held_out,
                bool shuffle = true);

  Transformer& transformer() { return transformer_; }
  const Transformer& transformer() const { return transformer_; }

  std::string describe() const override { return transformer_.shape().describe(); }
  train::ParamStore& params() override { return transformer_.params(); }
  const train::ParamStore& params() const override { return transformer_.params(); }
  void plan(ArenaPlan& plan) override;
  void bind(const Arena& arena) override;
  void initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) override;
  void register_rng(graphs::RngTracker& rng) override { transformer_.register_rng(rng); }
  std::vector<graphs::Region> regions() override;
  int load_batch(cudaStream_t stream) override;
  // The data position counts micro-batches in the stream's order (data::BatchOrder).
  int64_t data_position() const override;
  void seek_data(int64_t position) override;
  bool shard_data(int rank, int count) override;
  // Micro-batch m's tokens and targets ("tokens.m", "targets.m", [micro_batch, seq] int32).
  std::vector<NamedTensor> batch_tensors() const override;
  // The held-out loss (nats per token), over micro-batch 0's buffers.
  std::optional<train::EvalInfo> evaluation() const override;
  std::vector<graphs::Region> eval_regions() override;
  void begin_eval(cudaStream_t stream) override;
  void load_eval_batch(cudaStream_t stream) override;
  double end_eval(cudaStream_t stream) override;
  // (6 N + 12 L s d) per token, N this shard's parameters and d this shard's attention width
  // (heads per GPU x head dim).
  double flops_per_step() const override;
  std::string flops_formula() const override;
  double units_per_step() const override;  // tokens
  double samples_per_step() const override;
  std::string collectives() const override;
  double loss_floor() const override { return loss_floor_; }
  int64_t train_samples() const;  // sequences in the training data

 private:
  std::shared_ptr<PlanCaches> caches_;
  Transformer transformer_;
  std::optional<data::BatchStream> batches_;
  bool tp_run_ = false;  // the tensor-parallel collectives run (a group of processes)
  std::unique_ptr<data::HeldOutRows> held_out_;
  double loss_floor_ = NAN;
  BufferId eval_id_ = -1;  // [0]: the batch's mean loss, [4]: the evaluation's sum (16-byte apart)
  float* eval_batch_loss_ = nullptr;
  float* eval_loss_sum_ = nullptr;
  int64_t next_eval_ = 0, evaluated_ = 0;
};

class TransformerWorkload : public train::Workload {
 public:
  explicit TransformerWorkload(Recipe recipe);

  const train::WorkloadInfo& info() const override { return recipe_.info; }
  const std::vector<train::Preset>& presets() const override { return preset_infos_; }
  void add_flags(CLI::App& app) override;
  void resolve(const train::RunFlags& flags) override;
  nlohmann::ordered_json config() const override;
  std::string precision() const override { return "bf16"; }
  train::TrainingConfig training() const override;
  void open_data(const train::RunFlags& flags, std::FILE* out) override;
  bool set_tensor_parallel(int rank, int size, comm::Communicator* comm) override;
  std::unique_ptr<train::Model> build(Context& ctx, const train::TrainingConfig& training,
                                      const train::RunFlags& flags, std::FILE* out) override;
  bool evaluates() const override { return true; }
  void log_config(bench::MlLogger& log, const train::Model& model,
                  const train::TrainingConfig& training) const override;

  const Recipe& recipe() const { return recipe_; }
  // The resolved shard (after resolve(); layers 0 until build() chose them for the budget).
  const TransformerShape& shape() const { return shape_; }
  int microbatches() const { return microbatches_; }
  // The model build() returns, with its data, for a caller that drives a Trainer itself (tests).
  std::unique_ptr<TransformerModel> build_model(Context& ctx, const train::TrainingConfig& training,
                                                uint64_t seed, std::FILE* out);

 private:
  // The largest layer count whose run fits `budget` (plans only; no device memory).
  int layers_for_budget(Context& ctx, const std::shared_ptr<PlanCaches>& caches,
                        const train::TrainingConfig& training,
                        size_t budget = kMemoryBudgetBytes) const;

  Recipe recipe_;
  std::vector<train::Preset> preset_infos_;
  // Its own flags (0 and NaN: the preset's).
  int layers_flag_ = 0;
  bool sequence_parallel_ = false;  // --sequence-parallel
  int microbatches_ = 1;
  double dropout_flag_ = NAN;
  // Resolved.
  const Preset* preset_ = nullptr;
  TransformerShape shape_;
  double dropout_ = 0;
  std::string data_path_;
  std::string data_order_ = "shuffled";  // --data-order: shuffled | sequential
  comm::Communicator* tp_comm_ = nullptr;
  std::optional<data::TokenFile> file_;
};

}  // namespace replay::transformer
