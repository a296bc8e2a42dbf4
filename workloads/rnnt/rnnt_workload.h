// rnnt_workload.h: replay-rnnt, MLPerf's RNN-T on the shared training runtime (train/workload.h):
// its presets, flags (--ladder, --pad, --precision, --batch), data (a speech file,
// datasets/rnnt.md, generated on first use when --data is not given), the padded shapes of the run
// (a ladder fitted to the sampler's batches, or each batch's own shape) with their padding waste
// and activation memory, and its training configuration.
//
// Padding. `layer` and `full` capture one executable per rung of a ladder (--ladder N rungs
// fitted to one epoch of the sampler's batches, frames and labels multiples of 8: ladder.h), and a
// batch runs on the smallest rung that holds it. `none` runs each batch at its own shape (--pad
// exact, its default): its longest utterance's frames rounded up to an even number (the encoder's
// time stacking pairs frames) and its longest transcript; inside that shape every utterance still
// runs to the batch's length in the LSTMs (the loss masks the rest), as under graphs, so `none
// --pad ladder` is bitwise what `layer` and `full` compute. Exact shapes are planned before the
// first step for the batches the run will read (GEMM plans are built at set-up, never mid-run).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/workload.h"
#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/rnnt_model.h"
#include "workloads/rnnt/speech_generate.h"

namespace replay::rnnt {

class RnntWorkload : public train::Workload {
 public:
  RnntWorkload();

  const train::WorkloadInfo& info() const override { return info_; }
  const std::vector<train::Preset>& presets() const override { return presets_; }
  void add_flags(CLI::App& app) override;
  void resolve(const train::RunFlags& flags) override;
  nlohmann::ordered_json config() const override;
  std::string precision() const override { return dtype_ == DType::kBF16 ? "bf16" : "fp16"; }
  train::TrainingConfig training() const override;
  void open_data(const train::RunFlags& flags, std::FILE* out) override;
  std::unique_ptr<train::Model> build(Context& ctx, const train::TrainingConfig& training,
                                      const train::RunFlags& flags, std::FILE* out) override;
  bool evaluates() const override { return true; }
  void log_config(bench::MlLogger& log, const train::Model& model,
                  const train::TrainingConfig& training) const override;

  const RnntShape& shape() const { return shape_; }
  const RnntBatching& batching() const { return batching_; }
  const SpeechDatasetParams& dataset() const { return dataset_; }
  // What the last evaluation decoded (its error rate and a hash of every hypothesis).
  const RnntEvalLog& eval_log() const { return *eval_log_; }

 private:
  train::WorkloadInfo info_;
  std::vector<train::Preset> presets_;
  // Flags.
  int ladder_flag_ = 4;
  std::string pad_flag_;  // "", "exact", "ladder"
  std::string precision_flag_ = "fp16";
  int batch_flag_ = 0;
  std::string decoder_flag_ = "while";
  std::string eval_graph_flag_;  // "", "one", "two": empty is one in full mode, else two
  std::string decode_handle_flag_ = "own";
  int while_unroll_flag_ = 8;  // fastest of 1, 2, 8 at mlperf-b192 on an H100
  std::string optimizer_flag_;
  double ema_flag_ = -1;  // < 0: the preset's  // "", "lamb", "adamw": empty is the preset's
  // Resolved.
  std::string preset_;
  std::string eval_graph_ = "two";  // resolved
  RnntShape shape_;
  DType dtype_ = DType::kFP16;
  bool exact_ = false;
  int64_t steps_ = 0;
  uint64_t seed_ = 0;
  double lr_ = 0;
  bool lamb_ = true;
  int64_t warmup_epochs_ = 0, hold_epochs_ = 0;
  float gamma_ = 1.0f;
  SpeechDatasetParams dataset_;
  int64_t steps_per_epoch_ = 1;
  // After open_data.
  std::shared_ptr<SpeechFile> file_;
  SamplerOptions sampler_;
  RnntBatching batching_;
  PaddingStats run_padding_, exact_padding_, ladder_padding_;
  std::vector<int64_t> batches_per_shape_;
  std::shared_ptr<RnntEvalLog> eval_log_ = std::make_shared<RnntEvalLog>();
  // After build.
  std::vector<size_t> activation_bytes_;
  int64_t params_count_ = 0;
};

}  // namespace replay::rnnt
