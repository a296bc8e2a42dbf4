// replay-rnnt's tiny preset on the GPU, through the shared driver (train::run):
// - RnntModes: none, layer and full train 12 steps on the same ladder (--pad ladder, dropout on)
//   with bit-identical losses, fp16 weights and fp32 master weights (the graph modes verify step 0
//   eagerly against the graphs too); layer captures the six LSTM regions per rung and full one
//   graph per rung; the loss falls.
// - RnntExact: none at each batch's own shape (its default) trains with finite, falling losses.
// - RnntBf16: --precision bf16 (no loss scaling) in full mode trains with finite losses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/support/compare.h"
#include "train/driver.h"
#include "workloads/rnnt/rnnt_workload.h"

namespace replay::rnnt {
namespace {

train::RunResult run(const std::vector<std::string>& extra, int* shapes = nullptr) {
  RnntWorkload w;
  std::vector<std::string> args = {"--preset", "tiny",    "--seed", "4242",     "--log-interval",
                                   "4",        "--steps", "12",     "--warmup", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  const std::optional<train::RunFlags> parsed = train::parse(w, args);
  EXPECT_TRUE(parsed.has_value());
  const train::RunFlags f = train::resolve(w, *parsed);
  train::RunOptions options;
  options.measure_peak = false;
  train::RunResult r = train::run(w, f, stdout, options);
  if (shapes) *shapes = static_cast<int>(w.batching().shapes.size());
  return r;
}

void expect_falls(const std::vector<float>& losses, const std::string& what) {
  ASSERT_EQ(losses.size(), 12u) << what;
  for (float l : losses) ASSERT_TRUE(std::isfinite(l)) << what;
  const double first = (losses[0] + losses[1] + losses[2]) / 3.0,
               last = (losses[9] + losses[10] + losses[11]) / 3.0;
  EXPECT_LT(last, first) << what << ": the loss did not fall: " << first << " -> " << last;
}

void expect_identical(const train::RunResult& a, const train::RunResult& b,
                      const std::string& what) {
  const auto& la = a.report.losses;
  const auto& lb = b.report.losses;
  ASSERT_EQ(la.size(), lb.size()) << what;
  EXPECT_TRUE(test::bit_equal(what + " losses", la.data(), lb.data(), la.size() * sizeof(float)));
  ASSERT_TRUE(a.report.weights_hash.has_value() && b.report.weights_hash.has_value());
  EXPECT_EQ(*a.report.weights_hash, *b.report.weights_hash) << what << ": fp16 weights differ";
  EXPECT_EQ(a.master_hash, b.master_hash) << what << ": fp32 master weights differ";
}

TEST(RnntModes, LossesAndWeightsAreBitIdenticalOnTheLadderAndTheLossFalls) {
  int rungs = 0;
  const train::RunResult none = run({"--graphs", "none", "--pad", "ladder"}, &rungs);
  expect_falls(none.report.losses, "none");
  EXPECT_EQ(none.report.graph_count, 0);
  ASSERT_GE(rungs, 2) << "the tiny ladder should have several rungs";
  const train::RunResult layer = run({"--graphs", "layer", "--verify-graphs"});
  expect_identical(none, layer, "layer vs none");
  EXPECT_EQ(layer.report.graph_count, 6 * rungs);  // 3 LSTM forward and 3 backward regions
  const train::RunResult full = run({"--graphs", "full", "--verify-graphs"});
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.report.graph_count, rungs);
  EXPECT_GT(full.report.graph_nodes, layer.report.graph_nodes / 2);
}

TEST(RnntExact, NoneAtEachBatchsOwnShapeTrains) {
  int shapes = 0;
  const train::RunResult exact = run({"--graphs", "none"}, &shapes);
  expect_falls(exact.report.losses, "none --pad exact");
  EXPECT_GE(shapes, 2);
}

TEST(RnntBf16, FullGraphTrainsInBf16) {
  const train::RunResult r = run({"--graphs", "full", "--precision", "bf16"});
  expect_falls(r.report.losses, "bf16 full");
}

}  // namespace
}  // namespace replay::rnnt
