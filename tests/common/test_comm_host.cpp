// The step's collective timings on the CPU: bus bandwidth as nccl-tests computes it and the
// grouping of timed calls by kind, dtype and size (common/comm.h summarize_timings).
#include <gtest/gtest.h>

#include <vector>

#include "common/check.h"
#include "common/comm.h"

namespace replay::comm {
namespace {

TEST(CollectiveTimings, BusBandwidthFactorsAreNcclTests) {
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Kind::kAllReduce, 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Kind::kAllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Kind::kReduceScatter, 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Kind::kAllGather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Kind::kAllToAll, 2), 0.5);
}

// The all-to-all (expert parallelism): its size is the whole send buffer, count per peer x ranks,
// and the record the capture check compares names it without a reduction.
TEST(CollectiveTimings, AllToAllIsCountedAsItsWholeSendBuffer) {
  EXPECT_EQ(collective_bytes(Kind::kAllToAll, 1000, ncclBfloat16, 2), 4000u);
  EXPECT_EQ(collective_bytes(Kind::kAllToAll, 16, ncclInt32, 4), 256u);
  EXPECT_STREQ(kind_name(Kind::kAllToAll), "all_to_all");
  const CollectiveRecord r{Kind::kAllToAll, 65536, ncclBfloat16, ncclSum, "expert-parallel"};
  EXPECT_EQ(r.describe(), "all_to_all(bf16 x 65536) on 'expert-parallel'");
}

TEST(CollectiveTimings, GroupedByKindDtypeAndSizeWithTheMedian) {
  const uint64_t big = uint64_t{48} << 20, small = 49152;
  std::vector<TimedCollective> calls;
  // Two warm-up steps: 3 big all-reduces a step (one slow first call), 1 small all-gather.
  for (const float ms : {5.0f, 0.2f, 0.2f, 0.25f, 0.2f, 0.2f})
    calls.push_back({Kind::kAllReduce, big, ncclBfloat16, ms, false});
  calls.push_back({Kind::kAllGather, small, ncclFloat32, 0.012f});
  calls.push_back({Kind::kAllGather, small, ncclFloat32, 0.010f});
  // The same size in another dtype is another collective.
  calls.push_back({Kind::kAllReduce, big, ncclFloat32, 0.4f});
  calls.push_back({Kind::kAllReduce, big, ncclFloat32, 0.4f});
  const std::vector<CollectiveTiming> t = summarize_timings("tensor-parallel", calls, 2, 2);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].bytes, big);  // largest first
  EXPECT_EQ(t[2].bytes, small);
  const CollectiveTiming* ar = nullptr;
  for (const CollectiveTiming& x : t)
    if (x.kind == Kind::kAllReduce && x.dtype == ncclBfloat16) ar = &x;
  ASSERT_NE(ar, nullptr);
  EXPECT_EQ(ar->comm, "tensor-parallel");
  EXPECT_DOUBLE_EQ(ar->calls_per_step, 3.0);
  EXPECT_NEAR(ar->median_us, 200.0, 1e-3);  // the slow first call does not move the median
  // 48 MiB in 200 us at 2 ranks: algorithm bandwidth 251.66 GB/s, the bus factor 1.
  EXPECT_NEAR(ar->busbw_gbps, static_cast<double>(big) / 200e-6 / 1e9, 1e-3);
  EXPECT_NEAR(t[2].median_us, 11.0, 1e-3);  // an even count: the mean of the middle two
  EXPECT_NEAR(t[2].busbw_gbps, static_cast<double>(small) / 11e-6 / 1e9 * 0.5, 1e-3);
  // The same collective on a side stream beside other work is grouped apart.
  calls.push_back({Kind::kAllGather, small, ncclFloat32, 0.030f, true});
  calls.push_back({Kind::kAllGather, small, ncclFloat32, 0.050f, true});
  const std::vector<CollectiveTiming> o = summarize_timings("tensor-parallel", calls, 2, 2);
  ASSERT_EQ(o.size(), 4u);
  int overlapped = 0;
  for (const CollectiveTiming& x : o)
    if (x.overlapped) {
      ++overlapped;
      EXPECT_EQ(x.kind, Kind::kAllGather);
      EXPECT_NEAR(x.median_us, 40.0, 1e-3);
      EXPECT_DOUBLE_EQ(x.calls_per_step, 1.0);
    }
  EXPECT_EQ(overlapped, 1);
  EXPECT_THROW(summarize_timings("x", calls, 2, 0), Error);
  EXPECT_TRUE(summarize_timings("x", {}, 2, 1).empty());
}

}  // namespace
}  // namespace replay::comm
