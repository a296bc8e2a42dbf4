// llama31.h: replay-llama31: the Llama 3.1 405B presets (a tiny test model, and one GPU's slice at
// TP8, NVIDIA's H100 layout, or TP4, the H200 layout), MLPerf's Llama 3.1 hyperparameters and log
// lines, and the run that times one preset in one graph mode through the benchmark harness. The
// model is workloads/transformer/ with the Llama options (RMSNorm, RoPE, GQA, SwiGLU, no biases,
// untied LM head).
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

namespace replay::llama31 {

constexpr int64_t kModelLayers = 126;  // Llama 3.1 405B

struct Preset {
  std::string name;
  std::string description;
  transformer::TransformerShape shape;  // layers 0: as many as fit kMemoryBudgetBytes
  int64_t steps = 20;                   // default timed steps
};

const std::vector<std::string>& preset_names();
// Throws bench::UsageError naming the presets when `name` is not one.
Preset preset(const std::string& name);

// The synthetic data a preset trains on without --data: a first-order Markov chain over the
// vocabulary with 4 successors per token (as replay-gpt3), so the loss falls within a few steps.
data::MarkovDatasetParams dataset_params(const transformer::TransformerShape& shape);

// MLPerf Llama 3.1 405B (reference/workloads.md): AdamW, betas 0.9/0.95, eps 1e-5, weight decay
// 0.1, clip 1.0, learning rate 8e-5 x GBS / 1152 with linear warm-up over ceil(8000 x 1152 / GBS)
// steps and cosine decay to 8e-7 at ceil(1,200,000 x 1152 / GBS) steps.
transformer::OptimizerConfig mlperf_optimizer(int64_t global_batch);

// The default layer count of the 405B presets is the largest whose arena plan fits this budget:
// an 80 GiB H100 less 6 GiB for the CUDA context, library handles and graph executables (the same
// rule as replay-gpt3, so the default is the same on an H100 and an H200).
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
// Throws bench::UsageError for values the preset cannot take (--layers above 126).
Settings resolve(bench::HarnessFlags flags);

struct RunResult {
  bench::WorkloadReport report;
  std::string master_hash;  // fp32 master weights after the last step
};
// Generates or validates the data (before any GPU work), builds the shard, times the steps, prints
// progress and the final table to `out`, writes the JSON summary and the MLPerf log when asked.
RunResult run(const Settings& settings, std::FILE* out = stdout);

}  // namespace replay::llama31
