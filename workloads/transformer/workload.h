// workload.h: the driver every transformer workload shares (as nccl-tests' src/common.h): a
// Workload table holds what one model's recipe names (presets, layer count, MLPerf optimizer and
// log keys), and resolve() and run() turn flags into one timed run through the benchmark harness.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/attention.h"
#include "common/bench/harness.h"
#include "common/context.h"
#include "common/data/generate.h"
#include "common/gemm.h"
#include "workloads/transformer/training.h"

namespace replay::transformer {

struct Preset {
  std::string name;
  std::string description;
  TransformerShape shape;  // layers 0: as many as fit kMemoryBudgetBytes
  int64_t steps = 20;      // default timed steps
};

// The mllog keys that name the optimizer and its Adam hyperparameters (MLPerf logs GPT-3's as
// "adam" with opt_adam_*, Llama 3.1's as "adamw" with opt_adamw_*).
struct OptimizerLogKeys {
  const char* name;
  const char* beta1;
  const char* beta2;
  const char* epsilon;
  const char* weight_decay;
};

// What one workload fills in; everything else is the shared driver below.
struct Workload {
  const char* tool;             // executable and JSON "tool": "replay-gpt3"
  const char* name;             // JSON "workload": "gpt3"
  const char* family;           // in "--preset: 'x' is not a GPT-3 preset"
  const char* model;            // in "--layers: GPT-3 175B has 96 layers"
  int64_t model_layers;         // the full model's depth: --layers may not exceed it
  std::vector<Preset> presets;  // "tiny" among them: the default
  OptimizerConfig (*mlperf_optimizer)(int64_t global_batch);
  const char* mllog_benchmark;  // submission_benchmark
  OptimizerLogKeys optimizer_keys;
  bool report_kv_heads;  // JSON config carries "kv_heads" (grouped-query attention)
};

std::vector<std::string> preset_names(const Workload& w);
// Throws bench::UsageError naming the presets when `name` is not one.
Preset preset(const Workload& w, const std::string& name);

// The synthetic data a preset trains on without --data (generated once into the data folder): a
// first-order Markov chain over the tokenizer's vocabulary with 4 successors per token, so the
// loss falls visibly within a few steps and its floor (the entropy rate) is known exactly.
data::MarkovDatasetParams dataset_params(const TransformerShape& shape);

// The default layer count of the full-model presets is the largest whose arena plan (parameters,
// fp32 master weights, gradients and Adam moments, activations, workspaces) fits this budget: an
// 80 GiB H100 less 6 GiB for the CUDA context, library handles and graph executables. The budget
// is fixed, so the default is the same on an H100 and an H200.
constexpr size_t kMemoryBudgetBytes = (size_t{80} - 6) << 30;
int layers_for_budget(Context& ctx, const TrainerConfig& config, GemmCache& gemms,
                      AttentionCache& attention, int64_t model_layers,
                      size_t budget = kMemoryBudgetBytes);

// A run's resolved settings: the flags with the preset's defaults filled in and the seed drawn,
// and the trainer's configuration (shape, MLPerf optimizer, graph mode). Tests may adjust them.
struct Settings {
  bench::HarnessFlags flags;
  Preset preset;
  TrainerConfig trainer;
};
// Throws bench::UsageError for values the preset cannot take (--layers above the model's).
Settings resolve(const Workload& w, bench::HarnessFlags flags);

struct RunResult {
  bench::WorkloadReport report;
  std::string master_hash;  // fp32 master weights after the last step
};
// Generates or validates the data (before any GPU work), builds the shard, times the steps, prints
// progress and the final table to `out`, writes the JSON summary and the MLPerf log when asked.
RunResult run(const Workload& w, const Settings& settings, std::FILE* out = stdout);

// The executable's main: parses the flags, resolves and runs; exit codes as bench::run_main.
int workload_main(const Workload& w, int argc, char** argv);

}  // namespace replay::transformer
