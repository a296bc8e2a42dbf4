// Checkpoints through the driver, on the example workload (tests/train/mlp_workload.h): 20 steps
// in one run give the same losses, evaluations, weights, master weights and final checkpoint data
// as 10 steps, a save, a load and 10 more, in none, layer and full mode, with and without dynamic
// loss scaling, and across modes; a checkpoint of another model shape, a corrupt one or a seed that
// is not the checkpoint's is refused before step 0.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "common/safetensors.h"
#include "tests/support/compare.h"
#include "tests/train/mlp_workload.h"
#include "train/checkpoint.h"
#include "train/driver.h"

namespace replay::example {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/replay-ckpt-gpu-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

train::RunResult run_mlp(const std::vector<std::string>& args) {
  MlpWorkload w;
  std::vector<std::string> all = {"--warmup", "2", "--log-interval", "5", "--eval-interval", "10"};
  all.insert(all.end(), args.begin(), args.end());
  const std::optional<train::RunFlags> f = train::parse(w, all);
  EXPECT_TRUE(f.has_value());
  train::RunOptions options;
  options.measure_peak = false;
  return train::run(w, train::resolve(w, *f), stdout, options);
}

std::string data_hash(const std::string& path) {
  return safetensors::Reader(path).meta(safetensors::kDataHashKey);
}

// One mode's 20 straight steps against 10 + load + 10 (the load in `resume_mode`).
void expect_resume_bit_exact(const std::string& mode, const std::string& resume_mode,
                             const std::vector<std::string>& extra) {
  SCOPED_TRACE(mode + " resumed in " + resume_mode);
  TempDir dir;
  std::vector<std::string> straight = {"--graphs",        mode, "--seed", "77",
                                       "--steps",         "20", "--save", dir / "a",
                                       "--save-interval", "10"};
  straight.insert(straight.end(), extra.begin(), extra.end());
  const train::RunResult whole = run_mlp(straight);
  ASSERT_EQ(whole.report.losses.size(), 20u);
  ASSERT_EQ(whole.report.checkpoints.size(), 2u);
  EXPECT_EQ(whole.report.checkpoints[0].step, 10);
  EXPECT_EQ(whole.report.checkpoints[1].path, dir / "a/step-00000020.safetensors");

  // No --seed: a resumed run takes its checkpoint's.
  std::vector<std::string> resumed = {"--graphs", resume_mode, "--steps",
                                      "10",       "--load",    dir / "a/step-00000010.safetensors",
                                      "--save",   dir / "b"};
  resumed.insert(resumed.end(), extra.begin(), extra.end());
  const train::RunResult half = run_mlp(resumed);
  ASSERT_EQ(half.report.losses.size(), 10u);
  EXPECT_EQ(half.report.first_step, 10);
  EXPECT_TRUE(test::bit_equal("losses of steps 10-19", whole.report.losses.data() + 10,
                              half.report.losses.data(), 10 * sizeof(float)));
  EXPECT_EQ(*whole.report.weights_hash, *half.report.weights_hash) << "weights after step 20";
  EXPECT_EQ(whole.master_hash, half.master_hash) << "fp32 master weights after step 20";
  ASSERT_EQ(whole.report.evals.size(), 2u);
  ASSERT_EQ(half.report.evals.size(), 1u);
  EXPECT_EQ(half.report.evals[0].step, 20);
  EXPECT_EQ(whole.report.evals[1].value, half.report.evals[0].value) << "held-out loss at 20";
  // Everything the step carries (Adam's moments, the scaler, the RNG, the data cursor) too.
  EXPECT_EQ(data_hash(dir / "a/step-00000020.safetensors"),
            data_hash(dir / "b/step-00000020.safetensors"));
}

TEST(Checkpoint, ResumeIsBitExactInEveryMode) {
  for (const char* mode : {"none", "layer", "full"}) expect_resume_bit_exact(mode, mode, {});
}

TEST(Checkpoint, ResumeIsBitExactWithDynamicLossScaling) {
  expect_resume_bit_exact("full", "full", {"--loss-scaling"});
  expect_resume_bit_exact("layer", "layer", {"--loss-scaling"});
}

TEST(Checkpoint, AnEagerCheckpointResumesInAGraphedRun) {
  expect_resume_bit_exact("none", "full", {});
}

TEST(Checkpoint, TheFileHoldsWhatPyTorchNeedsByName) {
  TempDir dir;
  run_mlp({"--graphs", "full", "--seed", "5", "--steps", "4", "--save", dir / "c"});
  const safetensors::Reader r(dir / "c/step-00000004.safetensors");
  EXPECT_EQ(r.meta("format"), "replay-checkpoint");
  EXPECT_EQ(r.meta("iteration"), "4");
  EXPECT_EQ(r.meta("optimizer_step"), "4");
  EXPECT_EQ(r.meta("preset"), "tiny");
  EXPECT_EQ(r.meta("seed"), "5");
  EXPECT_NE(r.meta("config").find("\"replay-mlp-example\""), std::string::npos);
  for (const char* name : {"train.step", "train.iteration", "train.loss_scale", "data.position",
                           "rng.data-parallel", "rng.tensor-parallel", "rng.expert-parallel"})
    EXPECT_NE(r.find(name), nullptr) << name;
  int64_t step = 0, position = 0;
  r.read(*r.find("train.step"), &step);
  r.read(*r.find("data.position"), &position);
  EXPECT_EQ(step, 4);
  EXPECT_EQ(position, 4) << "the next batch is the fifth";
  int weights = 0, masters = 0, moments = 0;
  for (const safetensors::TensorEntry& e : r.tensors()) {
    if (e.name.rfind("optimizer.master.", 0) == 0) {
      ++masters;
      EXPECT_EQ(e.dtype, DType::kFP32);
    } else if (e.name.rfind("optimizer.exp_avg", 0) == 0) {
      ++moments;
    } else if (e.name.find('.') != std::string::npos && e.name.rfind("train.", 0) != 0 &&
               e.name.rfind("rng.", 0) != 0 && e.name.rfind("data.", 0) != 0) {
      ++weights;
      EXPECT_EQ(e.dtype, DType::kBF16) << e.name;
    }
  }
  EXPECT_GT(weights, 0);
  EXPECT_EQ(masters, weights);
  EXPECT_EQ(moments, 2 * weights);
}

std::string usage_error(const std::vector<std::string>& args) {
  try {
    run_mlp(args);
  } catch (const bench::UsageError& e) {
    return e.what();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Checkpoint, AMismatchedOrCorruptCheckpointFailsBeforeStepZero) {
  TempDir dir;
  run_mlp({"--graphs", "none", "--seed", "9", "--steps", "2", "--save", dir / "d"});
  const std::string ckpt = dir / "d/step-00000002.safetensors";

  std::string e = usage_error({"--steps", "2", "--load", ckpt, "--width", "256"});
  EXPECT_NE(e.find("is [128, 64] in " + ckpt + ", this run needs [256, 64]"), std::string::npos)
      << e;
  e = usage_error({"--steps", "2", "--load", ckpt, "--seed", "10"});
  EXPECT_NE(e.find("was trained with seed 9, this run has --seed 10"), std::string::npos) << e;

  // One flipped bit in the data: refused by the content hash.
  std::string bytes;
  {
    std::ifstream in(ckpt, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    bytes = s.str();
  }
  bytes[bytes.size() - 100] ^= 0x01;
  {
    std::ofstream out(ckpt, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  e = usage_error({"--steps", "2", "--load", ckpt});
  EXPECT_NE(e.find("corrupt"), std::string::npos) << e;
  // Truncated.
  {
    std::ofstream out(ckpt, std::ios::binary | std::ios::trunc);
    out << bytes.substr(0, bytes.size() / 2);
  }
  e = usage_error({"--steps", "2", "--load", ckpt});
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
}

}  // namespace
}  // namespace replay::example
