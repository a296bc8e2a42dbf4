// P1: graphing a region that is not launch-bound. A graph removes per-launch host overhead (a few
// us per kernel); when each kernel runs for a millisecond (big GEMMs) that overhead is already
// hidden and the graph gains nothing. Many tiny kernels are where graphs pay.
#include "common.h"

__global__ void tiny(float* x) {
  x[threadIdx.x] += 1.0f;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P1");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x;
  EX_CHECK(cudaMalloc(&x, 32 * sizeof(float)));
  // Broken: 10 long kernels (~1 ms each, standing in for big GEMMs). Fixed: 200 tiny kernels.
  const int kernels = args.broken() ? 10 : 200;
  auto region = [&] {
    for (int k = 0; k < kernels; ++k) {
      if (args.broken())
        ex::spin_kernel<<<1, 1, 0, stream>>>(2'000'000LL);
      else
        tiny<<<1, 32, 0, stream>>>(x);
    }
  };
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  region();
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphUpload(exec, stream));

  const int iters = args.broken() ? 5 : 50;
  const float eager_ms = ex::time_ms(stream, iters, region);
  const float graph_ms =
      ex::time_ms(stream, iters, [&] { EX_CHECK(cudaGraphLaunch(exec, stream)); });
  ex::destroy_graph(exec, graph);
  const float speedup = eager_ms / graph_ms;
  // Broken shows "little or no gain" (< 1.1x); fixed shows a clear gain (> 1.2x).
  const bool ok = args.broken() ? speedup < 1.1f : speedup > 1.2f;
  return ex::report(
      "P1", args, ok, "%d %s kernels: eager %.1f us, graph %.1f us per region, speedup %.2fx",
      kernels, args.broken() ? "1-ms" : "tiny", eager_ms * 1e3f, graph_ms * 1e3f, speedup);
}
