// workload.h: train::Workload, the small interface one benchmark implements (as nccl-tests'
// callback table): its presets, its own flags, its resolved configuration, its data, its model, its
// training configuration and its MLPerf configuration events. The driver (driver.h) does the rest
// the same way for every workload: flags, data check, device, arena, plan, warm-up and capture,
// timed steps, evaluation, JSON summary and mllog.
//
// The order the driver calls it in:
//   add_flags(app)              before parsing (its own flags, bound to its members)
//   resolve(flags)              the preset and its flags applied; throws bench::UsageError
//   config(), training()        --print-config stops here: nothing below needs a GPU
//   open_data(flags, out)       missing or malformed data is an error before any GPU work
//   build(ctx, training, out)   the model and its plans (no device memory yet)
//   log_config(mllog, model, t) its MLPerf configuration events
//   config()                    again at the end, for the JSON summary (values build resolved)
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/comm.h"
#include "common/context.h"
#include "common/optim/adamw.h"
#include "common/optim/lamb.h"
#include "train/flags.h"
#include "train/model.h"
#include "train/schedule.h"
#include "train/step_scalars.h"

namespace CLI {
class App;
}

namespace replay::bench {
class MlLogger;
}

namespace replay::train {

struct Preset {
  std::string name;
  std::string description;
  int64_t steps = 20;  // default timed steps
};

// What the trainer's optimizer step does: AdamW over the ParamStore with a device schedule and
// global-norm clipping, and dynamic loss scaling where the workload trains in fp16.
struct TrainingConfig {
  AdamWHyper adam;
  LrSchedule schedule;
  float clip_norm = 1.0f;                        // <= 0: no clipping
  std::optional<LossScalerConfig> loss_scaling;  // none: a constant scale of 1 (bf16, fp32)
  // Where the schedule comes from, printed with it: "MLPerf GPT-3: 265 x 1536 warm-up samples and
  // 166,809,600 decay samples, at the shard's global batch of 1 sequence a step".
  std::string schedule_source;
  // The update: AdamW with `adam` (the default), or LAMB with `lamb` (MLPerf RNN-T; one process,
  // no data or tensor parallelism: its per-tensor norms would need the other ranks' shares).
  enum class Optimizer { kAdamW, kLamb };
  Optimizer optimizer = Optimizer::kAdamW;
  LambHyper lamb;
  // How an overflow step skips the update: false, the no-op flag the optimizer kernels read (they
  // launch and return at once); true, an IF conditional node around them (graphs/conditional.h)
  // that runs them only when the no-op flag is 0. The same kernels and bytes either way.
  bool skip_with_if = false;
};

// Who the workload is: names in output, JSON and mllog.
struct WorkloadInfo {
  std::string tool;             // executable and JSON "tool": "replay-gpt3"
  std::string name;             // JSON "workload": "gpt3"
  std::string family;           // in "--preset: 'x' is not a GPT-3 preset"
  std::string default_preset;   // "tiny"
  std::string unit;             // throughput unit: "tokens", "images", "utterances", "samples"
  std::string unit_short;       // in progress lines: "tok", "img", "utt"
  std::string mllog_benchmark;  // submission_benchmark
};

class Workload {
 public:
  virtual ~Workload() = default;

  virtual const WorkloadInfo& info() const = 0;
  virtual const std::vector<Preset>& presets() const = 0;
  // Its own flags, bound to its members. Optional.
  virtual void add_flags(CLI::App& app) { (void)app; }
  // Applies the preset the flags name and the workload's own flags (the driver has filled in the
  // seed and the preset's steps). Throws bench::UsageError for values the preset cannot take.
  virtual void resolve(const RunFlags& flags) = 0;
  // The resolved configuration: printed by --print-config (shapes for replay-ops and the PyTorch
  // baselines) and the JSON summary's "config", which the driver completes with the run's seed,
  // steps, warm-up and precision.
  virtual nlohmann::ordered_json config() const = 0;
  // The precision the JSON and mllog name ("bf16", "fp16").
  virtual std::string precision() const = 0;
  virtual TrainingConfig training() const = 0;
  // Opens its data (or generates its default), checks it and prints one line about it. Throws Error
  // for missing or malformed data. Called before any GPU work.
  virtual void open_data(const RunFlags& flags, std::FILE* out) = 0;
  // The model for this run, planned but without device memory. May print what it chose (a layer
  // count from the memory budget).
  virtual std::unique_ptr<Model> build(Context& ctx, const TrainingConfig& training,
                                       const RunFlags& flags, std::FILE* out) = 0;
  // Tensor parallelism across processes (set-up, before build): this process is rank `rank` of a
  // group of `size` that `comm` connects. False when the workload cannot split its model.
  virtual bool set_tensor_parallel(int rank, int size, comm::Communicator* comm) {
    (void)rank;
    (void)comm;
    return size == 1;
  }
  // Expert parallelism (a mixture of experts split over processes): the ranks its flags ask for
  // (1: none). The driver refuses a launch that does not match before any work, and calls
  // set_expert_parallel (set-up, before build) when it is more than 1: this process is rank `rank`
  // of the group of `size` that `comm` connects, which the model uses for its all-to-alls and the
  // trainer as its model-parallel group (the grad norm summed over it, parameters marked
  // tp_replicated counted once).
  virtual int expert_parallel() const { return 1; }
  virtual void set_expert_parallel(int rank, int size, comm::Communicator* comm) {
    (void)rank;
    (void)size;
    (void)comm;
  }
  // Whether its models evaluate (Model::evaluation); --eval-interval is refused otherwise.
  virtual bool evaluates() const { return false; }
  // Its MLPerf configuration events, between the driver's seed and eval_samples events; `training`
  // is the run's (the schedule flags applied).
  virtual void log_config(bench::MlLogger& log, const Model& model,
                          const TrainingConfig& training) const = 0;
};

}  // namespace replay::train
