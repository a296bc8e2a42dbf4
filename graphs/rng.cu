// rng.cu: RngTracker's registration bookkeeping and its two kernels (initialize, advance).
#include "graphs/rng.h"

#include <sstream>

#include "common/check.h"

namespace replay::graphs {

namespace {

// Per-stream values passed by value: they are fixed once the plan is built (128 bytes of
// parameters).
struct SlotValues {
  uint64_t v[RngTracker::kMaxStreams];
};

__global__ void rng_initialize_kernel(PhiloxSlot* slots, SlotValues seeds, int n) {
  const int i = threadIdx.x;
  if (i < n) slots[i] = PhiloxSlot{seeds.v[i], 0};
}

__global__ void rng_advance_kernel(PhiloxSlot* slots, SlotValues consumption, int n) {
  const int i = threadIdx.x;
  if (i < n) slots[i].offset += consumption.v[i];
}

}  // namespace

size_t RngTracker::device_bytes(int max_streams) {
  return 2 * static_cast<size_t>(max_streams) * sizeof(PhiloxSlot);
}

BufferId RngTracker::plan(ArenaPlan& plan, int max_streams, const std::string& name) {
  return plan.add(name, device_bytes(max_streams), "graphs", Lifetime{}, 16);
}

RngTracker::RngTracker(void* device_memory, size_t bytes, int max_streams)
    : max_streams_(max_streams) {
  REPLAY_REQUIRE(max_streams >= 1 && max_streams <= kMaxStreams,
                 "RngTracker holds 1 to " + std::to_string(kMaxStreams) + " streams");
  REPLAY_REQUIRE(device_memory != nullptr, "RngTracker needs device memory for its slots");
  REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(device_memory) % 16 == 0,
                 "RngTracker memory must be 16-byte aligned");
  REPLAY_REQUIRE(bytes >= device_bytes(max_streams), "RngTracker needs " +
                                                         std::to_string(device_bytes(max_streams)) +
                                                         " bytes, got " + std::to_string(bytes));
  slots_ = static_cast<PhiloxSlot*>(device_memory);
  snapshot_ = slots_ + max_streams;
}

int RngTracker::find(const std::string& stream) const {
  for (size_t i = 0; i < streams_.size(); ++i)
    if (streams_[i].name == stream) return static_cast<int>(i);
  return -1;
}

void RngTracker::add_stream(const std::string& name, uint64_t seed) {
  REPLAY_REQUIRE(!name.empty(), "an RNG stream needs a name");
  REPLAY_REQUIRE(find(name) < 0, "RNG stream '" + name + "' added twice");
  REPLAY_REQUIRE(ops_.empty(), "RNG stream '" + name + "' added after ops registered");
  REPLAY_REQUIRE(stream_count() < max_streams_, "RNG stream '" + name + "' exceeds the tracker's " +
                                                    std::to_string(max_streams_) + " streams");
  streams_.push_back(Stream{name, seed, 0});
}

void RngTracker::add_parallel_streams(uint64_t seed, int tp_rank, int ep_rank, int expert_tp_rank) {
  REPLAY_REQUIRE(tp_rank >= 0 && ep_rank >= 0 && expert_tp_rank >= 0, "ranks are non-negative");
  add_stream(kDataParallelRng, seed);
  add_stream(kTensorParallelRng, seed + 2718 + static_cast<uint64_t>(tp_rank));
  add_stream(kExpertParallelRng, seed + 1024 + 100 * static_cast<uint64_t>(ep_rank) +
                                     static_cast<uint64_t>(expert_tp_rank));
}

RngArgs RngTracker::register_op(const std::string& stream, const std::string& op,
                                uint64_t positions) {
  REPLAY_REQUIRE(!closed_, "random op '" + op +
                               "' registered after the step was built (registration closes "
                               "at the first RngTracker::advance)");
  REPLAY_REQUIRE(positions >= 1, "random op '" + op + "' must own at least one position");
  const int i = find(stream);
  REPLAY_REQUIRE(i >= 0,
                 "random op '" + op + "' names RNG stream '" + stream + "', which was never added");
  for (const Op& o : ops_)
    REPLAY_REQUIRE(!(o.stream == stream && o.name == op),
                   "random op '" + op + "' registered twice on stream '" + stream + "'");
  Stream& s = streams_[static_cast<size_t>(i)];
  const uint64_t offset = s.consumption;
  s.consumption += positions;
  ops_.push_back(Op{stream, op, offset, positions});
  return RngArgs{slots_ + i, offset};
}

void RngTracker::initialize(cudaStream_t stream) const {
  REPLAY_REQUIRE(stream_count() > 0, "RngTracker::initialize with no streams added");
  SlotValues seeds{};
  for (int i = 0; i < stream_count(); ++i) seeds.v[i] = streams_[static_cast<size_t>(i)].seed;
  rng_initialize_kernel<<<1, kMaxStreams, 0, stream>>>(slots_, seeds, stream_count());
  REPLAY_LAUNCH_CHECK();
}

void RngTracker::advance(cudaStream_t stream) {
  REPLAY_REQUIRE(stream_count() > 0, "RngTracker::advance with no streams added");
  closed_ = true;
  SlotValues consumption{};
  for (int i = 0; i < stream_count(); ++i)
    consumption.v[i] = streams_[static_cast<size_t>(i)].consumption;
  rng_advance_kernel<<<1, kMaxStreams, 0, stream>>>(slots_, consumption, stream_count());
  REPLAY_LAUNCH_CHECK();
}

void RngTracker::snapshot(cudaStream_t stream) const {
  if (stream_count() == 0) return;
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(snapshot_, slots_, slots_bytes(), cudaMemcpyDeviceToDevice, stream));
}

void RngTracker::restore(cudaStream_t stream) const {
  if (stream_count() == 0) return;
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(slots_, snapshot_, slots_bytes(), cudaMemcpyDeviceToDevice, stream));
}

const PhiloxSlot* RngTracker::slot(const std::string& stream) const {
  const int i = find(stream);
  REPLAY_REQUIRE(i >= 0, "RNG stream '" + stream + "' was never added");
  return slots_ + i;
}

uint64_t RngTracker::consumption(const std::string& stream) const {
  const int i = find(stream);
  REPLAY_REQUIRE(i >= 0, "RNG stream '" + stream + "' was never added");
  return streams_[static_cast<size_t>(i)].consumption;
}

std::string RngTracker::table() const {
  std::ostringstream os;
  for (const Stream& s : streams_) {
    os << "rng stream " << s.name << ": seed " << s.seed << ", " << s.consumption
       << " positions per step\n";
    for (const Op& o : ops_)
      if (o.stream == s.name)
        os << "  " << o.name << " @" << o.offset << " (" << o.positions << ")\n";
  }
  return os.str();
}

}  // namespace replay::graphs
