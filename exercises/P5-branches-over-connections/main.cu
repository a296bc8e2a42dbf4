// P5: a graph with more parallel branches than the device has hardware work queues (connections,
// CUDA_DEVICE_MAX_CONNECTIONS). Independent branches beyond that number share queues and serialize,
// so a graph of 16 parallel ~0.2 ms kernels takes several times one kernel's time.
#include "common.h"

#include <cstdlib>
#include <vector>

constexpr int kBranches = 16;
constexpr long long kCycles =
    400'000;  // ~0.2 ms per branch, one block each: all fit on the GPU at once

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P5");
  // Must be set before the first CUDA call. Broken: one hardware queue for 16 branches (with 4, an
  // H200 under CUDA 13 showed only 1.5x for eager streams and 1.1x for the graph); fixed: one each.
  const char* connections = args.broken() ? "1" : "16";
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections, 1);
  ex::require_gpu();

  cudaStream_t stream;
  EX_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<cudaStream_t> side(kBranches);
  std::vector<cudaEvent_t> joins(kBranches);
  cudaEvent_t fork;
  EX_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (int b = 0; b < kBranches; ++b) {
    EX_CHECK(cudaStreamCreateWithFlags(&side[b], cudaStreamNonBlocking));
    EX_CHECK(cudaEventCreateWithFlags(&joins[b], cudaEventDisableTiming));
  }
  // kBranches independent branches: fork every side stream from the capture stream, join them all
  // back.
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EX_CHECK(cudaEventRecord(fork, stream));
  for (int b = 0; b < kBranches; ++b) {
    EX_CHECK(cudaStreamWaitEvent(side[b], fork, 0));
    ex::spin_kernel<<<1, 1, 0, side[b]>>>(kCycles);
    EX_CHECK(cudaEventRecord(joins[b], side[b]));
    EX_CHECK(cudaStreamWaitEvent(stream, joins[b], 0));
  }
  EX_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  EX_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  const float one_ms =
      ex::time_ms(stream, 10, [&] { ex::spin_kernel<<<1, 1, 0, stream>>>(kCycles); });
  const float graph_ms = ex::time_ms(stream, 10, [&] { EX_CHECK(cudaGraphLaunch(exec, stream)); });
  // The same branches launched eagerly on kBranches streams: here each stream needs a hardware queue.
  const float eager_ms = ex::time_ms(stream, 10, [&] {
    EX_CHECK(cudaEventRecord(fork, stream));
    for (int b = 0; b < kBranches; ++b) {
      EX_CHECK(cudaStreamWaitEvent(side[b], fork, 0));
      ex::spin_kernel<<<1, 1, 0, side[b]>>>(kCycles);
      EX_CHECK(cudaEventRecord(joins[b], side[b]));
      EX_CHECK(cudaStreamWaitEvent(stream, joins[b], 0));
    }
  });
  EX_CHECK(cudaGraphExecDestroy(exec));
  EX_CHECK(cudaGraphDestroy(graph));
  const float eager_ratio = eager_ms / one_ms, graph_ratio = graph_ms / one_ms;
  // Fully parallel branches take about one branch's time; 16 streams on one queue about 16x. The graph's
  // branches are reported as measured (see README: on CUDA 13 they did not serialize).
  if (args.broken() && eager_ratio < 2.0f) {
    // The symptom needs a driver that honours the variable; say so and let CTest count a skip.
    std::printf("SKIPPED: P5 broken: CUDA_DEVICE_MAX_CONNECTIONS=%s did not serialize %d eager streams "
                "(%.1fx one branch; graph %.1fx) on this driver, so the symptom cannot be shown here\n",
                connections, kBranches, eager_ratio, graph_ratio);
    return 77;
  }
  const bool ok = args.broken() ? eager_ratio > 2.0f : eager_ratio < 1.5f;
  return ex::report(
      "P5", args, ok,
      "%d parallel branches with CUDA_DEVICE_MAX_CONNECTIONS=%s: one branch %.0f us; eager streams "
      "%.0f us (%.1fx); graph %.0f us (%.1fx)",
      kBranches, connections, one_ms * 1e3f, eager_ms * 1e3f, eager_ratio, graph_ms * 1e3f,
      graph_ratio);
}
