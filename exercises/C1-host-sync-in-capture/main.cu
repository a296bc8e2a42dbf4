// C1: a host synchronization inside a stream capture. The capture records work, it does not run it,
// so there is nothing to wait for: cudaStreamSynchronize is refused and the capture is invalidated.
#include "common.h"

__global__ void set_value(int* out, int value) {
  *out = value;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C1");
  ex::require_gpu();

  const cudaStream_t stream = ex::nonblocking_stream();
  int* value = ex::device_zeros<int>();

  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  set_value<<<1, 1, 0, stream>>>(value, 42);
  if (args.broken()) {
    // Broken: "wait for the kernel" the way eager code does, e.g. to read a loss on the host.
    const cudaError_t sync = EX_TRY(cudaStreamSynchronize(stream));
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));
    // The documented symptom: 900 at the sync (901 when the capture was already invalidated), then
    // 901 at EndCapture with no graph.
    const bool ok =
        (sync == cudaErrorStreamCaptureUnsupported || sync == cudaErrorStreamCaptureInvalidated) &&
        end == cudaErrorStreamCaptureInvalidated && graph == nullptr;
    return ex::report("C1", args, ok,
                      "cudaStreamSynchronize -> %s, cudaStreamEndCapture -> %s, graph %s",
                      ex::name(sync).c_str(), ex::name(end).c_str(), graph ? "returned" : "null");
  }

  // Fixed: end the capture, replay, and synchronize after the replay, outside the capture.
  const int host = ex::end_capture_and_replay(stream, value);
  EX_CHECK(cudaFree(value));
  EX_CHECK(cudaStreamDestroy(stream));
  return ex::report("C1", args, host == 42, "synchronized after replay, read value %d%s", host,
                    host == 42 ? " as expected" : " (expected 42)");
}
