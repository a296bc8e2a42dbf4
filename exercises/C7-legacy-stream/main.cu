// C7: the legacy default stream (stream 0) during a capture. It synchronizes implicitly with every
// blocking stream, so a launch on it while a blocking stream captures is refused (906, implicit
// dependency); the legacy stream itself cannot be captured (900). From a non-blocking capture
// stream the same launch is silently run eagerly and is missing from the graph.
#include "common.h"

__global__ void add(int* value, int amount) {
  atomicAdd(value, amount);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C7");
  ex::require_gpu();
  int* value = ex::device_zeros<int>();
  cudaGraph_t graph = nullptr;

  if (args.broken()) {
    // 1. A blocking stream (cudaStreamCreate's default) captures; a helper launches on stream 0.
    cudaStream_t blocking;
    EX_CHECK(cudaStreamCreate(&blocking));
    EX_CHECK(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal));
    add<<<1, 1, 0, blocking>>>(value, 1);
    add<<<1, 1>>>(value, 10);  // stream 0
    const cudaError_t launch = EX_TRY(cudaGetLastError());
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(blocking, &graph));
    // 2. Capturing the legacy stream itself.
    const cudaError_t begin0 = EX_TRY(cudaStreamBeginCapture(0, cudaStreamCaptureModeGlobal));
    if (begin0 == cudaSuccess) EX_TRY(cudaStreamEndCapture(0, &graph));
    const bool ok = ex::is_capture_error(launch) && end == cudaErrorStreamCaptureInvalidated &&
                    ex::is_capture_error(begin0);
    return ex::report(
        "C7", args, ok,
        "launch on stream 0 -> %s, cudaStreamEndCapture -> %s, cudaStreamBeginCapture(0) -> %s",
        ex::name(launch).c_str(), ex::name(end).c_str(), ex::name(begin0).c_str());
  }
  // Fixed: explicit non-blocking streams everywhere, every launch on the capture stream.
  cudaStream_t stream;
  EX_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  add<<<1, 1, 0, stream>>>(value, 1);
  add<<<1, 1, 0, stream>>>(value, 10);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const int host = ex::read_back(value);
  const size_t nodes = ex::node_count(graph);
  ex::destroy_graph(exec, graph);
  return ex::report(
      "C7", args, host == 11 && nodes == 2,
      "non-blocking capture stream, %zu kernel nodes, replay gave %d (expected 2 nodes, 11)", nodes,
      host);
}
