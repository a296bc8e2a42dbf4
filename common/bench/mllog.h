// mllog.h: MLPerf-format run logging: MlLogger writes ":::MLLOG {json}" lines (the format that
// python3 -m mlperf_logging.compliance_checker reads), plus the standard keys as constants.
//
// Usage (rank 0 writes, every other rank's logger does nothing):
//   MlLogOptions options;
//   options.path = "gpt3.mllog";
//   options.rank = rank;
//   MlLogger log(std::move(options));
//   log.event(mlkey::kCacheClear, false);
//   log.start(mlkey::kInitStart);
//   log.event(mlkey::kSeed, seed);
//   log.start(mlkey::kBlockStart, {{mlkey::kSamplesCount, 0}});
//   log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
// Every line records its call site (file relative to the repository root, and line) through the
// default MlSite argument, as the Python logger does.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace replay::bench {

// One log value: null, bool, integer, double or string. Integers keep their full 64-bit range
// (seeds); a non-finite double is written as null, since JSON has no NaN or infinity.
class MlValue {
 public:
  using Variant = std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string>;

  MlValue() = default;
  MlValue(std::nullptr_t) {}
  MlValue(bool v) : v_(v) {}
  template <typename T,
            std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  MlValue(T v) {
    if constexpr (std::is_signed_v<T>)
      v_ = static_cast<int64_t>(v);
    else
      v_ = static_cast<uint64_t>(v);
  }
  MlValue(double v) : v_(v) {}
  MlValue(const char* v) : v_(std::string(v)) {}
  MlValue(std::string v) : v_(std::move(v)) {}
  MlValue(std::string_view v) : v_(std::string(v)) {}

  const Variant& get() const { return v_; }

 private:
  Variant v_;
};

// Named values in the order given: a line's metadata, or tracked_stats' value.
using MlFields = std::vector<std::pair<std::string, MlValue>>;

// A call site, captured where the logging call is written (like std::source_location in C++20).
struct MlSite {
  const char* file;
  int line;
  static MlSite here(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return {file, line};
  }
};

struct MlLogOptions {
  std::string path;                // file written (truncated first); empty: no file
  bool echo = false;               // also print every line on stdout
  int rank = 0;                    // only rank 0 logs: pass the MPI rank
  std::function<int64_t()> clock;  // ms since the epoch; empty: the system clock (tests fix it)
};

// Writes MLPerf log lines. Each line is flushed as it is written, so a run that dies leaves a valid
// prefix. Calls are thread-safe. A logger destroyed after it wrote lines but before run_stop
// appends run_stop with status "aborted" (the safety net for error paths; call abort() to say why).
class MlLogger {
 public:
  explicit MlLogger(MlLogOptions options);  // throws replay::Error if the file cannot be opened
  ~MlLogger();
  MlLogger(const MlLogger&) = delete;
  MlLogger& operator=(const MlLogger&) = delete;

  bool enabled() const { return enabled_; }  // false on ranks other than 0

  // POINT_IN_TIME: a setting (seed, opt_*, ...) or a measurement (eval_accuracy).
  void event(std::string_view key, const MlValue& value = {}, const MlFields& metadata = {},
             MlSite site = MlSite::here());
  // INTERVAL_START / INTERVAL_END with a null value: init, run, block, epoch and eval markers.
  // run_stop requires metadata status "success" or "aborted".
  void start(std::string_view key, const MlFields& metadata = {}, MlSite site = MlSite::here());
  void end(std::string_view key, const MlFields& metadata = {}, MlSite site = MlSite::here());
  // tracked_stats: value is an object of statistics (throughput, step time...), metadata the step.
  void tracked_stats(int64_t step, const MlFields& stats, MlSite site = MlSite::here());
  // run_stop with status "aborted" and the reason as metadata "error", unless run_stop was already
  // written. For a workload's error path: catch, abort(e.what()), rethrow or exit non-zero.
  void abort(std::string_view reason, MlSite site = MlSite::here());

 private:
  void write(const char* event_type, std::string_view key, const std::string& value_json,
             const MlFields& metadata, MlSite site);

  bool enabled_ = false;
  bool echo_ = false;
  std::FILE* file_ = nullptr;
  std::function<int64_t()> clock_;
  std::mutex mutex_;
  bool wrote_ = false;    // at least one line written
  bool stopped_ = false;  // run_stop written
};

// The standard keys and metadata names (mlperf_logging.mllog.constants), and replay's own.
namespace mlkey {
// Event types.
inline constexpr char kIntervalStart[] = "INTERVAL_START";
inline constexpr char kIntervalEnd[] = "INTERVAL_END";
inline constexpr char kPointInTime[] = "POINT_IN_TIME";

// Submission information. A shard run never logs submission_division: it is not a submission
// (scripts/mlperf/README.md), and replay's rules reject the key.
inline constexpr char kSubmissionBenchmark[] = "submission_benchmark";
inline constexpr char kSubmissionDivision[] = "submission_division";
inline constexpr char kSubmissionOrg[] = "submission_org";
inline constexpr char kSubmissionPlatform[] = "submission_platform";
inline constexpr char kSubmissionStatus[] = "submission_status";
inline constexpr char kGpt3[] = "gpt3";
inline constexpr char kLlama31_405b[] = "llama31_405b";

// Run structure.
inline constexpr char kCacheClear[] = "cache_clear";
inline constexpr char kInitStart[] = "init_start";
inline constexpr char kInitStop[] = "init_stop";
inline constexpr char kRunStart[] = "run_start";
inline constexpr char kRunStop[] = "run_stop";
inline constexpr char kBlockStart[] = "block_start";
inline constexpr char kBlockStop[] = "block_stop";
inline constexpr char kEpochStart[] = "epoch_start";
inline constexpr char kEpochStop[] = "epoch_stop";
inline constexpr char kEvalStart[] = "eval_start";
inline constexpr char kEvalStop[] = "eval_stop";
inline constexpr char kEvalAccuracy[] = "eval_accuracy";
inline constexpr char kTrackedStats[] = "tracked_stats";

// Settings.
inline constexpr char kSeed[] = "seed";
inline constexpr char kGlobalBatchSize[] = "global_batch_size";
inline constexpr char kGradientAccumulationSteps[] = "gradient_accumulation_steps";
inline constexpr char kMicroBatchSize[] = "micro_batch_size";
inline constexpr char kMaxSequenceLength[] = "max_sequence_length";
inline constexpr char kTrainSamples[] = "train_samples";
inline constexpr char kEvalSamples[] = "eval_samples";
inline constexpr char kInitCheckpointStep[] = "init_checkpoint_step";
inline constexpr char kConfigFilename[] = "config_filename";
inline constexpr char kTensorParallelism[] = "tensor_parallelism";
inline constexpr char kPipelineParallelism[] = "pipeline_parallelism";
inline constexpr char kContextParallelism[] = "context_parallelism";
inline constexpr char kExpertParallelism[] = "expert_parallelism";
inline constexpr char kPrecisionLinear[] = "lowest_numerical_precision_in_linear";
inline constexpr char kPrecisionAttn[] = "lowest_numerical_precision_in_attn";
inline constexpr char kPrecisionComm[] = "lowest_numerical_precision_in_comm";

// Optimizer hyperparameters.
inline constexpr char kOptName[] = "opt_name";
inline constexpr char kOptBaseLearningRate[] = "opt_base_learning_rate";
inline constexpr char kOptEndLearningRate[] = "opt_end_learning_rate";
inline constexpr char kOptLearningRateWarmupSteps[] = "opt_learning_rate_warmup_steps";
inline constexpr char kOptLearningRateDecaySteps[] = "opt_learning_rate_decay_steps";
inline constexpr char kOptLearningRateDecaySchedule[] = "opt_learning_rate_decay_schedule";
inline constexpr char kOptAdamBeta1[] = "opt_adam_beta_1";
inline constexpr char kOptAdamBeta2[] = "opt_adam_beta_2";
inline constexpr char kOptAdamEpsilon[] = "opt_adam_epsilon";
inline constexpr char kOptAdamwBeta1[] = "opt_adamw_beta_1";
inline constexpr char kOptAdamwBeta2[] = "opt_adamw_beta_2";
inline constexpr char kOptAdamwEpsilon[] = "opt_adamw_epsilon";
inline constexpr char kOptAdamwWeightDecay[] = "opt_adamw_weight_decay";
inline constexpr char kOptWeightDecay[] = "opt_weight_decay";
inline constexpr char kOptGradientClipNorm[] = "opt_gradient_clip_norm";

// replay's shard description (required by scripts/mlperf/shard_common.yaml).
inline constexpr char kReplayGraphMode[] = "replay_graph_mode";  // none | layer | full
inline constexpr char kReplayNumLayers[] = "replay_num_layers";  // layers this shard runs
inline constexpr char kReplayWorldSize[] = "replay_world_size";  // processes actually run

// Metadata names and values.
inline constexpr char kStatus[] = "status";
inline constexpr char kSuccess[] = "success";
inline constexpr char kAborted[] = "aborted";
inline constexpr char kEpochNum[] = "epoch_num";
inline constexpr char kEpochCount[] = "epoch_count";
inline constexpr char kFirstEpochNum[] = "first_epoch_num";
inline constexpr char kSamplesCount[] = "samples_count";
inline constexpr char kStep[] = "step";
}  // namespace mlkey

}  // namespace replay::bench
