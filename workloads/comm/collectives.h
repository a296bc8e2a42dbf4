// collectives.h: the device side of replay-comm-probe: where a collective's send and receive
// buffers sit (out of place, or in place as replay's step runs them), the call itself through the
// project's Communicator, and the correctness pass (nccl-tests' -c): a known pattern in every
// rank's send buffer and a kernel that counts the received elements that differ from the exact
// result.
//
// The pattern: rank r's element i is (13 i + 7 r) mod 8, small integers whose sums over up to 36
// ranks are exact in bf16, so a correct reduction matches to the bit in either type.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>

#include "common/comm.h"
#include "workloads/comm/probe.h"

namespace replay::probe {

ncclDataType_t nccl_type(DType t);

// Rank r's send element i (also the host reference).
float pattern_value(int rank, uint64_t i);
// The exact value of receive element j on `rank` after collective `k` of `count` (the NCCL call's
// count) over `ranks` ranks.
float expected_value(comm::Kind k, uint64_t count, int rank, int ranks, uint64_t j);
// Elements each rank sends and receives.
uint64_t send_elements(comm::Kind k, uint64_t count, int ranks);
uint64_t recv_elements(comm::Kind k, uint64_t count, int ranks);

// The pointers of one call. Out of place: send and recv are the two buffers' starts. In place
// (common/comm.h's convention): the all-reduce reduces recv into itself, the all-gather sends from
// this rank's slice of recv, the reduce-scatter receives into this rank's slice of send.
struct CallBuffers {
  const void* send = nullptr;
  void* recv = nullptr;
};
CallBuffers call_buffers(comm::Kind k, void* send_buffer, void* recv_buffer, uint64_t count,
                         DType t, int rank, bool in_place);

// Enqueues the collective on `stream` (eagerly, or into a capture).
void enqueue(comm::Communicator& c, comm::Kind k, const CallBuffers& b, uint64_t count, DType t,
             cudaStream_t stream);

// Writes rank `rank`'s pattern into the call's send elements.
void fill_pattern(const CallBuffers& b, comm::Kind k, uint64_t count, DType t, int rank, int ranks,
                  cudaStream_t stream);

// Counts the call's received elements that differ from expected_value, bit for bit after
// conversion to float: counter[0] += mismatches, counter[1] = min(counter[1], first index). Clear
// with clear_counter first (counter[1] starts at UINT64_MAX).
void clear_counter(unsigned long long* counter, cudaStream_t stream);
void count_mismatches(const CallBuffers& b, comm::Kind k, uint64_t count, DType t, int rank,
                      int ranks, unsigned long long* counter, cudaStream_t stream);

}  // namespace replay::probe
