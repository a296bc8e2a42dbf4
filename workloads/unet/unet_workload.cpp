// unet_workload.cpp: replay-unet's presets, flags, data, training configuration and log keys.
#include "workloads/unet/unet_workload.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>

#include "common/bench/harness.h"
#include "common/bench/mllog.h"
#include "common/check.h"
#include "workloads/unet/diffusion.h"
#include "workloads/unet/fp16_bits.h"
#include "workloads/unet/latent_generate.h"

namespace replay::unet {

namespace {

constexpr int64_t kMaxLoadedSamples = 1024;  // the training split held in pinned memory

}  // namespace

UnetConfig preset_config(const std::string& preset) {
  UnetConfig c;  // SD2
  if (preset == "tiny") {
    c.batch = 4;
    c.latent = 16;
    c.base = 32;
    c.mult = {1, 2};
    c.attention = {true, false};
    c.res_blocks = 2;
    c.groups = 8;
    c.head_dim = 32;
    c.context_len = 8;
    c.context_dim = 64;
  } else if (preset == "sd2-b32") {
    c.batch = 32;
  } else if (preset == "sd2-b64") {
    c.batch = 64;
  } else {
    throw bench::UsageError("--preset: '" + preset + "' is not a UNet preset");
  }
  return c;
}

UnetWorkload::UnetWorkload()
    : info_{"replay-unet", "unet", "UNet", "tiny", "images", "img", "stable_diffusion"},
      presets_{{"tiny",
                "2 levels (32, 64 channels), latent 4x16x16, context 8x64, batch 4: the test "
                "model, seconds on one GPU",
                20},
               {"sd2-b32",
                "the SD v2 UNet (865M), latent 4x64x64, context 77x1024, 32 images per GPU", 20},
               {"sd2-b64", "the SD v2 UNet at 64 images per GPU (NVIDIA's H100 batch)", 20}} {}

void UnetWorkload::add_flags(CLI::App& app) {
  app.add_option("--precision", precision_flag_,
                 "fp16 (dynamic loss scaling, as MLPerf trains it) or bf16 (no loss scaling)")
      ->check(CLI::IsMember({"fp16", "bf16"}));
  app.add_option("--overflow-at", overflow_at_,
                 "make the loss gradient of this step (0-based) infinite: fp16 overflow, the "
                 "optimizer skips the step and the loss scale falls (-1: none)")
      ->check(train::integer_in(-1, train::kMaxInt));
  app.add_option("--batch", batch_flag_, "images per step (0: the preset's)")
      ->check(train::integer_in(0, 1024));
  app.add_option("--skip-mode", skip_mode_,
                 "how an overflow step skips the optimizer: noop (the kernels read a device no-op "
                 "flag and return) or if (an IF conditional node runs them only on clean steps)")
      ->check(CLI::IsMember({"noop", "if"}));
  app.add_option("--op-times", op_times_,
                 "time every op with CUDA events (eager, --graphs none only; syncs every step) "
                 "and write the time per op class (convolution, GroupNorm, attention, ...) to "
                 "this JSON file");
  app.add_option("--recompute", recompute_,
                 "activations the backward recomputes instead of keeping: none, geglu (GEGLU "
                 "outputs), norms (GroupNorm and LayerNorm outputs) or all; bit-identical "
                 "results, less memory, more time")
      ->check(CLI::IsMember({"none", "geglu", "norms", "all"}));
  app.add_flag("--poison-dead-buffers", poison_dead_,
               "check the arena plan (eager, --graphs none only): fill every activation and "
               "gradient buffer with NaN bytes once its planned lifetime ends; a complete plan "
               "trains bit-identically");
  app.add_flag("--data-stream", data_stream_,
               "read each batch from the file ahead of the step on a prefetch thread (as the token "
               "workloads do) instead of holding the training split in pinned memory; the default "
               "for splits of more than 1,024 samples");
}

void UnetWorkload::resolve(const train::RunFlags& flags) {
  preset_ = flags.preset;
  config_ = preset_config(flags.preset);
  config_.dtype = precision_flag_ == "bf16" ? DType::kBF16 : DType::kFP16;
  if (batch_flag_ > 0) config_.batch = batch_flag_;
  config_.recompute_norms = recompute_ == "norms" || recompute_ == "all";
  config_.recompute_geglu = recompute_ == "geglu" || recompute_ == "all";
  try {
    config_.validate();
  } catch (const Error& e) {
    throw bench::UsageError(e.what());
  }
  if (overflow_at_ >= 0 && config_.dtype != DType::kFP16)
    throw bench::UsageError(
        "--overflow-at: only fp16 runs scale the loss; bf16 has no overflow "
        "to skip");
  if (overflow_at_ >= 0 && flags.steps > 0 && overflow_at_ >= flags.steps)
    throw bench::UsageError("--overflow-at " + std::to_string(overflow_at_) +
                            ": the run has only " + std::to_string(flags.steps) + " steps");
  if (!op_times_.empty() && flags.graphs != "none")
    throw bench::UsageError("--op-times: times eager ops; give --graphs none (a graph's nodes " +
                            std::string("cannot be timed one by one with events)"));
  if (poison_dead_ && flags.graphs != "none")
    throw bench::UsageError("--poison-dead-buffers: checks eager steps; give --graphs none");
  // The generated data: enough training samples for the batch, at least 64.
  data_samples_ = std::max<int64_t>(64, 2 * config_.batch + 16);
}

nlohmann::ordered_json UnetWorkload::config() const {
  const UnetConfig& c = config_;
  return {{"batch", c.batch},
          {"latent_channels", c.latent_channels},
          {"latent_height", c.latent},
          {"latent_width", c.latent},
          {"base_channels", c.base},
          {"channel_mult", c.mult},
          {"attention_levels", c.attention},
          {"layers_per_block", c.res_blocks},
          {"norm_groups", c.groups},
          {"head_dim", c.head_dim},
          {"context_len", c.context_len},
          {"context_dim", c.context_dim},
          {"time_embed_dim", c.time_dim()},
          {"prediction", "v"},
          {"timesteps", kTrainTimesteps},
          {"overflow_at", overflow_at_},
          {"skip_mode", skip_mode_},
          {"recompute", recompute_}};
}

std::string UnetWorkload::precision() const {
  return config_.dtype == DType::kBF16 ? "bf16" : "fp16";
}

train::TrainingConfig UnetWorkload::training() const {
  train::TrainingConfig t;
  t.adam = AdamWHyper{0.9f, 0.999f, 1e-8f, 0.01f};
  t.schedule.kind = train::LrKind::kWarmupConstant;
  t.schedule.base_lr = static_cast<float>(kLrPerImage * static_cast<double>(config_.batch));
  t.schedule.min_lr = t.schedule.base_lr;
  t.schedule.warmup_steps = kWarmupSteps;
  t.schedule_source = "MLPerf SD v2: 1.25e-7 per image of the global batch (" +
                      std::to_string(config_.batch) +
                      " on one GPU), linear warm-up over 1000 steps, then constant";
  t.clip_norm = 0.0f;  // MLPerf SD does not clip; the norm still finds overflows
  t.skip_with_if = skip_mode_ == "if";
  if (config_.dtype == DType::kFP16) {
    train::LossScalerConfig s;  // PyTorch GradScaler's, as the reference's AMP uses
    s.init_scale = 65536.0f;
    s.growth_factor = 2.0f;
    s.backoff_factor = 0.5f;
    s.growth_interval = 2000;
    s.hysteresis = 1;
    t.loss_scaling = s;
  }
  return t;
}

void UnetWorkload::open_data(const train::RunFlags& flags, std::FILE* out) {
  const UnetConfig& c = config_;
  std::string path = flags.data;
  if (path.empty()) {
    LatentDatasetParams p;
    p.num_samples = data_samples_;
    p.latent_channels = c.latent_channels;
    p.latent_height = p.latent_width = c.latent;
    p.context_len = c.context_len;
    p.context_dim = c.context_dim;
    path = ensure_latent_dataset(p);
  }
  LatentDataShape shape;
  shape.micro_batch = c.batch;
  shape.latent_channels = c.latent_channels;
  shape.latent_height = shape.latent_width = c.latent;
  shape.context_len = c.context_len;
  shape.context_dim = c.context_dim;
  const LatentFile file(path, shape);
  auto d = std::make_shared<UnetData>();
  d->info = file.info();
  d->shape = shape;
  const std::string floor = std::isfinite(d->info.provenance.loss_floor)
                                ? ", loss floor " + std::to_string(d->info.provenance.loss_floor)
                                : std::string();
  if (data_stream_ || d->info.training_samples() > kMaxLoadedSamples) {
    // Every training sample, read batch by batch ahead of the step (the model's LatentStream).
    d->stream = true;
    d->samples = d->info.training_samples();
    data_ = d;
    std::fprintf(out,
                 "# data: %s: %" PRId64
                 " training samples, streamed (a prefetch thread reads 4 "
                 "batches ahead into pinned memory, shuffled per epoch), latent %" PRId64
                 "x%" PRId64 "x%" PRId64 ", context %" PRId64 "x%" PRId64 "%s\n",
                 path.c_str(), d->samples, c.latent_channels, c.latent, c.latent, c.context_len,
                 c.context_dim, floor.c_str());
    return;
  }
  d->samples = d->info.training_samples();
  d->moments.resize(static_cast<size_t>(d->samples * shape.moment_elements()));
  d->text.resize(static_cast<size_t>(d->samples * shape.text_elements()));
  file.read_samples(0, d->samples, d->moments.data(), d->text.data());
  if (c.dtype == DType::kBF16)
    for (uint16_t& v : d->text) v = float_to_bf16_bits(half_bits_to_float(v));
  data_ = d;
  std::fprintf(out,
               "# data: %s: %" PRId64 " training samples (%" PRId64
               " held in pinned memory, shuffled per epoch), latent %" PRId64 "x%" PRId64
               "x%" PRId64 ", context %" PRId64 "x%" PRId64 "%s\n",
               path.c_str(), d->info.training_samples(), d->samples, c.latent_channels, c.latent,
               c.latent, c.context_len, c.context_dim, floor.c_str());
}

std::unique_ptr<train::Model> UnetWorkload::build(Context& ctx, const train::TrainingConfig&,
                                                  const train::RunFlags& flags, std::FILE* out) {
  REPLAY_REQUIRE(data_ != nullptr, "UnetWorkload::build before open_data");
  auto m = std::make_unique<UnetModel>(ctx, config_, data_, overflow_at_, flags.seed);
  std::fprintf(out, "# plans: %s\n", m->plan_summary().c_str());
  if (poison_dead_) {
    m->poison_dead_buffers();
    std::fprintf(out, "# poison: every buffer filled with NaN bytes when its lifetime ends\n");
  }
  if (!op_times_.empty()) {
    m->time_ops(op_times_);
    std::fprintf(out, "# op times: every op timed with CUDA events (syncs every step), to %s\n",
                 op_times_.c_str());
  }
  return m;
}

void UnetWorkload::log_config(bench::MlLogger& log, const train::Model&,
                              const train::TrainingConfig& t) const {
  namespace k = bench::mlkey;
  const char* p = config_.dtype == DType::kBF16 ? "bfloat16" : "float16";
  log.event(k::kGlobalBatchSize, config_.batch);
  log.event(k::kMicroBatchSize, config_.batch);
  log.event(k::kGradientAccumulationSteps, int64_t{1});
  log.event(k::kPrecisionLinear, p);
  log.event(k::kPrecisionAttn, p);
  log.event(k::kOptName, "adamw");
  log.event(k::kOptBaseLearningRate, static_cast<double>(t.schedule.base_lr));
  log.event(k::kOptLearningRateWarmupSteps, t.schedule.warmup_steps);
  log.event(k::kOptAdamwBeta1, static_cast<double>(t.adam.beta1));
  log.event(k::kOptAdamwBeta2, static_cast<double>(t.adam.beta2));
  log.event(k::kOptAdamwEpsilon, static_cast<double>(t.adam.eps));
  log.event(k::kOptAdamwWeightDecay, static_cast<double>(t.adam.weight_decay));
  log.event(k::kTrainSamples, data_ ? data_->info.training_samples() : int64_t{0});
}

}  // namespace replay::unet
