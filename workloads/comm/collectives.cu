// collectives.cu: buffers, calls and the correctness pass of replay-comm-probe (collectives.h).
#include "workloads/comm/collectives.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "common/check.h"

namespace replay::probe {

namespace {

__host__ __device__ float pattern(int rank, uint64_t i) {
  return static_cast<float>((13 * (i % 8) + 7 * static_cast<uint64_t>(rank)) % 8);
}

__host__ __device__ float expected(comm::Kind k, uint64_t count, int rank, int ranks, uint64_t j) {
  if (k == comm::Kind::kAllGather) return pattern(static_cast<int>(j / count), j % count);
  const uint64_t i = k == comm::Kind::kReduceScatter ? static_cast<uint64_t>(rank) * count + j : j;
  float sum = 0.0f;
  for (int r = 0; r < ranks; ++r) sum += pattern(r, i);
  return sum;
}

__device__ float load(const void* p, uint64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
}

__global__ void fill_kernel(void* p, uint64_t n, bool bf16, int rank) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const float v = pattern(rank, i);
    if (bf16)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
    else
      static_cast<float*>(p)[i] = v;
  }
}

__global__ void check_kernel(const void* recv, uint64_t n, bool bf16, comm::Kind k, uint64_t count,
                             int rank, int ranks, unsigned long long* counter) {
  for (uint64_t j = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; j < n;
       j += uint64_t{gridDim.x} * blockDim.x) {
    if (load(recv, j, bf16) != expected(k, count, rank, ranks, j)) {
      atomicAdd(&counter[0], 1ull);
      atomicMin(&counter[1], static_cast<unsigned long long>(j));
    }
  }
}

unsigned blocks_for(uint64_t n) {
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>((n + 255) / 256, 4096)));
}

}  // namespace

ncclDataType_t nccl_type(DType t) {
  return t == DType::kBF16 ? ncclBfloat16 : ncclFloat32;
}

float pattern_value(int rank, uint64_t i) {
  return pattern(rank, i);
}

float expected_value(comm::Kind k, uint64_t count, int rank, int ranks, uint64_t j) {
  return expected(k, count, rank, ranks, j);
}

uint64_t send_elements(comm::Kind k, uint64_t count, int ranks) {
  return k == comm::Kind::kReduceScatter ? count * static_cast<uint64_t>(ranks) : count;
}

uint64_t recv_elements(comm::Kind k, uint64_t count, int ranks) {
  return k == comm::Kind::kAllGather ? count * static_cast<uint64_t>(ranks) : count;
}

CallBuffers call_buffers(comm::Kind k, void* send_buffer, void* recv_buffer, uint64_t count,
                         DType t, int rank, bool in_place) {
  if (!in_place) return {send_buffer, recv_buffer};
  const uint64_t slice =
      count * static_cast<uint64_t>(dtype_bytes(t)) * static_cast<uint64_t>(rank);
  switch (k) {
    case comm::Kind::kAllReduce:
      return {recv_buffer, recv_buffer};
    case comm::Kind::kAllGather:
      return {static_cast<char*>(recv_buffer) + slice, recv_buffer};
    case comm::Kind::kReduceScatter:
      return {send_buffer, static_cast<char*>(send_buffer) + slice};
  }
  return {send_buffer, recv_buffer};
}

void enqueue(comm::Communicator& c, comm::Kind k, const CallBuffers& b, uint64_t count, DType t,
             cudaStream_t stream) {
  const auto n = static_cast<size_t>(count);
  switch (k) {
    case comm::Kind::kAllReduce:
      c.all_reduce(b.send, b.recv, n, nccl_type(t), ncclSum, stream);
      break;
    case comm::Kind::kReduceScatter:
      c.reduce_scatter(b.send, b.recv, n, nccl_type(t), ncclSum, stream);
      break;
    case comm::Kind::kAllGather:
      c.all_gather(b.send, b.recv, n, nccl_type(t), stream);
      break;
  }
}

void fill_pattern(const CallBuffers& b, comm::Kind k, uint64_t count, DType t, int rank, int ranks,
                  cudaStream_t stream) {
  const uint64_t n = send_elements(k, count, ranks);
  fill_kernel<<<blocks_for(n), 256, 0, stream>>>(const_cast<void*>(b.send), n, t == DType::kBF16,
                                                 rank);
  REPLAY_CUDA_CHECK(cudaGetLastError());
}

void clear_counter(unsigned long long* counter, cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned long long), stream));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(counter + 1, 0xff, sizeof(unsigned long long), stream));
}

void count_mismatches(const CallBuffers& b, comm::Kind k, uint64_t count, DType t, int rank,
                      int ranks, unsigned long long* counter, cudaStream_t stream) {
  const uint64_t n = recv_elements(k, count, ranks);
  check_kernel<<<blocks_for(n), 256, 0, stream>>>(b.recv, n, t == DType::kBF16, k, count, rank,
                                                  ranks, counter);
  REPLAY_CUDA_CHECK(cudaGetLastError());
}

}  // namespace replay::probe
