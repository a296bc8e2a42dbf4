// P3: copying each batch into the graph's static input buffer. The graph reads a fixed address;
// when the producer (the loader, the previous stage) writes its batch elsewhere, every step copies
// 256 MiB into the static buffer before the replay, and that copy costs more than the graphed work.
// Broken: the producer writes its own buffer, the step copies it into the static input, then
// replays. Fixed: the producer writes straight into the static input, and the step is the producer
// and the replay. Each mode times its own step against its parts, the producer and the replay
// timed alone.
#include "common.h"

constexpr size_t kFloats = size_t(64) << 20;  // 256 MiB
constexpr size_t kBytes = kFloats * sizeof(float);
constexpr int kKernels = 20, kIters = 20;

// The producer: writes step's batch (every element = step) into dst, 16 bytes per store.
__global__ void produce(float4* dst, size_t n4, const int* step) {
  const float v = static_cast<float>(*step);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = make_float4(v, v, v, v);
  }
}

__global__ void next_step(int* step) {
  ++*step;
}

// The graphed work: small kernels on the static input; the first one records what it read.
__global__ void tiny(const float* input, float* work, float* seen) {
  work[threadIdx.x] += input[threadIdx.x];
  if (seen != nullptr && threadIdx.x == 0) *seen = input[kFloats - 1];
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P3");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* static_input = ex::device_zeros<float>(kFloats);
  float* work = ex::device_zeros<float>(32);
  float* seen = ex::device_zeros<float>();
  int* step = ex::device_zeros<int>();
  // Broken: the producer has a buffer of its own. Fixed: it writes the static input.
  float* produced = args.broken() ? ex::device_zeros<float>(kFloats) : static_input;

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kKernels; ++k)
    tiny<<<1, 32, 0, stream>>>(static_input, work, k == 0 ? seen : nullptr);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphUpload(exec, stream));

  auto producer = [&] {
    next_step<<<1, 1, 0, stream>>>(step);
    produce<<<2048, 256, 0, stream>>>(reinterpret_cast<float4*>(produced), kFloats / 4, step);
  };
  auto replay = [&] { EX_CHECK(cudaGraphLaunch(exec, stream)); };
  const float producer_ms = ex::time_ms(stream, kIters, producer);
  const float graph_ms = ex::time_ms(stream, kIters, replay);
  const float step_ms = ex::time_ms(stream, kIters, [&] {
    producer();
    if (args.broken()) {
      EX_CHECK(cudaMemcpyAsync(static_input, produced, kBytes, cudaMemcpyDeviceToDevice, stream));
    }
    replay();
  });
  // The last replay must have read the last batch: one per producer call, 2 x (1 + kIters) calls.
  const float expected = 2.0f * (1 + kIters);
  const float last_seen = ex::read_back(seen);
  ex::destroy_graph(exec, graph);
  const float needed_ms = producer_ms + graph_ms;  // the work a step cannot avoid
  if (args.broken()) {
    // The symptom: the step costs over 1.5x the producer and the graphed work together.
    const bool ok = last_seen == expected && step_ms > 1.5f * needed_ms;
    return ex::report("P3", args, ok,
                      "step with a 256 MiB input copy %.1f us, %.2fx its producer (%.1f us) and "
                      "graphed work (%.1f us) together; the copy adds %.1f us; replay read batch "
                      "%.0f (expected %.0f)",
                      step_ms * 1e3f, step_ms / needed_ms, producer_ms * 1e3f, graph_ms * 1e3f,
                      (step_ms - needed_ms) * 1e3f, last_seen, expected);
  }
  // The fix: the step costs no more than the producer and the graphed work (within 20%).
  const bool ok = last_seen == expected && step_ms < 1.2f * needed_ms;
  return ex::report("P3", args, ok,
                    "producer writes the static input: step %.1f us, %.2fx its producer (%.1f us) "
                    "and graphed work (%.1f us) together; replay read batch %.0f (expected %.0f)",
                    step_ms * 1e3f, step_ms / needed_ms, producer_ms * 1e3f, graph_ms * 1e3f,
                    last_seen, expected);
}
