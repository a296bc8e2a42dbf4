// C10: another thread (a watchdog, a logger, a data loader) queries an event while this thread
// captures in global mode. Global mode forbids unsafe calls in every thread: the other thread gets
// 900 and the capture is invalidated (901). Thread-local mode confines the rule to the capturing
// thread.
#include "common.h"

#include <thread>

__global__ void set_value(int* out, int value) {
  *out = value;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C10");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream(), watched = ex::nonblocking_stream();
  const cudaEvent_t progress = ex::untimed_event();
  EX_CHECK(cudaEventRecord(progress, watched));
  EX_CHECK(cudaStreamSynchronize(watched));
  int* value;
  EX_CHECK(cudaMalloc(&value, sizeof(int)));

  const cudaStreamCaptureMode mode =
      args.broken() ? cudaStreamCaptureModeGlobal : cudaStreamCaptureModeThreadLocal;
  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(stream, mode));
  set_value<<<1, 1, 0, stream>>>(value, 5);
  // The watchdog checks its own, unrelated event while the capture is open.
  cudaError_t query = cudaSuccess;
  std::thread watchdog([&] { query = EX_TRY(cudaEventQuery(progress)); });
  watchdog.join();
  const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));

  if (args.broken()) {
    const bool ok = ex::is_capture_error(query) && end == cudaErrorStreamCaptureInvalidated;
    return ex::report("C10", args, ok,
                      "global mode: other thread's cudaEventQuery -> %s, "
                      "cudaStreamEndCapture -> %s",
                      ex::name(query).c_str(), ex::name(end).c_str());
  }
  EX_CHECK(end);
  const cudaGraphExec_t exec = ex::instantiate(graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  int host = 0;
  EX_CHECK(cudaMemcpyAsync(&host, value, sizeof(int), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  return ex::report(
      "C10", args, query == cudaSuccess && host == 5,
      "thread-local mode: other thread's cudaEventQuery -> %s, capture ok, replay gave %d",
      ex::name(query).c_str(), host);
}
