// unet_workload.h: replay-unet, the Stable Diffusion v2 UNet on the shared training runtime
// (train/workload.h): presets (`tiny`, a two-level test UNet that runs in seconds; `sd2-b32` and
// `sd2-b64`, the full 865M UNet at NVIDIA's per-GPU batches), its flags (--precision,
// --overflow-at, --batch), the latent data (a file, or the generated synthetic default), MLPerf's
// optimizer (AdamW 0.9/0.999/1e-8, weight decay 0.01, linear warm-up over 1000 steps then
// constant) and fp16 dynamic loss scaling.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/workload.h"
#include "workloads/unet/unet_model.h"

namespace replay::unet {

// MLPerf SD: learning rate 1.25e-7 per image of the global batch, 1000 warm-up steps, then
// constant.
inline constexpr double kLrPerImage = 1.25e-7;
inline constexpr int64_t kWarmupSteps = 1000;

class UnetWorkload : public train::Workload {
 public:
  UnetWorkload();

  const train::WorkloadInfo& info() const override { return info_; }
  const std::vector<train::Preset>& presets() const override { return presets_; }
  void add_flags(CLI::App& app) override;
  void resolve(const train::RunFlags& flags) override;
  nlohmann::ordered_json config() const override;
  std::string precision() const override;
  train::TrainingConfig training() const override;
  void open_data(const train::RunFlags& flags, std::FILE* out) override;
  std::unique_ptr<train::Model> build(Context& ctx, const train::TrainingConfig& training,
                                      const train::RunFlags& flags, std::FILE* out) override;
  void log_config(bench::MlLogger& log, const train::Model& model,
                  const train::TrainingConfig& training) const override;

  const UnetConfig& unet() const { return config_; }
  int64_t data_samples() const { return data_samples_; }

 private:
  train::WorkloadInfo info_;
  std::vector<train::Preset> presets_;
  std::string precision_flag_ = "fp16";
  int64_t overflow_at_ = -1;
  int64_t batch_flag_ = 0;
  std::string skip_mode_ = "noop";  // --skip-mode: how an overflow step skips the update
  std::string op_times_;            // --op-times FILE
  bool data_stream_ = false;        // --data-stream
  bool poison_dead_ = false;        // --poison-dead-buffers
  std::string recompute_ = "none";  // --recompute
  std::string preset_;
  UnetConfig config_;
  int64_t data_samples_ = 0;  // the generated file's samples
  std::shared_ptr<UnetData> data_;
};

// The configuration of a preset (throws bench::UsageError for an unknown one).
UnetConfig preset_config(const std::string& preset);

}  // namespace replay::unet
