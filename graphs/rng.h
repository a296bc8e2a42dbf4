// rng.h: RngTracker, the graph layer's capture-safe RNG: named Philox streams (data-parallel,
// tensor-parallel, expert-parallel, as in Megatron's RNG tracker) whose {seed, offset} slots live
// in device memory. Every random op registers while the plan is built and receives RngArgs {slot,
// op_offset}; one kernel at the end of each step adds the step's consumption to every slot's
// offset. The same kernels run eagerly and inside graphs, so both draw the same numbers, and every
// step (every replay) draws new ones.
//
// A draw is philox_block(slot.seed, slot.offset + op_offset, block) (see common/philox.h):
// op_offset is unique per registered op within its stream, `block` indexes groups of four numbers
// inside the op.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/arena.h"
#include "common/philox.h"

namespace replay::graphs {

// Names of the streams Megatron's tracker keeps. Any other name works too.
inline constexpr const char* kDataParallelRng = "data-parallel";
inline constexpr const char* kTensorParallelRng = "tensor-parallel";
inline constexpr const char* kExpertParallelRng = "expert-parallel";

class RngTracker {
 public:
  static constexpr int kMaxStreams = 16;

  // Device memory for `max_streams` slots and their snapshot area: 32 bytes per stream.
  static size_t device_bytes(int max_streams);
  // Reserves that memory (lifetime: the whole run) in an arena plan; returns the buffer.
  static BufferId plan(ArenaPlan& plan, int max_streams, const std::string& name = "graphs.rng");

  // `device_memory` (from the arena or the caller, at least device_bytes(max_streams), 16-byte
  // aligned) holds the slots followed by the snapshot area. Nothing is written until initialize().
  RngTracker(void* device_memory, size_t bytes, int max_streams);
  RngTracker(const RngTracker&) = delete;
  RngTracker& operator=(const RngTracker&) = delete;

  // Adds a named stream seeded with `seed`. Streams are added before any op registers.
  void add_stream(const std::string& name, uint64_t seed);
  // Adds the three Megatron streams with Megatron's seeds (model_parallel_cuda_manual_seed):
  // data-parallel = seed, tensor-parallel = seed + 2718 + tp_rank,
  // expert-parallel = seed + 1024 + 100 * ep_rank + expert_tp_rank.
  void add_parallel_streams(uint64_t seed, int tp_rank, int ep_rank, int expert_tp_rank);

  // Registers random op `op` on `stream` while the plan is built. The op owns `positions` counter
  // positions per step: op_offset .. op_offset + positions - 1 (one suffices unless the op runs
  // several times in a step with the same RngArgs; it then adds k to op_offset for its k-th call).
  // Registration closes at the first advance(): a late op would overlap the next step's numbers.
  RngArgs register_op(const std::string& stream, const std::string& op, uint64_t positions = 1);

  // Writes {seed, offset 0} into every slot (one kernel). Once, before the first step.
  void initialize(cudaStream_t stream) const;
  // Adds each stream's per-step consumption to its slot's offset (one kernel). Enqueued at the end
  // of every step (StepPlan does it, inside the graph in full mode); closes registration.
  void advance(cudaStream_t stream);
  // Copies the slots to the snapshot area and back (one 16-byte-per-slot device copy each;
  // capturable).
  void snapshot(cudaStream_t stream) const;
  void restore(cudaStream_t stream) const;

  int stream_count() const { return static_cast<int>(streams_.size()); }
  const std::string& stream_name(int i) const { return streams_.at(static_cast<size_t>(i)).name; }
  // The slot of a stream (device pointer), and the positions its ops consume per step.
  const PhiloxSlot* slot(const std::string& stream) const;
  uint64_t consumption(const std::string& stream) const;
  // All slots: a device array of stream_count() entries.
  PhiloxSlot* slots() const { return slots_; }
  size_t slots_bytes() const { return streams_.size() * sizeof(PhiloxSlot); }
  // One line per stream (seed, ops, positions per step) and per registered op.
  std::string table() const;

 private:
  struct Stream {
    std::string name;
    uint64_t seed = 0;
    uint64_t consumption = 0;
  };
  struct Op {
    std::string stream, name;
    uint64_t offset = 0, positions = 0;
  };
  int find(const std::string& stream) const;

  PhiloxSlot* slots_ = nullptr;
  PhiloxSlot* snapshot_ = nullptr;
  int max_streams_ = 0;
  bool closed_ = false;
  std::vector<Stream> streams_;
  std::vector<Op> ops_;
};

#if defined(__CUDACC__)
// Four random numbers of block `block` of the op holding `args`, from the slot as it is at run
// time.
__device__ __forceinline__ Philox4 rng_draw(const RngArgs& args, uint64_t block) {
  const PhiloxSlot s = *args.slot;
  return philox_block(s.seed, s.offset + args.op_offset, block);
}
#endif

}  // namespace replay::graphs
