// replay-graphs-bench's host logic, without a GPU: the globaltimer probe and the clock choice,
// kernel intervals from block stamps under both clocks, the reduction of a run into durations, span
// and idle time (including a synthetic 1000-kernel chain read through a coarse globaltimer), and
// the reported gaps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "graphs/bench/kernel_timeline.h"

namespace replay::graphs_bench {
namespace {

const Timer kGlobaltimer{TimerSource::kGlobaltimer, 2.0};
const Timer kSmClock{TimerSource::kSmClock, 2.0};

BlockStamp stamp(uint64_t start_ns, uint32_t length_ns, uint32_t cycles) {
  return {start_ns, length_ns, cycles};
}

TEST(GlobaltimerProbe, FindsTheStepTheTickAndTheReadCost) {
  // A timer that moves in 32 ns steps, read every 10 ns or so, with one 64 ns jump.
  const std::vector<uint64_t> reads = {1000, 1000, 1000, 1032, 1032, 1032,
                                       1064, 1064, 1128, 1128, 1128};
  const GlobaltimerProbe p = probe_globaltimer(reads);
  EXPECT_EQ(p.resolution_ns, 32.0);
  EXPECT_EQ(p.changes, 3);
  EXPECT_DOUBLE_EQ(p.tick_ns, (1128.0 - 1032.0) / 2.0);
  EXPECT_DOUBLE_EQ(p.read_ns, 128.0 / 10.0);
}

TEST(GlobaltimerProbe, RejectsAFrozenOrBackwardTimer) {
  EXPECT_THROW(probe_globaltimer({5, 5, 5, 5, 6}), Error);  // one change: no tick to measure
  EXPECT_THROW(probe_globaltimer({5, 6, 7, 6, 8}), Error);  // went backwards
  EXPECT_THROW(probe_globaltimer({5, 6}), Error);           // too few reads
}

TEST(ChooseTimer, GlobaltimerWhenFineEnoughSmClockOtherwise) {
  GlobaltimerProbe fine;
  fine.resolution_ns = 32;
  EXPECT_EQ(choose_timer(fine, 1.98).source, TimerSource::kGlobaltimer);
  GlobaltimerProbe edge;
  edge.resolution_ns = kMaxGlobaltimerStepNs;
  EXPECT_EQ(choose_timer(edge, 1.98).source, TimerSource::kGlobaltimer);
  GlobaltimerProbe coarse;
  coarse.resolution_ns = 1024;
  const Timer t = choose_timer(coarse, 1.98);
  EXPECT_EQ(t.source, TimerSource::kSmClock);
  EXPECT_DOUBLE_EQ(t.sm_clock_ghz, 1.98);
  EXPECT_THROW(choose_timer(coarse, 0.0), Error);  // the SM clock must be calibrated to be used
  EXPECT_STREQ(timer_source_name(TimerSource::kSmClock), "sm_clock");
}

TEST(KernelInterval, FirstBlockStartToLastBlockEnd) {
  // Three blocks; the last to start is not the last to end.
  const std::vector<BlockStamp> blocks = {stamp(1000, 500, 1000), stamp(1100, 900, 1800),
                                          stamp(1200, 300, 600)};
  const KernelInterval g = kernel_interval(blocks.data(), 3, kGlobaltimer);
  EXPECT_DOUBLE_EQ(g.start_ns, 1000.0);
  EXPECT_DOUBLE_EQ(g.end_ns, 2000.0);  // block 1: 1100 + 900
  EXPECT_DOUBLE_EQ(g.duration_ns(), 1000.0);
  EXPECT_THROW(kernel_interval(blocks.data(), 0, kGlobaltimer), Error);
}

TEST(KernelInterval, SmClockTakesBlockLengthsFromCycles) {
  // globaltimer ticking every 1000 ns says 0 and 1000 ns; the cycles at 2 GHz say 700 and 1300 ns.
  const std::vector<BlockStamp> blocks = {stamp(5000, 0, 1400), stamp(5000, 1000, 2600)};
  const KernelInterval k = kernel_interval(blocks.data(), 2, kSmClock);
  EXPECT_DOUBLE_EQ(k.start_ns, 5000.0);
  EXPECT_DOUBLE_EQ(k.end_ns, 6300.0);
  EXPECT_DOUBLE_EQ(kernel_interval(blocks.data(), 2, kGlobaltimer).end_ns, 6000.0);
}

TEST(ReduceTimeline, SumsDurationsAndMeasuresSpanAndIdleTime) {
  // Kernel 0: two blocks over [0, 10000]; kernel 1: one block [11000, 14000]; kernel 2: three
  // blocks over [15500, 20500]. Idle: 1000 + 1500.
  const std::vector<BlockStamp> stamps = {stamp(0, 10000, 20000),   stamp(200, 9800, 19600),
                                          stamp(11000, 3000, 6000), stamp(15500, 4000, 8000),
                                          stamp(15600, 4900, 9800), stamp(16000, 1000, 2000)};
  const std::vector<int> blocks = {2, 1, 3};
  for (const Timer& timer : {kGlobaltimer, kSmClock}) {
    const Timeline t = reduce_timeline(stamps, blocks, timer);
    EXPECT_EQ(t.kernels, 3);
    EXPECT_DOUBLE_EQ(t.sum_kernel_ns, 10000.0 + 3000.0 + 5000.0);
    EXPECT_DOUBLE_EQ(t.span_ns, 20500.0);
    EXPECT_DOUBLE_EQ(t.idle_ns, 2500.0);
    EXPECT_DOUBLE_EQ(t.cycles_per_ns, 2.0);
  }
}

TEST(ReduceTimeline, RejectsStampsThatDoNotMatchTheKernels) {
  const std::vector<BlockStamp> stamps = {stamp(0, 10, 20), stamp(0, 10, 20), stamp(20, 10, 20)};
  EXPECT_THROW(reduce_timeline(stamps, {2}, kGlobaltimer), Error);     // one stamp left over
  EXPECT_THROW(reduce_timeline(stamps, {2, 2}, kGlobaltimer), Error);  // one stamp missing
  EXPECT_THROW(reduce_timeline(stamps, {3, 0}, kGlobaltimer), Error);  // a kernel with no blocks
  EXPECT_THROW(reduce_timeline(stamps, {}, kGlobaltimer), Error);
  EXPECT_NO_THROW(reduce_timeline(stamps, {2, 1}, kGlobaltimer));
}

// A chain of 1000 kernels of 132 blocks each, about 30 us long with 1 us between kernels, seen
// through a globaltimer that ticks every 1024 ns (stamps hold floor(t / 1024) * 1024) and an
// exact 1.98 GHz SM clock: both reductions recover the sum of durations to 0.2% (what is left comes
// from the blocks' start offsets, read at tick granularity: at most the 400 ns spread of block
// starts per kernel, about 25 ns on average), and the SM-clock one the 1 us idle time between
// kernels to 5%.
TEST(ReduceTimeline, RecoversAChainThroughACoarseGlobaltimer) {
  constexpr int kKernels = 1000, kBlocks = 132;
  constexpr double kTick = 1024, kGhz = 1.98;
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<double> spread(0, 400), length(29000, 30000), gap(800, 1200);
  auto q = [&](double t) { return static_cast<uint64_t>(std::floor(t / kTick) * kTick); };
  std::vector<BlockStamp> stamps;
  std::vector<int> blocks(kKernels, kBlocks);
  double now = 5e6 + 123.4, true_sum = 0, first = now;
  for (int k = 0; k < kKernels; ++k) {
    double end = now;
    for (int b = 0; b < kBlocks; ++b) {
      const double s = now + spread(rng), e = s + length(rng);
      stamps.push_back({q(s), static_cast<uint32_t>(q(e) - q(s)),
                        static_cast<uint32_t>(std::llround((e - s) * kGhz))});
      end = std::max(end, e);
    }
    true_sum += end - now;
    now = end + gap(rng);
  }
  const double true_span = now - first;  // includes one gap after the last kernel: remove it below
  const Timeline sm = reduce_timeline(stamps, blocks, {TimerSource::kSmClock, kGhz});
  const Timeline gt = reduce_timeline(stamps, blocks, {TimerSource::kGlobaltimer, kGhz});
  EXPECT_NEAR(sm.sum_kernel_ns / true_sum, 1.0, 2e-3);
  EXPECT_NEAR(gt.sum_kernel_ns / true_sum, 1.0, 2e-3);
  EXPECT_GT(sm.span_ns, true_span - 1200 - 2 * kTick);
  EXPECT_LT(sm.span_ns, true_span - 800 + 2 * kTick);
  EXPECT_NEAR(sm.idle_ns / (kKernels - 1), 1000.0, 50.0);  // the 1 us gaps, to 5%
  EXPECT_NEAR(sm.cycles_per_ns, kGhz, 0.01);
}

TEST(Gaps, ComesFromTheReplayTheSpanAndTheSum) {
  RunTimes t;
  t.kernels = 1000;
  t.sum_kernel_us = 30000;
  t.replay_span_us = 30999;
  t.graph_us = 31005;
  t.eager_sum_kernel_us = 30010;
  t.eager_us = 32010;
  const Gaps g = gaps(t);
  EXPECT_DOUBLE_EQ(g.gap_us, 1005.0);
  EXPECT_DOUBLE_EQ(g.gap_us_per_kernel, 1.005);
  EXPECT_DOUBLE_EQ(g.inter_kernel_gap_us, 1.0);  // 999 us over 999 gaps
  EXPECT_DOUBLE_EQ(g.graph_overhead_us, 6.0);
  EXPECT_DOUBLE_EQ(g.graph_over_sum, 31005.0 / 30000.0);
  EXPECT_DOUBLE_EQ(g.eager_gap_us_per_kernel, 2.0);
  t.kernels = 1;
  EXPECT_THROW(gaps(t), Error);
}

}  // namespace
}  // namespace replay::graphs_bench
