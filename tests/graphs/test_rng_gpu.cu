// RngTracker on the device: a random region run eagerly and replayed as a graph draws bit-identical
// numbers, different ones at every step, equal to the host Philox at the documented counter;
// snapshot and restore replay the same numbers; named streams are independent and slots advance by
// their consumption.
#include <gtest/gtest.h>

#include <vector>

#include "common/check.h"
#include "common/philox.h"
#include "graphs/graph.h"
#include "graphs/rng.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

// out[i] = component i % 4 of the op's block i / 4: the pattern every replay random op follows.
__global__ void draw_kernel(uint32_t* out, int n, RngArgs args) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const Philox4 r = rng_draw(args, static_cast<uint64_t>(i / 4));
  const uint32_t c[4] = {r.x, r.y, r.z, r.w};
  out[i] = c[i % 4];
}

void draw(uint32_t* out, int n, RngArgs args, cudaStream_t s) {
  draw_kernel<<<(n + 255) / 256, 256, 0, s>>>(out, n, args);
  REPLAY_LAUNCH_CHECK();
}

std::vector<uint32_t> host_draw(uint64_t seed, uint64_t position, int n) {
  std::vector<uint32_t> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const Philox4 r = philox_block(seed, position, static_cast<uint64_t>(i / 4));
    const uint32_t c[4] = {r.x, r.y, r.z, r.w};
    out[static_cast<size_t>(i)] = c[i % 4];
  }
  return out;
}

struct RngFixture {
  DeviceBuffer<char> memory{RngTracker::device_bytes(4)};
  RngTracker rng{memory.get(), RngTracker::device_bytes(4), 4};
};

TEST(Rng, EagerAndGraphDrawBitIdenticalFreshNumbersOnEveryReplay) {
  const int n = 1000, steps = 100;
  const uint64_t seed = 42;
  CaptureStream work, cap;
  DeviceBuffer<uint32_t> out(n), other(n);
  RngFixture f;
  f.rng.add_stream(kDataParallelRng, seed);
  const RngArgs first = f.rng.register_op(kDataParallelRng, "other.op");
  const RngArgs noise = f.rng.register_op(kDataParallelRng, "noise");
  ASSERT_EQ(noise.op_offset, 1u);
  ASSERT_EQ(f.rng.consumption(kDataParallelRng), 2u);
  auto step = [&](cudaStream_t s) {
    draw(other.get(), n, first, s);
    draw(out.get(), n, noise, s);
    f.rng.advance(s);
  };

  f.rng.initialize(work.get());
  std::vector<std::vector<uint32_t>> eager;
  for (int k = 0; k < steps; ++k) {
    step(work.get());
    eager.push_back(out.download());
  }

  f.rng.initialize(work.get());
  Graph g("noise.step");
  g.build(cap.get(), step, work.get());
  for (int k = 0; k < steps; ++k) {
    g.launch(work.get());
    const std::vector<uint32_t> graphed = out.download();
    ASSERT_TRUE(test::bit_equal("step " + std::to_string(k), eager[static_cast<size_t>(k)].data(),
                                graphed.data(), graphed.size() * sizeof(uint32_t)));
    // The numbers are the host Philox at position offset + op_offset = 2k + 1.
    const std::vector<uint32_t> host = host_draw(seed, 2 * static_cast<uint64_t>(k) + 1, n);
    ASSERT_TRUE(test::bit_equal("host philox, step " + std::to_string(k), host.data(),
                                graphed.data(), graphed.size() * sizeof(uint32_t)));
    if (k > 0) {
      int same = 0;
      for (int i = 0; i < n; ++i)
        same += graphed[static_cast<size_t>(i)] ==
                eager[static_cast<size_t>(k - 1)][static_cast<size_t>(i)];
      ASSERT_LT(same, 5) << "step " << k << " repeated the previous step's numbers";
    }
  }
}

TEST(Rng, SnapshotAndRestoreReplayTheSameNumbers) {
  const int n = 512;
  CaptureStream work;
  DeviceBuffer<uint32_t> out(n);
  RngFixture f;
  f.rng.add_stream("dropout", 7);
  const RngArgs a = f.rng.register_op("dropout", "mask");
  f.rng.initialize(work.get());
  f.rng.advance(work.get());  // somewhere mid-run
  f.rng.snapshot(work.get());
  draw(out.get(), n, a, work.get());
  f.rng.advance(work.get());
  const std::vector<uint32_t> first = out.download();
  f.rng.restore(work.get());
  draw(out.get(), n, a, work.get());
  f.rng.advance(work.get());
  const std::vector<uint32_t> again = out.download();
  EXPECT_TRUE(test::bit_equal("after restore", first.data(), again.data(), first.size() * 4));
  draw(out.get(), n, a, work.get());
  const std::vector<uint32_t> next = out.download();
  EXPECT_NE(next, again);
}

TEST(Rng, NamedStreamsAreIndependentAndAdvanceByTheirConsumption) {
  const int n = 256;
  CaptureStream work;
  DeviceBuffer<uint32_t> a_out(n), b_out(n);
  RngFixture f;
  f.rng.add_parallel_streams(1234, 1, 0, 1);
  const RngArgs a = f.rng.register_op(kDataParallelRng, "embedding.dropout");
  const RngArgs b = f.rng.register_op(kTensorParallelRng, "attn.dropout");
  f.rng.register_op(kTensorParallelRng, "mlp.dropout", 2);
  ASSERT_EQ(a.op_offset, b.op_offset);  // same position, different streams
  f.rng.initialize(work.get());
  draw(a_out.get(), n, a, work.get());
  draw(b_out.get(), n, b, work.get());
  EXPECT_NE(a_out.download(), b_out.download());

  for (int k = 0; k < 3; ++k) f.rng.advance(work.get());
  std::vector<PhiloxSlot> slots(3);
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(slots.data(), f.rng.slots(), f.rng.slots_bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(slots[0].seed, 1234u);
  EXPECT_EQ(slots[0].offset, 3u * 1u);
  EXPECT_EQ(slots[1].seed, 1234u + 2718u + 1u);
  EXPECT_EQ(slots[1].offset, 3u * 3u);
  EXPECT_EQ(slots[2].seed, 1234u + 1024u + 1u);
  EXPECT_EQ(slots[2].offset, 0u);
  EXPECT_THROW(f.rng.register_op(kDataParallelRng, "late.op"), Error);  // registration closed
}

}  // namespace
}  // namespace replay::graphs
