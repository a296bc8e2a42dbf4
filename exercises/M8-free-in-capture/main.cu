// M8: freeing memory during a capture (releasing a temporary as soon as it is dead). cudaFree may
// synchronize the device: global mode refuses it (900) and the capture is invalidated (901).
// Relaxed mode would free it immediately, at capture, while the graph still uses it at every
// replay.
#include "common.h"

__global__ void square_into(const float* in, float* tmp, float* out) {
  *tmp = *in * *in;
  *out = *tmp + 1.0f;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "M8");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float *in, *out;
  EX_CHECK(cudaMalloc(&in, sizeof(float)));
  EX_CHECK(cudaMalloc(&out, sizeof(float)));
  const float three = 3.0f;
  EX_CHECK(cudaMemcpy(in, &three, sizeof(float), cudaMemcpyHostToDevice));
  cudaGraph_t graph = nullptr;

  if (args.broken()) {
    float* tmp;
    EX_CHECK(cudaMalloc(&tmp, sizeof(float)));
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    square_into<<<1, 1, 0, stream>>>(in, tmp, out);
    const cudaError_t free_err = EX_TRY(cudaFree(tmp));  // "tmp is dead now"
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));
    const bool ok = (free_err == cudaErrorStreamCaptureUnsupported ||
                     free_err == cudaErrorStreamCaptureInvalidated) &&
                    end == cudaErrorStreamCaptureInvalidated;
    return ex::report("M8", args, ok, "cudaFree -> %s, cudaStreamEndCapture -> %s",
                      ex::name(free_err).c_str(), ex::name(end).c_str());
  }
  // Fixed: stream-ordered allocation inside the capture becomes graph memory nodes (alloc, free)
  // whose lifetime the graph manages; or keep the temporary in a planned arena and never free it
  // mid-step.
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  float* tmp;
  EX_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&tmp), sizeof(float), stream));
  square_into<<<1, 1, 0, stream>>>(in, tmp, out);
  EX_CHECK(cudaFreeAsync(tmp, stream));
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  float result = 0;
  for (int r = 0; r < 3; ++r) EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaMemcpyAsync(&result, out, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  return ex::report(
      "M8", args, result == 10.0f,
      "cudaMallocAsync/cudaFreeAsync captured as memory nodes, 3 replays gave %.0f (expected 10)",
      result);
}
