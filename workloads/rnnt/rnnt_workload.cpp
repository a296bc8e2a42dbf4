// rnnt_workload.cpp: replay-rnnt's presets, flags, data, shapes and training configuration.
#include "workloads/rnnt/rnnt_workload.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <map>

#include "common/bench/harness.h"
#include "common/bench/mllog.h"
#include "common/check.h"
#include "workloads/rnnt/speech_batches.h"

namespace replay::rnnt {

namespace {

nlohmann::ordered_json padding_json(const PaddingStats& p) {
  nlohmann::ordered_json j;
  j["batches"] = p.batches;
  j["utterances"] = p.utterances;
  j["frame_ratio"] = p.frame_ratio();
  j["label_ratio"] = p.label_ratio();
  j["lattice_ratio"] = p.lattice_ratio();
  j["lattice_waste"] = p.lattice_ratio() - 1.0;
  if (!p.batches_per_rung.empty()) j["batches_per_rung"] = p.batches_per_rung;
  j["text"] = p.describe();
  return j;
}

}  // namespace

RnntWorkload::RnntWorkload()
    : info_{"replay-rnnt", "rnnt", "RNN-T", "tiny", "utterances", "utt", "rnnt"},
      presets_{{"tiny",
                "RNN-T at small widths (encoder 1+1 LSTM layers of 128 around the time stacking, "
                "prediction 2 of 64, joint 64, 31 labels), batch 16, utterances of 16 to 96 frames",
                12},
               {"mlperf-b192",
                "MLPerf's RNN-T (encoder 2+3 LSTM layers of 1024, prediction 2 of 512, joint 512, "
                "1023 labels + blank, about 49M parameters) at NVIDIA's 192 utterances per GPU, "
                "LibriSpeech-like lengths up to 557 frames and 125 labels",
                20}} {}

void RnntWorkload::add_flags(CLI::App& app) {
  app.add_option("--ladder", ladder_flag_,
                 "rungs of the ladder of padded shapes (frames x labels) the graphs are captured "
                 "at; fewer where rungs coincide")
      ->check(train::integer_in(1, 16));
  app.add_option("--pad", pad_flag_,
                 "exact: each batch at its own shape (the default with --graphs none); ladder: "
                 "the smallest rung that fits (the default with graphs)")
      ->check(CLI::IsMember({"exact", "ladder"}));
  app.add_option("--precision", precision_flag_, "fp16 (with dynamic loss scaling) or bf16")
      ->check(CLI::IsMember({"fp16", "bf16"}));
  app.add_option("--batch", batch_flag_, "utterances per step (0: the preset's)")
      ->check(train::integer_in(0, 4096));
  app.add_option("--decoder", decoder_flag_,
                 "greedy decoding's loop: while (one WHILE conditional node per batch, on the "
                 "device), host (a step, then the host reads the flag) or unrolled (NVIDIA's: a "
                 "graph of 4 steps, the flag read one replay late); host and unrolled with "
                 "--graphs none only")
      ->check(CLI::IsMember({"while", "host", "unrolled"}));
  app.add_option("--eval-graph", eval_graph_flag_,
                 "the evaluation in full mode as one graph (the encoder and the WHILE-node "
                 "decoder: the default with --graphs full) or two (encoder, then decoder)")
      ->check(CLI::IsMember({"one", "two"}));
  app.add_option("--decode-handle", decode_handle_flag_,
                 "the decoder's one-step prediction LSTM on a cuDNN handle of its own (own, the "
                 "default) or on the encoder's (shared: the encoder's cuDNN streams then merge "
                 "two captures, so one evaluation graph is refused; lab/rnnt_one_graph)")
      ->check(CLI::IsMember({"own", "shared"}));
  app.add_option("--while-unroll", while_unroll_flag_,
                 "decode steps in one iteration of the WHILE node's body (the condition is "
                 "tested after them)")
      ->check(train::integer_in(1, 16));
  app.add_option("--optimizer", optimizer_flag_,
                 "lamb (MLPerf's: eps 1e-9, weight decay 1e-3; the mlperf-b192 default) or adamw "
                 "(the same eps and decay; the tiny default)")
      ->check(CLI::IsMember({"lamb", "adamw"}));
  app.add_option("--ema", ema_flag_,
                 "decay of the weights' moving average evaluation decodes with (0: none; "
                 "default 0.999 for mlperf-b192, 0 for tiny)")
      ->check(train::number_in(0.0, 0.999999));
}

void RnntWorkload::resolve(const train::RunFlags& flags) {
  preset_ = flags.preset;
  shape_ = RnntShape{};
  dataset_ = SpeechDatasetParams{};
  if (preset_ == "tiny") {
    // One encoder layer on each side of the time stacking, not MLPerf's 2 + 3: at width 128 the
    // five-layer stack stays on the blank plateau (held-out WER >= 0.96 after 1,500 steps in
    // replay and in PyTorch on the same data), while 1 + 1 learns the synthetic speech in a few
    // hundred steps (workloads/rnnt/README.md, "Learning").
    shape_.enc_pre_layers = 1, shape_.enc_post_layers = 1;
    shape_.enc_hidden = 128, shape_.pred_hidden = 64, shape_.joint_hidden = 64;
    shape_.vocab = 32, shape_.batch = 16;
    dataset_.num_utterances = 512, dataset_.num_eval = 64, dataset_.vocab_size = 31;
    dataset_.min_frames = 16, dataset_.max_frames = 96, dataset_.max_labels = 16;
    dataset_.token_rate = 0.15;
    lamb_ = optimizer_flag_ == "lamb";
    lr_ = lamb_ ? 2e-2 : 3e-3, warmup_epochs_ = 0, hold_epochs_ = 20, gamma_ = 0.9f;
  } else {  // mlperf-b192
    shape_.batch = 192;
    dataset_.num_utterances = 2048 + 128, dataset_.num_eval = 128;
    lamb_ = optimizer_flag_ != "adamw";
    lr_ = lamb_ ? 7e-3 : 1e-3, warmup_epochs_ = 6, hold_epochs_ = 40, gamma_ = 0.915f;
  }
  shape_.ema = preset_ == "tiny" ? 0.0f : 0.999f;
  if (ema_flag_ >= 0) shape_.ema = static_cast<float>(ema_flag_);
  if (batch_flag_ > 0) shape_.batch = batch_flag_;
  dtype_ = precision_flag_ == "bf16" ? DType::kBF16 : DType::kFP16;
  shape_.dtype = dtype_;
  const bool graphs = flags.graphs != "none";
  exact_ = pad_flag_.empty() ? !graphs : pad_flag_ == "exact";
  if (decoder_flag_ != "while" && graphs)
    throw bench::UsageError("--decoder " + decoder_flag_ +
                            ": the host loop reads the device between steps, which a graph "
                            "cannot hold; use it with --graphs none (or --decoder while)");
  if (eval_graph_flag_ == "one" && (flags.graphs != "full" || decoder_flag_ != "while"))
    throw bench::UsageError(
        "--eval-graph one: one evaluation graph needs --graphs full and --decoder while");
  // One evaluation graph in full mode unless asked otherwise: with the decoder's LSTM on the
  // encoder's cuDNN handle, the encoder's cuDNN streams merge the outer capture into the WHILE
  // body's (cudaErrorStreamCaptureMerge), and ending the captures then crashed or hung the driver
  // on an H100 (lab/rnnt_one_graph), so that pairing is refused.
  eval_graph_ =
      !eval_graph_flag_.empty() ? eval_graph_flag_
      : (flags.graphs == "full" && decoder_flag_ == "while" && decode_handle_flag_ == "own")
          ? "one"
          : "two";
  if (eval_graph_ == "one" && decode_handle_flag_ == "shared")
    throw bench::UsageError(
        "--eval-graph one with --decode-handle shared: the encoder's cuDNN streams would merge "
        "the evaluation graph's capture into the WHILE body's, which aborts or hangs the CUDA "
        "driver (lab/rnnt_one_graph); use --decode-handle own or --eval-graph two");
  steps_ = flags.steps;
  seed_ = flags.seed;
  steps_per_epoch_ = std::max<int64_t>(
      1, (dataset_.num_utterances - dataset_.num_eval + shape_.batch - 1) / shape_.batch);
  try {
    shape_.validate();
  } catch (const Error& e) {
    throw bench::UsageError(e.what());
  }
}

nlohmann::ordered_json RnntWorkload::config() const {
  nlohmann::ordered_json j;
  j["feature_dim"] = shape_.feature_dim;
  j["vocab"] = shape_.vocab;
  j["blank"] = shape_.blank();
  j["enc_hidden"] = shape_.enc_hidden;
  j["enc_pre_layers"] = shape_.enc_pre_layers;
  j["enc_post_layers"] = shape_.enc_post_layers;
  j["time_stacking"] = 2;
  j["pred_hidden"] = shape_.pred_hidden;
  j["pred_layers"] = shape_.pred_layers;
  j["joint_hidden"] = shape_.joint_hidden;
  j["batch"] = shape_.batch;
  j["dropout"] = {{"encoder", shape_.enc_dropout},
                  {"prediction", shape_.pred_dropout},
                  {"joint", shape_.joint_dropout}};
  j["precision"] = precision();
  j["ema"] = shape_.ema;
  j["pad"] = exact_ ? "exact" : "ladder";
  j["ladder_rungs_asked"] = ladder_flag_;
  j["decoder"] = decoder_flag_;
  j["eval_graph"] = eval_graph_;
  j["decode_handle"] = decode_handle_flag_;
  j["while_unroll"] = while_unroll_flag_;
  j["optimizer"] = lamb_ ? "lamb" : "adamw";
  if (params_count_ > 0) j["parameters"] = params_count_;
  if (!batching_.shapes.empty()) {
    nlohmann::ordered_json shapes = nlohmann::ordered_json::array();
    for (size_t k = 0; k < batching_.shapes.size(); ++k) {
      nlohmann::ordered_json s;
      s["frames"] = batching_.shapes[k].max_frames;
      s["encoder_frames"] = batching_.shapes[k].max_frames / 2;
      s["labels"] = batching_.shapes[k].max_labels;
      if (k < batches_per_shape_.size()) s["run_batches"] = batches_per_shape_[k];
      if (k < activation_bytes_.size()) s["activation_bytes"] = activation_bytes_[k];
      shapes.push_back(s);
    }
    j["shapes"] = shapes;
    if (batching_.ladder) j["ladder"] = batching_.ladder->describe();
    j["padding_run"] = padding_json(run_padding_);
    j["padding_epoch_exact"] = padding_json(exact_padding_);
    j["padding_epoch_ladder"] = padding_json(ladder_padding_);
  }
  if (eval_log_->utterances > 0) {
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx",
                  static_cast<unsigned long long>(eval_log_->tokens_hash));
    const RnntEvalLog& e = *eval_log_;
    auto per_s = [&](double s) { return s > 0 ? static_cast<double>(e.utterances) / s : 0.0; };
    j["last_eval"] = {{"decoder", decoder_flag_},
                      {"wer", e.wer},
                      {"utterances", e.utterances},
                      {"batches", e.batches},
                      {"hypothesis_labels", e.hypothesis_labels},
                      {"reference_labels", e.reference_labels},
                      {"tokens_hash", hash},
                      // Timed on the device, summed over the batches (rnnt_model.h, RnntEvalLog).
                      {"encode_ms", e.encode_s * 1e3},
                      {"decode_ms", e.decode_s * 1e3},
                      {"encode_utterances_per_s", per_s(e.encode_s)},
                      {"decode_utterances_per_s", per_s(e.decode_s)}};
    nlohmann::ordered_json hist = nlohmann::ordered_json::array();
    for (double s : e.decode_s_history) hist.push_back(s * 1e3);
    j["last_eval"]["decode_ms_every_eval"] = hist;
  }
  j["dataset"] = {{"utterances", dataset_.num_utterances}, {"eval", dataset_.num_eval},
                  {"min_frames", dataset_.min_frames},     {"max_frames", dataset_.max_frames},
                  {"max_labels", dataset_.max_labels},     {"vocab_size", dataset_.vocab_size}};
  return j;
}

train::TrainingConfig RnntWorkload::training() const {
  train::TrainingConfig t;
  // MLPerf RNN-T trains with LAMB (eps 1e-9, weight decay 1e-3); --optimizer adamw keeps the
  // same epsilon and decay.
  t.adam = AdamWHyper{0.9f, 0.999f, 1e-9f, 1e-3f};
  t.lamb = LambHyper{0.9f, 0.999f, 1e-9f, 1e-3f};
  t.optimizer =
      lamb_ ? train::TrainingConfig::Optimizer::kLamb : train::TrainingConfig::Optimizer::kAdamW;
  t.schedule.kind = train::LrKind::kRnntWarmupHoldDecay;
  t.schedule.base_lr = static_cast<float>(lr_);
  t.schedule.min_lr = 1e-5f;
  t.schedule.steps_per_epoch = steps_per_epoch_;
  t.schedule.warmup_epochs = warmup_epochs_;
  t.schedule.hold_epochs = hold_epochs_;
  t.schedule.gamma = gamma_;
  t.clip_norm = 1.0f;
  if (dtype_ == DType::kFP16) {
    train::LossScalerConfig s;
    s.init_scale = 32768.0f;
    s.growth_interval = 1000;
    t.loss_scaling = s;
  }
  t.schedule_source = "MLPerf RNN-T's warm-up, hold and exponential decay by epoch (" +
                      std::to_string(steps_per_epoch_) + " steps an epoch)";
  return t;
}

void RnntWorkload::open_data(const train::RunFlags& flags, std::FILE* out) {
  const std::string path = flags.data.empty() ? ensure_speech_dataset(dataset_) : flags.data;
  SpeechShape sshape;
  sshape.feature_dim = shape_.feature_dim;
  sshape.vocab_size = shape_.vocab - 1;
  file_ = std::make_shared<SpeechFile>(path, sshape);
  const SpeechFileInfo& info = file_->info();
  if (info.num_train() < 1) throw Error("replay", "invalid data", path + ": no training split");
  steps_per_epoch_ = std::max<int64_t>(1, (info.num_train() + shape_.batch - 1) / shape_.batch);

  sampler_ = SamplerOptions{};
  sampler_.batch_size = shape_.batch;
  sampler_.seed = seed_;
  SpeechSampler sampler(file_->frame_lengths(), 0, info.num_train(), sampler_);
  const std::vector<BatchLengths> epoch =
      epoch_batches(sampler, 0, file_->frame_lengths(), file_->label_lengths());
  LadderOptions lo;
  lo.rungs = ladder_flag_;
  lo.granule = 8;
  for (int64_t i = 0; i < info.num_train(); ++i) {
    lo.cover_frames = std::max<int64_t>(lo.cover_frames, file_->frame_length(i));
    lo.cover_labels = std::max<int64_t>(lo.cover_labels, file_->label_length(i));
  }
  const Ladder ladder = Ladder::fit_to_batches(epoch, lo);
  ladder_padding_ = ladder_padding(ladder, epoch);

  batching_ = RnntBatching{};
  batching_.exact = exact_;
  exact_padding_ = PaddingStats{};
  for (const BatchLengths& b : epoch)
    exact_padding_.add(b, batching_.exact_shape(b.max_frames(), b.max_labels()));
  // The run's batches: positions 0 .. steps - 1 of the sampler's order.
  std::vector<BatchLengths> run;
  std::vector<int64_t> idx(static_cast<size_t>(shape_.batch));
  for (int64_t s = 0; s < std::max<int64_t>(steps_, 1); ++s) {
    sampler.batch(s, idx.data());
    run.push_back(
        batch_lengths(file_->frame_lengths(), file_->label_lengths(), idx.data(), shape_.batch));
  }
  if (exact_) {
    std::vector<Rung> shapes;
    for (const BatchLengths& b : run) {
      const Rung r = batching_.exact_shape(b.max_frames(), b.max_labels());
      if (std::find(shapes.begin(), shapes.end(), r) == shapes.end()) shapes.push_back(r);
    }
    std::sort(shapes.begin(), shapes.end(), [](const Rung& a, const Rung& b) {
      return a.max_frames != b.max_frames ? a.max_frames < b.max_frames
                                          : a.max_labels < b.max_labels;
    });
    batching_.shapes = shapes;
  } else {
    batching_.ladder = ladder;
    batching_.shapes = ladder.rungs();
  }
  run_padding_ = PaddingStats{};
  batches_per_shape_.assign(batching_.shapes.size(), 0);
  for (const BatchLengths& b : run) {
    const int k = batching_.key_of(b.max_frames(), b.max_labels());
    run_padding_.add(b, batching_.shapes[static_cast<size_t>(k)], k);
    batches_per_shape_[static_cast<size_t>(k)] += 1;
  }
  std::fprintf(out,
               "# data: %s: %" PRId64 " training and %" PRId64
               " held-out utterances, frames %" PRId64 "..%" PRId64 ", labels %" PRId64 "..%" PRId64
               ", %" PRId64 " batches an epoch\n",
               path.c_str(), info.num_train(), info.num_eval, info.min_frames, info.max_frames,
               info.min_labels, info.max_labels, steps_per_epoch_);
  std::fprintf(
      out, "# shapes: %s, %zu (%s)\n", exact_ ? "exact" : "ladder", batching_.shapes.size(),
      exact_ ? "each batch's own, planned for the run's batches" : ladder.describe().c_str());
  std::fprintf(out, "# padding of the run's batches: %s\n", run_padding_.describe().c_str());
  std::fprintf(out, "# padding of one epoch: exact %.3f, ladder %.3f (lattice, padded / real)\n",
               exact_padding_.lattice_ratio(), ladder_padding_.lattice_ratio());
}

std::unique_ptr<train::Model> RnntWorkload::build(Context& ctx, const train::TrainingConfig&,
                                                  const train::RunFlags&, std::FILE* out) {
  REPLAY_REQUIRE(file_ != nullptr, "RnntWorkload::build before open_data");
  RnntData data;
  data.file = file_;
  data.sampler = sampler_;
  data.batching = batching_;
  data.decoder = decoder_flag_ == "host"       ? DecoderKind::kHost
                 : decoder_flag_ == "unrolled" ? DecoderKind::kUnrolled
                                               : DecoderKind::kWhile;
  data.eval_one_graph = eval_graph_ == "one";
  data.decode_own_handle = decode_handle_flag_ == "own";
  data.while_unroll = while_unroll_flag_;
  data.eval_log = eval_log_;
  auto model = std::make_unique<RnntModel>(ctx, shape_, std::move(data));
  params_count_ = model->total_params();
  activation_bytes_.clear();
  for (int k = 0; k < static_cast<int>(batching_.shapes.size()); ++k) {
    activation_bytes_.push_back(model->activation_bytes(k));
    const Rung& r = batching_.shapes[static_cast<size_t>(k)];
    std::fprintf(out,
                 "# shape %d: %" PRId64 " frames (%" PRId64 " encoder) x %" PRId64
                 " labels, %" PRId64 " of the run's batches, activations %.1f MiB\n",
                 k, r.max_frames, r.max_frames / 2, r.max_labels,
                 batches_per_shape_[static_cast<size_t>(k)],
                 static_cast<double>(activation_bytes_.back()) / (1 << 20));
  }
  return model;
}

void RnntWorkload::log_config(bench::MlLogger& log, const train::Model&,
                              const train::TrainingConfig& t) const {
  namespace k = bench::mlkey;
  log.event(k::kGlobalBatchSize, shape_.batch);
  const bool lamb = t.optimizer == train::TrainingConfig::Optimizer::kLamb;
  log.event(k::kOptName, lamb ? "lamb" : "adamw");
  log.event(k::kOptBaseLearningRate, static_cast<double>(t.schedule.base_lr));
  log.event(k::kOptWeightDecay,
            static_cast<double>(lamb ? t.lamb.weight_decay : t.adam.weight_decay));
  log.event(k::kTrainSamples, file_ ? file_->info().num_train() : 0);
}

}  // namespace replay::rnnt
