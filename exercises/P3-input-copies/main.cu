// P3: copying each batch into the graph's static input buffer costs more than the graphed work. The
// loader already produced the batch on the device; the extra device-to-device copy of 256 MiB (~0.2
// ms) dwarfs a region of small kernels. Fix: have the producer write straight into the static
// buffer.
#include "common.h"

__global__ void tiny(float* x) {
  x[threadIdx.x] += 1.0f;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P3");
  ex::require_gpu();
  constexpr size_t kBytes = size_t(256) << 20;
  constexpr int kKernels = 20, kIters = 20;
  const cudaStream_t stream = ex::nonblocking_stream();
  float *loader_batch, *static_input;
  EX_CHECK(cudaMalloc(&loader_batch, kBytes));
  EX_CHECK(cudaMalloc(&static_input, kBytes));
  EX_CHECK(cudaMemset(loader_batch, 0, kBytes));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kKernels; ++k) tiny<<<1, 32, 0, stream>>>(static_input);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphUpload(exec, stream));

  // Broken step: copy the batch into the static input, then replay. Fixed step: the loader wrote
  // into static_input itself, so a step is just the replay.
  const float copy_step_ms = ex::time_ms(stream, kIters, [&] {
    EX_CHECK(cudaMemcpyAsync(static_input, loader_batch, kBytes, cudaMemcpyDeviceToDevice, stream));
    EX_CHECK(cudaGraphLaunch(exec, stream));
  });
  const float graph_ms =
      ex::time_ms(stream, kIters, [&] { EX_CHECK(cudaGraphLaunch(exec, stream)); });
  ex::destroy_graph(exec, graph);
  const float copy_ms = copy_step_ms - graph_ms;
  if (args.broken()) {
    return ex::report(
        "P3", args, copy_ms > graph_ms,
        "step with input copy %.1f us: the 256 MiB copy takes %.1f us, the graphed work %.1f us",
        copy_step_ms * 1e3f, copy_ms * 1e3f, graph_ms * 1e3f);
  }
  return ex::report(
      "P3", args, graph_ms < 0.5f * copy_step_ms,
      "producer writes the static input: step %.1f us instead of %.1f us with the copy",
      graph_ms * 1e3f, copy_step_ms * 1e3f);
}
