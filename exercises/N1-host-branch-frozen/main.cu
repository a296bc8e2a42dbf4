// N1: a host `if` inside the captured region. Capture records only the branch taken at capture, so
// the graph keeps doing it on every replay, whatever the host flag says later (no error).
#include "common.h"

__global__ void add_one(float* x) {
  *x += 1.0f;
}
__global__ void double_it(float* x) {
  *x *= 2.0f;
}
// Fixed: the branch moves into the kernel and reads the flag from device memory.
__global__ void add_or_double(float* x, const int* use_add) {
  if (*use_add)
    *x += 1.0f;
  else
    *x *= 2.0f;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N1");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x;
  int* flag;
  EX_CHECK(cudaMalloc(&x, sizeof(float)));
  EX_CHECK(cudaMalloc(&flag, sizeof(int)));

  int use_add = 1;  // e.g. "warm-up phase" at capture time
  EX_CHECK(cudaMemcpy(flag, &use_add, sizeof(int), cudaMemcpyHostToDevice));
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  if (args.broken()) {
    if (use_add)
      add_one<<<1, 1, 0, stream>>>(x);
    else
      double_it<<<1, 1, 0, stream>>>(x);
  } else {
    add_or_double<<<1, 1, 0, stream>>>(x, flag);
  }
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  // The phase changes: from now on x should be doubled. Start from 5: expect 10.
  use_add = 0;
  EX_CHECK(cudaMemcpyAsync(flag, &use_add, sizeof(int), cudaMemcpyHostToDevice, stream));
  const float start = 5.0f;
  EX_CHECK(cudaMemcpyAsync(x, &start, sizeof(float), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaGraphLaunch(exec, stream));
  float result = 0;
  EX_CHECK(cudaMemcpyAsync(&result, x, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  const bool ok = args.broken() ? result == 6.0f : result == 10.0f;
  return ex::report("N1", args, ok, "flag switched to double after capture, 5 -> %.0f (%s)", result,
                    result == 6.0f ? "the captured add branch still ran" : "doubled as asked");
}
