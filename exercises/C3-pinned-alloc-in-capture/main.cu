// C3: pinning host memory (cudaMallocHost / cudaHostAlloc) inside a capture, e.g. a staging buffer
// created on first use. Pinning synchronizes with the device, so the capture refuses it (900) in
// global mode and, for the capturing thread itself, in thread-local mode too. Relaxed mode lets it
// through (it runs once, at capture).
#include "common.h"

__global__ void set_value(float* out, float value) {
  *out = value;
}

// Begins a capture in `mode`, pins `bytes` with `pin`, ends the capture; returns both errors.
template <typename Pin>
static void pin_in_capture(cudaStream_t stream, cudaStreamCaptureMode mode, Pin pin,
                           cudaError_t* pin_err, cudaError_t* end_err) {
  void* host = nullptr;
  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(stream, mode));
  *pin_err = EX_TRY(pin(&host));
  *end_err = EX_TRY(cudaStreamEndCapture(stream, &graph));
  if (graph) EX_CHECK(cudaGraphDestroy(graph));
  if (*pin_err == cudaSuccess) EX_CHECK(cudaFreeHost(host));
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C3");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* device_value;
  EX_CHECK(cudaMalloc(&device_value, sizeof(float)));

  if (args.broken()) {
    cudaError_t global_pin, global_end, local_pin, local_end;
    pin_in_capture(
        stream, cudaStreamCaptureModeGlobal, [](void** p) { return cudaMallocHost(p, 1 << 20); },
        &global_pin, &global_end);
    pin_in_capture(
        stream, cudaStreamCaptureModeThreadLocal,
        [](void** p) { return cudaHostAlloc(p, 1 << 20, cudaHostAllocDefault); }, &local_pin,
        &local_end);
    const bool ok = ex::is_capture_error(global_pin) && ex::is_capture_error(local_pin) &&
                    global_end == cudaErrorStreamCaptureInvalidated &&
                    local_end == cudaErrorStreamCaptureInvalidated;
    return ex::report(
        "C3", args, ok,
        "cudaMallocHost (global) -> %s, EndCapture -> %s; cudaHostAlloc (thread-local) -> %s, "
        "EndCapture -> %s",
        ex::name(global_pin).c_str(), ex::name(global_end).c_str(), ex::name(local_pin).c_str(),
        ex::name(local_end).c_str());
  }
  // Fixed: pin the staging buffer before capture; the graph copies from it on every replay.
  float* staging;
  EX_CHECK(cudaMallocHost(&staging, sizeof(float)));
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  set_value<<<1, 1, 0, stream>>>(device_value, 8.0f);
  EX_CHECK(cudaMemcpyAsync(staging, device_value, sizeof(float), cudaMemcpyDeviceToHost, stream));
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  *staging = 0;
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const float got = *staging;
  ex::destroy_graph(exec, graph);
  EX_CHECK(cudaFreeHost(staging));
  return ex::report("C3", args, got == 8.0f,
                    "pinned before capture, replay copied %.0f (expected 8)", got);
}
