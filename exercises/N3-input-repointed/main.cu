// N3: the input "re-pointed" after capture: the next batch is put in a new buffer instead of the
// one the graph captured. The graph keeps reading the captured address, so replay silently uses
// stale data.
#include "common.h"

__global__ void square(const float* in, float* out) {
  *out = *in * *in;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N3");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float *static_input, *out;
  EX_CHECK(cudaMalloc(&static_input, sizeof(float)));
  EX_CHECK(cudaMalloc(&out, sizeof(float)));
  const float batch1 = 2.0f, batch2 = 3.0f;
  EX_CHECK(cudaMemcpy(static_input, &batch1, sizeof(float), cudaMemcpyHostToDevice));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  square<<<1, 1, 0, stream>>>(static_input, out);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  float* next_batch = nullptr;
  if (args.broken()) {
    // Broken: the loader hands over a fresh buffer ("input = new_tensor"); the graph never sees it.
    EX_CHECK(cudaMalloc(&next_batch, sizeof(float)));
    EX_CHECK(cudaMemcpyAsync(next_batch, &batch2, sizeof(float), cudaMemcpyHostToDevice, stream));
  } else {
    // Fixed: persistent input, updated in place before each replay.
    EX_CHECK(cudaMemcpyAsync(static_input, &batch2, sizeof(float), cudaMemcpyHostToDevice, stream));
  }
  EX_CHECK(cudaGraphLaunch(exec, stream));
  float result = 0;
  EX_CHECK(cudaMemcpyAsync(&result, out, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  if (next_batch) EX_CHECK(cudaFree(next_batch));
  ex::destroy_graph(exec, graph);
  const bool ok = args.broken() ? result == 4.0f : result == 9.0f;
  return ex::report("N3", args, ok, "second batch is 3, replay computed %.0f (%s)", result,
                    result == 4.0f ? "squared the stale first batch" : "3 squared");
}
