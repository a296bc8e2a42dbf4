// C9: polling a stream during its capture ("is the step done yet?"). A capturing stream has no
// progress to report: cudaStreamQuery is refused (900) and the capture is invalidated (901).
#include "common.h"

__global__ void set_value(int* out, int value) {
  *out = value;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C9");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  int* value;
  EX_CHECK(cudaMalloc(&value, sizeof(int)));

  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  set_value<<<1, 1, 0, stream>>>(value, 7);
  if (args.broken()) {
    const cudaError_t query = EX_TRY(cudaStreamQuery(stream));
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));
    const bool ok = (query == cudaErrorStreamCaptureUnsupported ||
                     query == cudaErrorStreamCaptureInvalidated) &&
                    end == cudaErrorStreamCaptureInvalidated;
    return ex::report("C9", args, ok, "cudaStreamQuery -> %s, cudaStreamEndCapture -> %s",
                      ex::name(query).c_str(), ex::name(end).c_str());
  }
  // Fixed: query after the replay was launched, outside any capture.
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  cudaError_t query;
  while ((query = cudaStreamQuery(stream)) == cudaErrorNotReady) {
  }
  EX_CHECK(query);
  const int host = ex::read_back(value);
  ex::destroy_graph(exec, graph);
  return ex::report("C9", args, host == 7,
                    "polled after replay until cudaSuccess, value %d (expected 7)", host);
}
