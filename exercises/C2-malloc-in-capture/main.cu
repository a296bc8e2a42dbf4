// C2: cudaMalloc inside a global-mode capture. Allocation may synchronize the device, so the
// capture refuses it (900) and is invalidated (901). In relaxed mode it would run once, uncaptured,
// at capture.
#include "common.h"

__global__ void fill(float* data, int n, float value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = value;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C2");
  ex::require_gpu();
  constexpr int n = 1024;
  const cudaStream_t stream = ex::nonblocking_stream();
  cudaGraph_t graph = nullptr;

  if (args.broken()) {
    // Broken: the temporary is allocated where it is first needed, inside the captured region.
    float* scratch = nullptr;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const cudaError_t alloc = EX_TRY(cudaMalloc(&scratch, n * sizeof(float)));
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));
    if (alloc == cudaSuccess) EX_CHECK(cudaFree(scratch));
    const bool ok = (alloc == cudaErrorStreamCaptureUnsupported ||
                     alloc == cudaErrorStreamCaptureInvalidated) &&
                    end == cudaErrorStreamCaptureInvalidated;
    return ex::report("C2", args, ok, "cudaMalloc -> %s, cudaStreamEndCapture -> %s",
                      ex::name(alloc).c_str(), ex::name(end).c_str());
  }

  // Fixed: plan memory before capture (an arena); the graph only uses the address.
  float* scratch;
  EX_CHECK(cudaMalloc(&scratch, n * sizeof(float)));
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  fill<<<(n + 255) / 256, 256, 0, stream>>>(scratch, n, 3.0f);
  const float last = ex::end_capture_and_replay(stream, scratch + n - 1);
  EX_CHECK(cudaFree(scratch));
  return ex::report("C2", args, last == 3.0f,
                    "allocated before capture, replay wrote %.1f (expected 3.0)", last);
}
