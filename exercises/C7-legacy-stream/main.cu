// C7: the legacy default stream (stream 0) during a capture. It synchronizes implicitly with every
// blocking stream, so a launch on it while a blocking stream captures is refused (906, implicit
// dependency); the legacy stream itself cannot be captured (900). From a non-blocking capture
// stream the same launch is silently run eagerly and is missing from the graph; the broken mode
// shows all three.
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
    // 3. A non-blocking stream captures; the helper's launch on stream 0 is accepted, runs at once
    //    (at capture time) and is missing from the graph: 3 replays add 1 each, not 11.
    int* dropped = ex::device_zeros<int>();
    const cudaStream_t nonblocking = ex::nonblocking_stream();
    EX_CHECK(cudaStreamBeginCapture(nonblocking, cudaStreamCaptureModeGlobal));
    add<<<1, 1, 0, nonblocking>>>(dropped, 1);
    add<<<1, 1>>>(dropped, 10);  // stream 0
    const cudaError_t silent = EX_TRY(cudaGetLastError());
    cudaGraph_t partial = nullptr;
    const cudaError_t end_nb = EX_TRY(cudaStreamEndCapture(nonblocking, &partial));
    size_t nodes = 0;
    int at_capture = -1, replayed = -1;
    if (end_nb == cudaSuccess) {
      nodes = ex::node_count(partial);
      EX_CHECK(cudaDeviceSynchronize());
      at_capture = ex::read_back(dropped);  // before any replay
      const cudaGraphExec_t exec = ex::instantiate(partial);
      for (int r = 0; r < 3; ++r) EX_CHECK(cudaGraphLaunch(exec, nonblocking));
      EX_CHECK(cudaStreamSynchronize(nonblocking));
      replayed = ex::read_back(dropped) - at_capture;
      ex::destroy_graph(exec, partial);
    }
    const bool ok = ex::is_capture_error(launch) && end == cudaErrorStreamCaptureInvalidated &&
                    ex::is_capture_error(begin0) && silent == cudaSuccess &&
                    end_nb == cudaSuccess && nodes == 1 && at_capture == 10 && replayed == 3;
    return ex::report(
        "C7", args, ok,
        "launch on stream 0 -> %s, cudaStreamEndCapture -> %s, cudaStreamBeginCapture(0) -> %s; "
        "non-blocking capture: launch on stream 0 -> %s, cudaStreamEndCapture -> %s, %zu kernel "
        "node (expected 2), the stream-0 kernel ran at capture (value %d), 3 replays added %d "
        "(expected 33)",
        ex::name(launch).c_str(), ex::name(end).c_str(), ex::name(begin0).c_str(),
        ex::name(silent).c_str(), ex::name(end_nb).c_str(), nodes, at_capture, replayed);
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
