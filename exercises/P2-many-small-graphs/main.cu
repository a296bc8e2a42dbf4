// P2: many small graphs instead of one. Each graph launch costs host time of its own (several us),
// so 100 one-kernel graphs keep the per-launch overhead and the gaps that one 100-kernel graph
// removes.
#include "common.h"

#include <vector>

__global__ void tiny(float* x) {
  x[threadIdx.x] += 1.0f;
}

static cudaGraphExec_t capture(cudaStream_t stream, float* x, int kernels) {
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kernels; ++k) tiny<<<1, 32, 0, stream>>>(x);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphUpload(exec, stream));
  EX_CHECK(cudaGraphDestroy(graph));
  return exec;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P2");
  ex::require_gpu();
  constexpr int kKernels = 100, kIters = 50;
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x;
  EX_CHECK(cudaMalloc(&x, 32 * sizeof(float)));

  std::vector<cudaGraphExec_t> small;  // Broken: one graph per kernel
  for (int k = 0; k < kKernels; ++k) small.push_back(capture(stream, x, 1));
  const cudaGraphExec_t whole =
      capture(stream, x, kKernels);  // Fixed: the whole region in one graph

  const float eager_ms = ex::time_ms(stream, kIters, [&] {
    for (int k = 0; k < kKernels; ++k) tiny<<<1, 32, 0, stream>>>(x);
  });
  const float small_ms = ex::time_ms(stream, kIters, [&] {
    for (cudaGraphExec_t g : small) EX_CHECK(cudaGraphLaunch(g, stream));
  });
  const float whole_ms =
      ex::time_ms(stream, kIters, [&] { EX_CHECK(cudaGraphLaunch(whole, stream)); });
  for (cudaGraphExec_t g : small) EX_CHECK(cudaGraphExecDestroy(g));
  EX_CHECK(cudaGraphExecDestroy(whole));

  if (args.broken()) {
    // The symptom: 100 small graphs are far slower than one graph (and barely better than eager).
    return ex::report(
        "P2", args, small_ms > 1.3f * whole_ms,
        "%d one-kernel graphs: %.1f us per step (eager %.1f us, one graph %.1f us): %.1fx slower "
        "than one graph",
        kKernels, small_ms * 1e3f, eager_ms * 1e3f, whole_ms * 1e3f, small_ms / whole_ms);
  }
  return ex::report("P2", args, eager_ms > 1.2f * whole_ms,
                    "one %d-kernel graph: %.1f us per step, eager %.1f us: speedup %.2fx", kKernels,
                    whole_ms * 1e3f, eager_ms * 1e3f, eager_ms / whole_ms);
}
