// The readback ring returns step s - 1 while step s is still blocked on the device, refuses steps
// whose slot was reused or that were never enqueued, and names a device counter that disagrees with
// the host's count.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "graphs/graph.h"
#include "graphs/readback.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// Spins until the host sets *flag (mapped pinned memory), at most a few seconds.
__global__ void wait_for_host_kernel(const volatile int32_t* flag) {
  for (long i = 0; i < 20000000 && *flag == 0; ++i) __nanosleep(200);
}

// What a step writes: its loss, from the iteration counter; what the step's end does: advance it.
__global__ void write_loss_kernel(float* loss, const int64_t* iteration) {
  *loss = 100.0f + static_cast<float>(*iteration);
}
__global__ void advance_kernel(int64_t* iteration) {
  *iteration += 1;
}

TEST(Readback, HostReadsEarlierStepsWithoutWaitingOnTheCurrentOne) {
  CaptureStream work, cap;
  DeviceBuffer<int64_t> iteration(std::vector<int64_t>{0});
  DeviceBuffer<float> loss(std::vector<float>{0.0f});
  DeviceBuffer<int32_t> flag(std::vector<int32_t>{0});
  ReadbackRing ring(4, iteration.get(),
                    {{"loss", loss.get(), ScalarType::kF32},
                     {"iteration", iteration.get(), ScalarType::kI64},
                     {"found_inf", flag.get(), ScalarType::kI32}});
  Graph step("readback.step");
  step.build(
      cap.get(),
      [&](cudaStream_t st) {
        write_loss_kernel<<<1, 1, 0, st>>>(loss.get(), iteration.get());
        REPLAY_LAUNCH_CHECK();
        ring.copy(st);
        advance_kernel<<<1, 1, 0, st>>>(iteration.get());
        REPLAY_LAUNCH_CHECK();
      },
      work.get());

  int32_t* gate = nullptr;
  int32_t* gate_device = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&gate), 4, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_device), gate, 0), cudaSuccess);

  for (int k = 0; k < 10; ++k) {
    const bool block = k == 6;
    if (block) {
      *reinterpret_cast<volatile int32_t*>(gate) = 0;
      wait_for_host_kernel<<<1, 1, 0, work.get()>>>(gate_device);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    }
    step.launch(work.get());
    ring.step_enqueued(work.get());
    ASSERT_EQ(ring.steps_enqueued(), k + 1);
    if (k >= 1) {
      const ReadbackSample r = ring.read(k - 1);  // one step late
      EXPECT_EQ(r.iteration, k - 1);
      EXPECT_EQ(r.get("loss"), 100.0 + (k - 1));
      EXPECT_EQ(r.get("iteration"), k - 1);
      EXPECT_EQ(r.get("found_inf"), 0);
    }
    if (block) {
      EXPECT_FALSE(ring.try_read(k).has_value())
          << "step " << k << " cannot have finished: the device waits";
      EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "'not ready' must not be left as an error";
      *reinterpret_cast<volatile int32_t*>(gate) = 1;
      EXPECT_EQ(ring.read(k).get("loss"), 100.0 + k);
    }
  }
  EXPECT_THROW(ring.read(5), Error);   // its slot has been reused (ring of 4)
  EXPECT_THROW(ring.read(10), Error);  // not enqueued
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  ASSERT_EQ(cudaFreeHost(gate), cudaSuccess);
}

TEST(Readback, DisagreeingCountersAreAClearError) {
  CaptureStream work;
  DeviceBuffer<int64_t> frozen(std::vector<int64_t>{0});  // a counter nobody advances
  DeviceBuffer<float> loss(std::vector<float>{1.5f});
  ReadbackRing ring(2, frozen.get(), {{"loss", loss.get(), ScalarType::kF32}});
  for (int k = 0; k < 2; ++k) {
    ring.copy(work.get());
    ring.step_enqueued(work.get());
  }
  EXPECT_EQ(ring.read(0).get("loss"), 1.5);
  try {
    ring.read(1);
    FAIL() << "step 1 was read from step 0's slot";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "disagree")) << e.what();
  }
}

}  // namespace
}  // namespace replay::graphs
