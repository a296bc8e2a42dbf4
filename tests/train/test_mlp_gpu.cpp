// The example workload (tests/train/mlp_workload.h), a model that is not a transformer, through the
// same driver as every replay binary: none, layer and full give bit-identical losses, weights,
// master weights and held-out evaluations, with the graph counts each mode implies, and the loss
// falls; with dynamic loss scaling the same; the JSON summary carries the evaluations.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "tests/support/compare.h"
#include "tests/train/mlp_workload.h"
#include "train/driver.h"

namespace replay::example {
namespace {

train::RunResult run_mlp(const std::string& mode, const std::vector<std::string>& extra) {
  MlpWorkload w;
  std::vector<std::string> args = {"--graphs",       mode, "--seed",          "77",
                                   "--steps",        "24", "--warmup",        "2",
                                   "--log-interval", "8",  "--eval-interval", "12"};
  if (mode != "none") args.push_back("--verify-graphs");
  args.insert(args.end(), extra.begin(), extra.end());
  const std::optional<train::RunFlags> f = train::parse(w, args);
  EXPECT_TRUE(f.has_value());
  train::RunOptions options;
  options.measure_peak = false;
  return train::run(w, train::resolve(w, *f), stdout, options);
}

void expect_identical(const train::RunResult& a, const train::RunResult& b,
                      const std::string& what) {
  const auto& la = a.report.losses;
  const auto& lb = b.report.losses;
  ASSERT_EQ(la.size(), lb.size()) << what;
  EXPECT_TRUE(test::bit_equal(what + " losses", la.data(), lb.data(), la.size() * sizeof(float)));
  EXPECT_EQ(*a.report.weights_hash, *b.report.weights_hash) << what << ": weights differ";
  EXPECT_EQ(a.master_hash, b.master_hash) << what << ": fp32 master weights differ";
  ASSERT_EQ(a.report.evals.size(), b.report.evals.size()) << what;
  for (size_t i = 0; i < a.report.evals.size(); ++i)
    EXPECT_EQ(a.report.evals[i].value, b.report.evals[i].value) << what << ": evaluation " << i;
}

void expect_modes(const std::vector<std::string>& extra) {
  const train::RunResult none = run_mlp("none", extra);
  const std::vector<float>& losses = none.report.losses;
  ASSERT_EQ(losses.size(), 24u);
  for (float l : losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_GT(losses.front(), 2.0f) << "a fresh classifier is near ln 16 = 2.77";
  const double first = (losses[0] + losses[1] + losses[2]) / 3.0,
               last = (losses[21] + losses[22] + losses[23]) / 3.0;
  EXPECT_LT(last, first - 0.3) << "the loss did not fall: " << first << " -> " << last;
  ASSERT_EQ(none.report.evals.size(), 2u);  // after steps 12 and 24
  EXPECT_EQ(none.report.evals[0].step, 12);
  EXPECT_EQ(none.report.evals[1].samples, 1024);
  EXPECT_LT(none.report.evals[1].value, none.report.evals[0].value) << "held-out loss falls";
  EXPECT_EQ(none.report.graph_count, 0);

  const train::RunResult layer = run_mlp("layer", extra);
  expect_identical(none, layer, "layer vs none");
  EXPECT_EQ(layer.report.graph_count, 4);  // forward and backward of 2 hidden layers
  const train::RunResult full = run_mlp("full", extra);
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.report.graph_count, 1);
}

TEST(MlpWorkload, ModesAreBitIdenticalTheLossFallsAndEvaluationsAgree) {
  expect_modes({});
}

TEST(MlpWorkload, WithDynamicLossScalingToo) {
  expect_modes({"--loss-scaling"});
}

TEST(MlpWorkload, TheJsonSummaryCarriesTheEvaluations) {
  MlpWorkload w;
  const std::string json =
      ::testing::TempDir() + "mlp_summary_" + std::to_string(::getpid()) + ".json";
  const std::optional<train::RunFlags> f =
      train::parse(w, {"--graphs", "full", "--seed", "3", "--steps", "6", "--eval-interval", "3",
                       "--eval-samples", "512", "--json", json});
  ASSERT_TRUE(f.has_value());
  train::RunOptions options;
  options.measure_peak = false;
  train::run(w, train::resolve(w, *f), stdout, options);
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["tool"], "replay-mlp-example");
  EXPECT_EQ(j["config"]["hidden"], 128);
  EXPECT_EQ(j["config"]["seed"], 3);
  EXPECT_GT(j["throughput"]["samples_per_s"].get<double>(), 0.0);
  EXPECT_EQ(j["evaluation"]["metric"], "loss");
  ASSERT_EQ(j["evaluation"]["results"].size(), 2u);
  EXPECT_EQ(j["evaluation"]["results"][0]["step"], 3);
  EXPECT_EQ(j["evaluation"]["results"][0]["samples"], 512);
  EXPECT_TRUE(j["evaluation"]["results"][1]["value"].is_number());
  std::remove(json.c_str());

  MlpWorkload too_many;  // more held-out samples than the split has: refused before the steps
  const std::optional<train::RunFlags> g =
      train::parse(too_many, {"--steps", "2", "--eval-interval", "1", "--eval-samples", "100000"});
  ASSERT_TRUE(g.has_value());
  EXPECT_THROW(train::run(too_many, train::resolve(too_many, *g), stdout, options),
               bench::UsageError);
}

}  // namespace
}  // namespace replay::example
