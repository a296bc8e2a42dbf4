// P2: many small graphs instead of one. Each graph launch costs host time of its own (several us),
// so 100 one-kernel graphs keep most of the per-launch overhead and the gaps that one 100-kernel
// graph removes. Broken: the region as 100 one-kernel graphs. Fixed: the region as one graph. Both
// are timed against the same region launched eagerly.
#include "common.h"

#include <vector>

constexpr int kKernels = 100, kIters = 50;
// Speedup over eager: broken stays under it, fixed is above (on H100s about 2.2x and 4-5x).
constexpr float kThreshold = 3.0f;

__global__ void tiny(float* x) {
  x[threadIdx.x] += 1.0f;
}

// Captures `kernels` launches of tiny into one graph and returns its uploaded executable.
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
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x = ex::device_zeros<float>(32);

  // Broken: one graph per kernel, 100 launches a step. Fixed: the whole region in one graph.
  std::vector<cudaGraphExec_t> graphs;
  if (args.broken()) {
    for (int k = 0; k < kKernels; ++k) graphs.push_back(capture(stream, x, 1));
  } else {
    graphs.push_back(capture(stream, x, kKernels));
  }
  const float eager_ms = ex::time_ms(stream, kIters, [&] {
    for (int k = 0; k < kKernels; ++k) tiny<<<1, 32, 0, stream>>>(x);
  });
  const float graph_ms = ex::time_ms(stream, kIters, [&] {
    for (cudaGraphExec_t g : graphs) EX_CHECK(cudaGraphLaunch(g, stream));
  });
  for (cudaGraphExec_t g : graphs) EX_CHECK(cudaGraphExecDestroy(g));
  // Every launch, eager or graphed, added 1 to each element: 2 warm-ups and 2 x kIters timed steps.
  const float expected = 2.0f * (1 + kIters) * kKernels;
  const float value = ex::read_back(x);
  const float speedup = eager_ms / graph_ms;
  const bool ok =
      value == expected && (args.broken() ? speedup < kThreshold : speedup > kThreshold);
  if (args.broken()) {
    return ex::report("P2", args, ok,
                      "%d one-kernel graphs: %.1f us per step, eager %.1f us: speedup %.2fx "
                      "(under %.1fx: 100 graph launches a step)",
                      kKernels, graph_ms * 1e3f, eager_ms * 1e3f, speedup, kThreshold);
  }
  return ex::report("P2", args, ok,
                    "one %d-kernel graph: %.1f us per step, eager %.1f us: speedup %.2fx (over "
                    "%.1fx: one graph launch a step)",
                    kKernels, graph_ms * 1e3f, eager_ms * 1e3f, speedup, kThreshold);
}
