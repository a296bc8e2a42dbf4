// attention_rng.cu: the one-thread kernel that turns replay's device-resident Philox slot into the
// {seed, offset} pair cuDNN's attention dropout reads from device memory (see attention.h,
// "Dropout").
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/check.h"
#include "common/philox.h"

namespace replay::detail {

// seed and offset are int64 tensors for cuDNN; the uint64 values are passed through bit for bit.
__global__ void attention_dropout_state_kernel(const PhiloxSlot* slot, uint64_t op_offset,
                                               uint64_t counters_per_position, int64_t* seed,
                                               int64_t* offset) {
  const uint64_t position = slot->offset + op_offset;
  *seed = static_cast<int64_t>(slot->seed);
  *offset = static_cast<int64_t>(position * counters_per_position);
}

void launch_attention_dropout_state(const PhiloxSlot* slot, uint64_t op_offset,
                                    uint64_t counters_per_position, int64_t* seed, int64_t* offset,
                                    cudaStream_t stream) {
  REPLAY_REQUIRE(slot != nullptr, "attention dropout needs an RNG slot (RngArgs::slot)");
  attention_dropout_state_kernel<<<1, 1, 0, stream>>>(slot, op_offset, counters_per_position, seed,
                                                      offset);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::detail
