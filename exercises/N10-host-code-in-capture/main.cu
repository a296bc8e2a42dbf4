// N10: host code inside the captured region (a counter, a log line, a Python-side update). It runs
// once, while capturing, and never again: replays only contain GPU work (no error).
#include "common.h"

static int host_steps = 0;
static void CUDART_CB count_step(void*) {
  ++host_steps;
}

__global__ void work(int* x) {
  *x += 1;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N10");
  ex::require_gpu();
  constexpr int replays = 3;
  const cudaStream_t stream = ex::nonblocking_stream();
  int* x;
  EX_CHECK(cudaMalloc(&x, sizeof(int)));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  work<<<1, 1, 0, stream>>>(x);
  if (args.broken()) {
    count_step(nullptr);  // Broken: plain host code, executed now, at capture
  } else {
    // Fixed: a host node; the driver calls it on every replay, in stream order. (Host nodes must
    // not call CUDA; for real host work prefer moving it out of the captured region.)
    EX_CHECK(cudaLaunchHostFunc(stream, count_step, nullptr));
  }
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  host_steps = 0;  // count replays only
  for (int r = 0; r < replays; ++r) EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  return ex::report("N10", args, args.broken() ? host_steps == 0 : host_steps == replays,
                    "host counter after %d replays: %d (%s)", replays, host_steps,
                    host_steps == 0 ? "ran only at capture" : "a host node ran every replay");
}
