// Benchmark statistics: percentiles as documented (linear interpolation between order statistics),
// and the count of timed calls a time budget leaves.
#include "common/bench/timing.h"

#include <gtest/gtest.h>

#include <cmath>

namespace replay::bench {
namespace {

TEST(BenchStats, PercentilesOfKnownSamples) {
  std::vector<double> s;
  for (int i = 10; i >= 0; --i) s.push_back(i);  // 0..10, unsorted
  const Stats r = summarize(s);
  EXPECT_EQ(r.count, 11);
  EXPECT_DOUBLE_EQ(r.median, 5.0);
  EXPECT_DOUBLE_EQ(r.p10, 1.0);
  EXPECT_DOUBLE_EQ(r.p90, 9.0);
  EXPECT_DOUBLE_EQ(r.mean, 5.0);
  EXPECT_DOUBLE_EQ(r.min, 0.0);
  EXPECT_DOUBLE_EQ(r.max, 10.0);
}

TEST(BenchStats, InterpolatesAndHandlesEmpty) {
  const Stats r = summarize({1.0, 2.0});
  EXPECT_DOUBLE_EQ(r.median, 1.5);
  EXPECT_NEAR(r.p10, 1.1, 1e-12);
  EXPECT_EQ(summarize({}).count, 0);
}

TEST(BenchBudget, RepeatsWithinABudget) {
  // floor(budget / call), at least min(min_repeats, max_repeats), at most max_repeats.
  EXPECT_EQ(repeats_within(25.0, 2.25, 5, 50), 11);
  EXPECT_EQ(repeats_within(25.0, 5.1, 5, 50), 5);  // 4.9 calls fit: the floor of 5
  EXPECT_EQ(repeats_within(25.0, 50.0, 5, 50), 5);
  EXPECT_EQ(repeats_within(25.0, 0.02, 5, 50), 50);  // 1250 fit: max_repeats
  EXPECT_EQ(repeats_within(25.0, 10.0, 5, 3), 3);    // fewer repeats than the floor
  EXPECT_EQ(repeats_within(0.0, 2.25, 5, 50), 50);   // no budget
  EXPECT_EQ(repeats_within(25.0, 0.0, 5, 50), 50);   // too fast to time
  EXPECT_EQ(repeats_within(25.0, std::nan(""), 5, 50), 50);
  EXPECT_EQ(kMinBudgetRepeats, 5);  // scripts/pytorch_baseline.py's MIN_BUDGET_REPEATS
}

}  // namespace
}  // namespace replay::bench
