// C14: the RNG seed and offset passed to the kernel by value. The values are frozen into the graph
// at capture, so every replay draws the same "random" numbers (no error is reported: dropout masks
// repeat).
#include "common.h"

#include <cstdint>

// A counter-based generator (splitmix64 of seed, offset and index): same inputs, same number.
__device__ uint32_t draw(uint64_t seed, uint64_t offset, uint64_t i) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (offset * 4096 + i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// Broken: seed and offset baked into the kernel's arguments at capture.
__global__ void random_by_value(uint32_t* out, int n, uint64_t seed, uint64_t offset) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = draw(seed, offset, i);
}

// Fixed: seed and offset read from device memory at run time...
__global__ void random_by_pointer(uint32_t* out, int n, const uint64_t* seed_offset) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = draw(seed_offset[0], seed_offset[1], i);
}
// ...and advanced on the device after use, as part of the graph, so each replay gets a new offset.
__global__ void advance_offset(uint64_t* seed_offset) {
  seed_offset[1] += 1;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C14");
  ex::require_gpu();
  constexpr int n = 256, replays = 3;
  const cudaStream_t stream = ex::nonblocking_stream();
  uint32_t* out;
  uint64_t* seed_offset;
  EX_CHECK(cudaMalloc(&out, n * sizeof(uint32_t)));
  EX_CHECK(cudaMalloc(&seed_offset, 2 * sizeof(uint64_t)));
  const uint64_t host_state[2] = {1234, 0};
  EX_CHECK(cudaMemcpy(seed_offset, host_state, sizeof(host_state), cudaMemcpyHostToDevice));
  uint64_t host_offset = 0;  // what eager code would increment on the host every step

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  if (args.broken()) {
    random_by_value<<<1, n, 0, stream>>>(out, n, 1234, host_offset);
  } else {
    random_by_pointer<<<1, n, 0, stream>>>(out, n, seed_offset);
    advance_offset<<<1, 1, 0, stream>>>(seed_offset);
  }
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  uint32_t first[replays];
  for (int r = 0; r < replays; ++r) {
    ++host_offset;  // has no effect on the graph: the captured argument is a copy
    EX_CHECK(cudaGraphLaunch(exec, stream));
    EX_CHECK(cudaMemcpyAsync(&first[r], out, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream));
  }
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  const bool all_same = first[0] == first[1] && first[1] == first[2];
  const bool all_differ = first[0] != first[1] && first[1] != first[2] && first[0] != first[2];
  return ex::report(
      "C14", args, args.broken() ? all_same : all_differ,
      "first draw of 3 replays: %08x %08x %08x (%s)", first[0], first[1], first[2],
      all_same ? "identical: the seed and offset are frozen" : "a new draw every replay");
}
