// Conditional nodes on the device: a WHILE loop whose trip count is read from device memory at
// every launch of one graph (5, 17, 3, 0); a WHILE that runs until its body clears the flag; an IF
// that skips the optimizer kernel on overflow while later work still runs; an IF nested in a WHILE;
// and the one-shot graph used when the stream is not capturing.
#include <gtest/gtest.h>

#include <vector>

#include "common/check.h"
#include "graphs/conditional.h"
#include "graphs/graph.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

// One body iteration: count it and add the iteration index the loop exposes.
__global__ void loop_body_kernel(int32_t* count, int32_t* index_sum, const int32_t* iteration) {
  *count += 1;
  *index_sum += *iteration;
}

__global__ void countdown_kernel(int32_t* remaining, int32_t* done) {
  *remaining -= 1;
  *done += 1;
}

__global__ void sgd_kernel(float* w, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) w[i] -= 1.0f;
}

__global__ void increment_kernel(int32_t* x) {
  *x += 1;
}

void set(DeviceBuffer<int32_t>& buf, int32_t v) {
  ASSERT_EQ(cudaMemcpy(buf.get(), &v, 4, cudaMemcpyHostToDevice), cudaSuccess);
}

int32_t get(const DeviceBuffer<int32_t>& buf) {
  return buf.download()[0];
}

TEST(Conditional, WhileTripCountIsReadFromDeviceMemoryAtEveryLaunch) {
  CaptureStream work, cap;
  Conditionals cond;
  DeviceBuffer<int32_t> trips(1), iteration(1), count(1), index_sum(1);
  Graph g("loop");
  g.build(
      cap.get(),
      [&](cudaStream_t s) {
        REPLAY_CUDA_CHECK(cudaMemsetAsync(count.get(), 0, 4, s));
        REPLAY_CUDA_CHECK(cudaMemsetAsync(index_sum.get(), 0, 4, s));
        cond.repeat(s, "loop", trips.get(), iteration.get(), [&](cudaStream_t b) {
          loop_body_kernel<<<1, 1, 0, b>>>(count.get(), index_sum.get(), iteration.get());
          REPLAY_LAUNCH_CHECK();
        });
      },
      work.get());
  for (int32_t n : {5, 17, 3, 0, 1}) {
    set(trips, n);
    g.launch(work.get());
    ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
    EXPECT_EQ(get(count), n) << "trip count " << n;
    EXPECT_EQ(get(index_sum), n * (n - 1) / 2) << "iterations 0.." << n - 1;
    EXPECT_EQ(get(iteration), n > 0 ? n : 0);
  }
  EXPECT_EQ(g.stats().nodes, 4u);  // two memsets, the condition kernel, the WHILE node
}

TEST(Conditional, WhileRunsUntilTheBodyClearsTheFlag) {
  CaptureStream work, cap;
  Conditionals cond;
  DeviceBuffer<int32_t> remaining(1), done(1);
  Graph g("countdown");
  g.build(
      cap.get(),
      [&](cudaStream_t s) {
        cond.while_nonzero(s, "countdown", remaining.get(), [&](cudaStream_t b) {
          countdown_kernel<<<1, 1, 0, b>>>(remaining.get(), done.get());
          REPLAY_LAUNCH_CHECK();
        });
      },
      work.get());
  for (int32_t n : {6, 0, 2}) {
    set(remaining, n);
    set(done, 0);
    g.launch(work.get());
    ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
    EXPECT_EQ(get(done), n);
    EXPECT_EQ(get(remaining), 0);
  }
}

TEST(Conditional, IfSkipsTheOptimizerOnOverflowAndLaterWorkStillRuns) {
  CaptureStream work, cap;
  Conditionals cond;
  const int n = 3000;
  DeviceBuffer<float> w(std::vector<float>(n, 10.0f));
  DeviceBuffer<int32_t> found_inf(1), after(std::vector<int32_t>{0});
  Graph g("optimizer.step");
  g.build(
      cap.get(),
      [&](cudaStream_t s) {
        cond.if_equal(s, "optimizer", found_inf.get(), 0, [&](cudaStream_t b) {
          sgd_kernel<<<(n + 255) / 256, 256, 0, b>>>(w.get(), n);
          REPLAY_LAUNCH_CHECK();
        });
        increment_kernel<<<1, 1, 0, s>>>(after.get());  // ordered after the whole IF node
        REPLAY_LAUNCH_CHECK();
      },
      work.get());
  const int32_t flags[] = {0, 1, 1, 0};
  const float expected[] = {9.0f, 9.0f, 9.0f, 8.0f};
  for (int k = 0; k < 4; ++k) {
    set(found_inf, flags[k]);
    g.launch(work.get());
    ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
    const std::vector<float> hw = w.download();
    for (int i = 0; i < n; ++i)
      ASSERT_EQ(hw[static_cast<size_t>(i)], expected[k]) << "launch " << k << " element " << i;
    EXPECT_EQ(get(after), k + 1);
  }
}

TEST(Conditional, IfNestedInWhile) {
  CaptureStream work, cap;
  Conditionals cond;
  DeviceBuffer<int32_t> trips(std::vector<int32_t>{4}), iteration(1), enabled(1), count(1);
  Graph g("nested");
  g.build(
      cap.get(),
      [&](cudaStream_t s) {
        REPLAY_CUDA_CHECK(cudaMemsetAsync(count.get(), 0, 4, s));
        cond.repeat(s, "outer", trips.get(), iteration.get(), [&](cudaStream_t b) {
          cond.if_equal(b, "inner", enabled.get(), 1, [&](cudaStream_t bb) {
            increment_kernel<<<1, 1, 0, bb>>>(count.get());
            REPLAY_LAUNCH_CHECK();
          });
        });
      },
      work.get());
  for (int32_t e : {1, 0, 1}) {
    set(enabled, e);
    g.launch(work.get());
    ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
    EXPECT_EQ(get(count), e ? 4 : 0);
  }
}

TEST(Conditional, OutsideACaptureRunsAsAOneShotGraph) {
  CaptureStream work;
  Conditionals cond;
  DeviceBuffer<int32_t> trips(std::vector<int32_t>{7}), iteration(1),
      count(std::vector<int32_t>{0}), index_sum(std::vector<int32_t>{0}),
      flag(std::vector<int32_t>{1});
  cond.repeat(work.get(), "eager.loop", trips.get(), iteration.get(), [&](cudaStream_t b) {
    loop_body_kernel<<<1, 1, 0, b>>>(count.get(), index_sum.get(), iteration.get());
    REPLAY_LAUNCH_CHECK();
  });
  cond.if_equal(work.get(), "eager.if", flag.get(), 0, [&](cudaStream_t b) {
    increment_kernel<<<1, 1, 0, b>>>(count.get());  // flag is 1: skipped
    REPLAY_LAUNCH_CHECK();
  });
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  EXPECT_EQ(get(count), 7);
  EXPECT_EQ(get(index_sum), 21);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace replay::graphs
