// Event timing on a real GPU: gpu_idle holds a stream for the time asked, and time_repeats returns
// one sample a timed call, a time budget cutting their count as repeats_within says.
#include <gtest/gtest.h>

#include "common/bench/timing.h"
#include "common/check.h"

namespace replay::bench {
namespace {

class Stream {
 public:
  Stream() { REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// One call that holds the stream for 2 ms.
void idle_2ms(cudaStream_t s) {
  gpu_idle(s, 2.0);
}

TEST(BenchTimingGpu, IdleHoldsTheStreamForTheTimeAsked) {
  Stream s;
  const std::vector<double> ms = time_repeats(s, 1, 4, idle_2ms);
  ASSERT_EQ(ms.size(), 4u);
  for (double m : ms) {
    EXPECT_GE(m, 1.99);  // events resolve to about half a microsecond
    EXPECT_LT(m, 2.5);
  }
}

TEST(BenchTimingGpu, ABudgetCutsTheTimedCalls) {
  Stream s;
  // Calls of just over 2 ms: 20 ms fit 9 of them (10 at exactly 2 ms).
  const std::vector<double> fit = time_repeats(s, 3, 50, idle_2ms, 0.0, 20.0);
  EXPECT_GE(fit.size(), 9u);
  EXPECT_LE(fit.size(), 10u);
  for (double m : fit) EXPECT_GE(m, 1.99);
  // A budget shorter than a call leaves the floor of kMinBudgetRepeats...
  EXPECT_EQ(time_repeats(s, 2, 50, idle_2ms, 0.0, 1.0).size(), size_t{kMinBudgetRepeats});
  // ...unless fewer repeats were asked for; a budget that fits more than asked gives the repeats.
  EXPECT_EQ(time_repeats(s, 2, 3, idle_2ms, 0.0, 1.0).size(), 3u);
  EXPECT_EQ(time_repeats(s, 2, 6, idle_2ms, 0.0, 100.0).size(), 6u);
  // No budget: every repeat, whatever the calls take.
  EXPECT_EQ(time_repeats(s, 0, 12, idle_2ms, 0.0, 0.0).size(), 12u);
  // With the lead the count is the same: the lead comes after the warm-up that sizes it.
  const std::vector<double> led = time_repeats(s, 3, 50, idle_2ms, 5.0, 20.0);
  EXPECT_GE(led.size(), 9u);
  EXPECT_LE(led.size(), 10u);
}

TEST(BenchTimingGpu, ABudgetNeedsTwoWarmupCalls) {
  Stream s;
  EXPECT_THROW(time_repeats(s, 1, 10, idle_2ms, 0.0, 20.0), Error);
  EXPECT_NO_THROW(time_repeats(s, 1, 2, idle_2ms, 0.0, 0.0));
}

}  // namespace
}  // namespace replay::bench
