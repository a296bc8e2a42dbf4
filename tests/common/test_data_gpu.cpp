// The prefetch ring on a GPU: pinned slots and asynchronous 2-D copies into device buffers deliver
// exactly the file's batches even when the device lags behind the host (a slot is refilled only
// after its copy has finished), and next() refuses to run inside a stream capture.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "common/data/batch_stream.h"
#include "tests/common/test_data_util.h"
#include "tests/support/compare.h"

namespace replay::data {
namespace {

using test::DeviceBuffer;
using test::TempDir;

// A host function that holds the stream for a while, so the copies after it stay pending while the
// host (and the prefetch thread) run ahead.
void CUDART_CB hold_stream(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

TEST(BatchStreamGpu, PinnedRingDeliversTheFileIntoDeviceBuffersWhileTheDeviceLags) {
  TempDir dir;
  const int64_t rows = 24, seq = 127, mb = 3, steps = 3 * (rows / mb);  // three epochs
  test::write_indexed_file(dir.file("i.h5"), rows, seq);
  const BatchShape shape{mb, seq, test::indexed_vocab(rows, seq)};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    StreamOptions options;
    options.seed = 17;
    options.ring_slots = 2;
    BatchStream batches(TokenFile(dir.file("i.h5"), shape), options);
    // The step's static input buffers, and a history the "step" copies them into.
    DeviceBuffer<int32_t> tokens(mb * seq), targets(mb * seq);
    DeviceBuffer<int32_t> seen_tokens(steps * mb * seq), seen_targets(steps * mb * seq);
    const size_t batch_bytes = static_cast<size_t>(mb * seq) * sizeof(int32_t);
    for (int64_t i = 0; i < steps; ++i) {
      ASSERT_EQ(cudaLaunchHostFunc(stream, hold_stream, nullptr), cudaSuccess);
      batches.next(stream, tokens.get(), targets.get());
      ASSERT_EQ(cudaMemcpyAsync(seen_tokens.get() + i * mb * seq, tokens.get(), batch_bytes,
                                cudaMemcpyDeviceToDevice, stream),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(seen_targets.get() + i * mb * seq, targets.get(), batch_bytes,
                                cudaMemcpyDeviceToDevice, stream),
                cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(batches.delivered(), steps);
    const std::vector<int32_t> got_tokens = seen_tokens.download();
    const std::vector<int32_t> got_targets = seen_targets.download();
    const TokenFile reference(dir.file("i.h5"), shape);
    BatchOrder order(rows, mb, true, 17);
    for (int64_t i = 0; i < steps; ++i) {
      const test::ExpectedBatch e = test::expected_batch(reference, order, i);
      const std::vector<int32_t> t(got_tokens.begin() + i * mb * seq,
                                   got_tokens.begin() + (i + 1) * mb * seq);
      const std::vector<int32_t> y(got_targets.begin() + i * mb * seq,
                                   got_targets.begin() + (i + 1) * mb * seq);
      ASSERT_EQ(t, e.tokens) << "inputs of step " << i;
      ASSERT_EQ(y, e.targets) << "targets of step " << i;
    }
    std::printf("steps %lld, stalls %lld (%.3f s): the device set the pace\n",
                static_cast<long long>(steps), static_cast<long long>(batches.stalls()),
                batches.stall_seconds());
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(BatchStreamGpu, NextRefusesToRunInsideACapture) {
  TempDir dir;
  test::write_indexed_file(dir.file("i.h5"), 4, 15);
  BatchStream batches(TokenFile(dir.file("i.h5"), {1, 15, test::indexed_vocab(4, 15)}), {});
  DeviceBuffer<int32_t> tokens(15), targets(15);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_THROW(batches.next(stream, tokens.get(), targets.get()), Error);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess)
      << "the refusal left the capture intact";
  if (graph) cudaGraphDestroy(graph);
  EXPECT_EQ(batches.delivered(), 0);
  batches.next(stream, tokens.get(), targets.get());  // outside the capture it works
  BatchOrder order(4, 1, true, 0);
  int64_t row = -1;
  order.rows(0, &row);
  EXPECT_EQ(tokens.download()[0], row * 16);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace replay::data
