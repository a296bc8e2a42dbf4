// replay-rnnt's workload on the CPU (no GPU needed): the presets and flags resolve (and bad ones
// are refused before any work), --print-config's shapes, and the run's padded shapes from a
// generated tiny speech file: the fitted ladder holds every batch of the run, exact shapes are each
// batch's own (frames rounded up to even), the padding statistics and the per-shape batch counts
// agree.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "train/driver.h"
#include "workloads/rnnt/rnnt_workload.h"
#include "workloads/rnnt/speech_batches.h"

namespace replay::rnnt {
namespace {

train::RunFlags resolved(RnntWorkload& w, std::vector<std::string> args) {
  const std::optional<train::RunFlags> f = train::parse(w, args);
  EXPECT_TRUE(f.has_value());
  return train::resolve(w, *f);
}

class RnntWorkloadCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/replay-rnnt-cpu-XXXXXX";
    dir_ = mkdtemp(tmpl);
    setenv("REPLAY_DATA_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    unsetenv("REPLAY_DATA_DIR");
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(RnntWorkloadCpu, PresetsResolveAndBadFlagsAreRefused) {
  {
    RnntWorkload w;
    resolved(w, {"--preset", "mlperf-b192", "--seed", "1"});
    EXPECT_EQ(w.shape().enc_hidden, 1024);
    EXPECT_EQ(w.shape().pred_hidden, 512);
    EXPECT_EQ(w.shape().vocab, 1024);
    EXPECT_EQ(w.shape().batch, 192);
    EXPECT_EQ(w.precision(), "fp16");
    const nlohmann::ordered_json c = w.config();
    EXPECT_EQ(c["pad"], "ladder");  // graphs default to full
    const train::TrainingConfig t = w.training();
    EXPECT_EQ(t.optimizer, train::TrainingConfig::Optimizer::kLamb);  // MLPerf's
    EXPECT_EQ(t.lamb.eps, 1e-9f);
    EXPECT_EQ(t.lamb.weight_decay, 1e-3f);
    EXPECT_FLOAT_EQ(w.shape().ema, 0.999f);
  }
  {
    RnntWorkload w;
    resolved(w, {"--preset", "tiny", "--graphs", "none", "--precision", "bf16", "--seed", "1"});
    EXPECT_EQ(w.precision(), "bf16");
    EXPECT_FALSE(train::training_config(w, resolved(w, {"--preset", "tiny", "--graphs", "none",
                                                        "--precision", "bf16", "--seed", "1"}))
                     .loss_scaling.has_value());
    EXPECT_EQ(w.config()["pad"], "exact");
    EXPECT_EQ(w.config()["eval_graph"], "two");
    EXPECT_EQ(w.config()["decode_handle"], "own");
  }
  {
    RnntWorkload w;
    resolved(w, {"--preset", "tiny", "--graphs", "full", "--eval-graph", "one", "--seed", "1"});
    EXPECT_EQ(w.config()["eval_graph"], "one");
  }
  {
    RnntWorkload w;  // one evaluation graph is full mode's default
    resolved(w, {"--preset", "tiny", "--graphs", "full", "--seed", "1"});
    EXPECT_EQ(w.config()["eval_graph"], "one");
  }
  {
    RnntWorkload w;  // but not with the encoder's handle
    resolved(w, {"--preset", "tiny", "--graphs", "full", "--decode-handle", "shared"});
    EXPECT_EQ(w.config()["eval_graph"], "two");
  }
  // A workload parses its flags once (its options keep their values), so one each.
  const std::vector<std::vector<std::string>> bad = {
      {"--graphs", "full", "--decoder", "host"},
      {"--graphs", "layer", "--decoder", "unrolled"},
      {"--pad", "sideways"},
      {"--ladder", "0"},
      {"--precision", "fp8"},
      {"--decoder", "beam"},
      {"--graphs", "layer", "--eval-graph", "one"},
      {"--graphs", "none", "--eval-graph", "one"},
      {"--eval-graph", "three"},
      {"--decode-handle", "borrowed"},
      {"--while-unroll", "0"},
      {"--graphs", "full", "--eval-graph", "one", "--decode-handle", "shared"}};
  for (const auto& args : bad) {
    RnntWorkload fresh;
    EXPECT_THROW(resolved(fresh, args), bench::UsageError) << args[0] << " " << args[1];
  }
  RnntWorkload w;
  const train::TrainingConfig t =
      train::training_config(w, resolved(w, {"--preset", "tiny", "--seed", "1"}));
  EXPECT_EQ(t.schedule.kind, train::LrKind::kRnntWarmupHoldDecay);
  EXPECT_EQ(t.optimizer, train::TrainingConfig::Optimizer::kAdamW);  // tiny's default
  EXPECT_EQ(w.shape().ema, 0.0f);
  EXPECT_TRUE(t.loss_scaling.has_value());  // fp16
  EXPECT_EQ(t.adam.eps, 1e-9f);
  EXPECT_EQ(t.adam.weight_decay, 1e-3f);
}

TEST_F(RnntWorkloadCpu, TheLadderHoldsEveryBatchAndExactShapesAreTheBatchesOwn) {
  for (const char* pad : {"ladder", "exact"}) {
    SCOPED_TRACE(pad);
    RnntWorkload w;
    const train::RunFlags f = resolved(w, {"--preset", "tiny", "--graphs", "none", "--pad", pad,
                                           "--steps", "40", "--seed", "5", "--ladder", "3"});
    w.open_data(f, stdout);
    const RnntBatching& b = w.batching();
    ASSERT_FALSE(b.shapes.empty());
    EXPECT_EQ(b.exact, std::string(pad) == "exact");
    if (!b.exact) {
      ASSERT_TRUE(b.ladder.has_value());
      EXPECT_LE(b.ladder->size(), 3);
    }
    for (const Rung& r : b.shapes) {
      EXPECT_EQ(r.max_frames % 2, 0);
      EXPECT_GE(r.max_labels, 1);
    }
    // Redraw the run's batches: each takes a shape that holds it, and an exact one is its own.
    const SpeechFile file(default_speech_dataset_path(w.dataset(), dir_), SpeechShape{240, 31});
    SamplerOptions so;
    so.batch_size = w.shape().batch;
    so.seed = 5;
    SpeechSampler sampler(file.frame_lengths(), 0, file.info().num_train(), so);
    const nlohmann::ordered_json c = w.config();
    std::vector<int64_t> count(b.shapes.size(), 0);
    for (int64_t s = 0; s < 40; ++s) {
      const std::vector<int64_t> idx = sampler.batch(s);
      const BatchLengths bl = batch_lengths(file.frame_lengths(), file.label_lengths(), idx.data(),
                                            static_cast<int64_t>(idx.size()));
      const int k = b.key_of(bl.max_frames(), bl.max_labels());
      ASSERT_GE(k, 0);
      const Rung& r = b.shapes[static_cast<size_t>(k)];
      EXPECT_GE(r.max_frames, bl.max_frames());
      EXPECT_GE(r.max_labels, bl.max_labels());
      if (b.exact) {
        EXPECT_EQ(r.max_frames, (bl.max_frames() + 1) / 2 * 2);
        EXPECT_EQ(r.max_labels, bl.max_labels());
      }
      count[static_cast<size_t>(k)] += 1;
    }
    for (size_t k = 0; k < b.shapes.size(); ++k)
      EXPECT_EQ(c["shapes"][k]["run_batches"].get<int64_t>(), count[k]) << k;
    const double run = c["padding_run"]["lattice_ratio"].get<double>();
    EXPECT_GE(run, 1.0);
    EXPECT_GE(c["padding_epoch_ladder"]["lattice_ratio"].get<double>(),
              c["padding_epoch_exact"]["lattice_ratio"].get<double>());
  }
}

}  // namespace
}  // namespace replay::rnnt
