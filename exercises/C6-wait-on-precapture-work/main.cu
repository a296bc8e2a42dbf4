// C6: inside a capture, waiting on an event recorded before the capture began (e.g. "the loader's
// copy is done"). The graph cannot depend on work outside it: 905 (isolation), then the capture is
// invalidated (901).
#include "common.h"

__global__ void scale(float* x, float factor) {
  *x *= factor;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C6");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream(), loader = ex::nonblocking_stream();
  const cudaEvent_t batch_ready = ex::untimed_event();
  float* x;
  EX_CHECK(cudaMalloc(&x, sizeof(float)));
  const float batch = 3.0f;
  EX_CHECK(cudaMemcpyAsync(x, &batch, sizeof(float), cudaMemcpyHostToDevice, loader));
  EX_CHECK(cudaEventRecord(batch_ready, loader));  // recorded before any capture

  cudaGraph_t graph = nullptr;
  if (args.broken()) {
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const cudaError_t wait = EX_TRY(cudaStreamWaitEvent(stream, batch_ready, 0));
    scale<<<1, 1, 0, stream>>>(x, 2.0f);
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));
    const bool ok =
        (wait == cudaErrorStreamCaptureIsolation || wait == cudaErrorStreamCaptureInvalidated) &&
        end == cudaErrorStreamCaptureInvalidated;
    return ex::report("C6", args, ok,
                      "cudaStreamWaitEvent on a pre-capture event -> %s, "
                      "cudaStreamEndCapture -> %s",
                      ex::name(wait).c_str(), ex::name(end).c_str());
  }
  // Fixed: wait before capture begins; each replay is ordered after it by the stream.
  EX_CHECK(cudaStreamWaitEvent(stream, batch_ready, 0));
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  scale<<<1, 1, 0, stream>>>(x, 2.0f);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  float result = 0;
  EX_CHECK(cudaMemcpyAsync(&result, x, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  return ex::report("C6", args, result == 6.0f,
                    "waited before capture, replay gave %.0f (expected 6)", result);
}
