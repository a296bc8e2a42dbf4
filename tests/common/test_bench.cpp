// Benchmark statistics: percentiles as documented (linear interpolation between order statistics).
#include "common/bench/timing.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace replay::bench
