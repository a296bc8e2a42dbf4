// N5: the problem size changes after capture (a longer sequence, a bigger last batch). The grid and
// the size argument were frozen at capture, so the replay silently skips the extra elements.
#include "common.h"

constexpr int kThreads = 256;

__global__ void add_one_n(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
// Fixed: the grid covers the largest size (the bucket), the kernel reads the live size on the
// device.
__global__ void add_one_dev(float* x, const int* n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < *n) x[i] += 1.0f;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N5");
  ex::require_gpu();
  constexpr int kCaptured = 1000, kLater = 1500, kMax = 2048;
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x;
  int* n_dev;
  EX_CHECK(cudaMalloc(&x, kMax * sizeof(float)));
  EX_CHECK(cudaMalloc(&n_dev, sizeof(int)));
  int n = kCaptured;
  EX_CHECK(cudaMemcpy(n_dev, &n, sizeof(int), cudaMemcpyHostToDevice));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  if (args.broken())
    add_one_n<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(x, n);
  else
    add_one_dev<<<kMax / kThreads, kThreads, 0, stream>>>(x, n_dev);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  n = kLater;  // the new batch is longer
  EX_CHECK(cudaMemcpyAsync(n_dev, &n, sizeof(int), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaMemsetAsync(x, 0, kMax * sizeof(float), stream));
  EX_CHECK(cudaGraphLaunch(exec, stream));
  float host[kMax];
  EX_CHECK(cudaMemcpyAsync(host, x, sizeof(host), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  int processed = 0, beyond = 0;
  for (int i = 0; i < kLater; ++i) processed += host[i] == 1.0f;
  for (int i = kLater; i < kMax; ++i) beyond += host[i] != 0.0f;
  const bool ok = beyond == 0 && (args.broken() ? processed == kCaptured : processed == kLater);
  return ex::report("N5", args, ok,
                    "captured at n=%d, replayed at n=%d: %d of %d elements processed", kCaptured,
                    kLater, processed, kLater);
}
