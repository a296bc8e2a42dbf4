// gpt3.h: replay-gpt3: the GPT-3 175B presets (a tiny test model, and one GPU's slice of NVIDIA's
// H100 layout at TP4 or TP8), MLPerf's GPT-3 hyperparameters and log lines, and the run that times
// one preset in one graph mode through the benchmark harness.
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

namespace replay::gpt3 {

constexpr int64_t kModelLayers = 96;  // GPT-3 175B

struct Preset {
  std::string name;
  std::string description;
  transformer::TransformerShape shape;  // layers 0: as many as fit kMemoryBudgetBytes
  int64_t steps = 20;                   // default timed steps
};

const std::vector<std::string>& preset_names();
// Throws bench::UsageError naming the presets when `name` is not one.
Preset preset(const std::string& name);

// The synthetic data a preset trains on without --data (generated once into the data folder): a
// first-order Markov chain over the tokenizer's vocabulary with 4 successors per token, so the
// loss falls visibly within a few steps and its floor (the entropy rate) is known exactly.
data::MarkovDatasetParams dataset_params(const transformer::TransformerShape& shape);

// MLPerf GPT-3 (reference/workloads.md): Adam with decoupled weight decay 0.1, betas 0.9/0.95,
// eps 1e-8, clip 1.0, learning rate 2e-5 with linear warm-up over 407,040 samples (ceil(265 x 1536
// / GBS) steps) and cosine decay to 2e-6 at 166,809,600 samples.
transformer::OptimizerConfig mlperf_optimizer(int64_t global_batch);

// The default layer count of the 175B presets is the largest whose arena plan (parameters, fp32
// master weights, gradients and Adam moments, activations, workspaces) fits this budget: an 80 GiB
// H100 less 6 GiB for the CUDA context, library handles and graph executables. The budget is fixed,
// so the default is the same on an H100 and an H200.
constexpr size_t kMemoryBudgetBytes = (size_t{80} - 6) << 30;
int layers_for_budget(Context& ctx, const transformer::TrainerConfig& config, GemmCache& gemms,
                      AttentionCache& attention, size_t budget = kMemoryBudgetBytes);

// A run's resolved settings: the flags with the preset's defaults filled in and the seed drawn,
// and the trainer's configuration (shape, MLPerf optimizer, graph mode). Tests may adjust them.
struct Settings {
  bench::HarnessFlags flags;
  Preset preset;
  transformer::TrainerConfig trainer;
};
// Throws bench::UsageError for values the preset cannot take (--layers above 96).
Settings resolve(bench::HarnessFlags flags);

struct RunResult {
  bench::WorkloadReport report;
  std::string master_hash;  // fp32 master weights after the last step
};
// Generates or validates the data (before any GPU work), builds the shard, times the steps, prints
// progress and the final table to `out`, writes the JSON summary and the MLPerf log when asked.
RunResult run(const Settings& settings, std::FILE* out = stdout);

}  // namespace replay::gpt3
