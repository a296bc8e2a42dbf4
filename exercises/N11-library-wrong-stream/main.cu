// N11: a library call that runs on its own stream (its handle was never given the capture stream).
// That stream is not capturing: the library's kernel runs once, right away, at capture, and is
// absent from every replay (no error).
#include "common.h"

__global__ void add(int* x, int amount) {
  *x += amount;
}

// A stand-in for a library handle (cuBLAS, cuDNN, NCCL...) with a stream of its own.
struct Library {
  cudaStream_t own;     // created with the handle
  cudaStream_t stream;  // where the library launches: its own stream unless told otherwise
  Library() {
    EX_CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    stream = own;
  }
  ~Library() { cudaStreamDestroy(own); }
  void set_stream(cudaStream_t s) { stream = s; }
  void bias_add(int* x) { add<<<1, 1, 0, stream>>>(x, 1); }
};

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N11");
  ex::require_gpu();
  constexpr int replays = 3;
  const cudaStream_t stream = ex::nonblocking_stream();
  int* x = ex::device_zeros<int>();
  Library lib;
  if (!args.broken()) lib.set_stream(stream);  // Fixed: the library works on the capture stream

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  add<<<1, 1, 0, stream>>>(x, 10);
  lib.bias_add(x);
  EX_CHECK(cudaStreamEndCapture(stream, &graph));
  EX_CHECK(cudaStreamSynchronize(lib.own));  // the eager run (broken mode) has finished
  const size_t nodes = ex::node_count(graph);
  const cudaGraphExec_t exec = ex::instantiate(graph);
  EX_CHECK(cudaMemsetAsync(x, 0, sizeof(int), stream));
  for (int r = 0; r < replays; ++r) EX_CHECK(cudaGraphLaunch(exec, stream));
  int host = 0;
  EX_CHECK(cudaMemcpyAsync(&host, x, sizeof(int), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  const bool ok = args.broken() ? host == 30 && nodes == 1 : host == 33 && nodes == 2;
  return ex::report("N11", args, ok, "graph has %zu nodes, %d replays gave %d (expected 33)", nodes,
                    replays, host);
}
