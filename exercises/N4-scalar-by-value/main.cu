// N4: a scalar that changes between steps (learning rate, step, loss scale) passed by value. The
// value is copied into the kernel node's arguments at capture; later host changes never reach the
// replay.
#include "common.h"

__global__ void add_by_value(float* x, float amount) {
  *x += amount;
}
__global__ void add_by_pointer(float* x, const float* amount) {
  *x += *amount;
}

static float replay_once(cudaGraphExec_t exec, cudaStream_t stream, float* x) {
  const float zero = 0;
  float result = 0;
  EX_CHECK(cudaMemcpyAsync(x, &zero, sizeof(float), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaMemcpyAsync(&result, x, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  return result;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N4");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float *x, *lr;
  EX_CHECK(cudaMalloc(&x, sizeof(float)));
  EX_CHECK(cudaMalloc(&lr, sizeof(float)));
  float host_lr = 1.0f;  // the value at capture time
  EX_CHECK(cudaMemcpy(lr, &host_lr, sizeof(float), cudaMemcpyHostToDevice));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  if (args.broken())
    add_by_value<<<1, 1, 0, stream>>>(x, host_lr);
  else
    add_by_pointer<<<1, 1, 0, stream>>>(x, lr);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  // The schedule moves on: the learning rate is now 5.
  host_lr = 5.0f;
  EX_CHECK(cudaMemcpy(lr, &host_lr, sizeof(float), cudaMemcpyHostToDevice));
  const float first = replay_once(exec, stream, x);
  if (args.broken()) {
    return ex::report("N4", args, first == 1.0f,
                      "host set 5 after capture, replay still added %.0f", first);
  }
  // Second fix, for a by-value kernel: patch the argument of the instantiated node in place.
  cudaGraph_t graph2;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  add_by_value<<<1, 1, 0, stream>>>(x, 1.0f);
  const cudaGraphExec_t exec2 = ex::end_capture_and_instantiate(stream, &graph2);
  cudaGraphNode_t node;
  size_t count = 1;
  EX_CHECK(cudaGraphGetNodes(graph2, &node, &count));
  cudaKernelNodeParams params;
  EX_CHECK(cudaGraphKernelNodeGetParams(node, &params));
  float new_amount = 9.0f;
  void* kernel_args[] = {&x, &new_amount};
  params.kernelParams = kernel_args;
  params.extra = nullptr;
  EX_CHECK(cudaGraphExecKernelNodeSetParams(exec2, node, &params));
  const float patched = replay_once(exec2, stream, x);
  ex::destroy_graph(exec2, graph2);
  ex::destroy_graph(exec, graph);
  return ex::report(
      "N4", args, first == 5.0f && patched == 9.0f,
      "pointer version added %.0f (expected 5), cudaGraphExecKernelNodeSetParams with 9 added "
      "%.0f",
      first, patched);
}
