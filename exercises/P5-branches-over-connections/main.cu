// P5: a graph wider than the device runs in parallel. The guide: "more parallel branches than
// hardware connections (32 by default; CUDA_DEVICE_MAX_CONNECTIONS): branches serialize inside the
// graph".
//
// Broken: 64 independent single-block ~0.2 ms kernels as 64 parallel branches of one graph, with
// CUDA_DEVICE_MAX_CONNECTIONS at its maximum (32). All 64 blocks fit on the GPU at once, so fully
// parallel branches would take about one branch's time; the graph takes over twice that.
// Fixed: the same 64 blocks of work as 16 branches of one 4-block kernel each (width within the
// connections): about one branch's time.
#include "common.h"

#include <cstdlib>
#include <vector>

constexpr int kWork = 64;  // single-block pieces of work, each ~0.2 ms
constexpr long long kCycles = 400'000;

// Block b spins for `cycles`: one piece of work per block.
__global__ void work_kernel(long long cycles) {
  ex::spin_kernel_body(cycles);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P5");
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);  // before the first CUDA call: the maximum
  ex::require_gpu();
  const int branches = args.broken() ? kWork : 16;
  const int blocks = kWork / branches;  // per branch kernel

  const cudaStream_t stream = ex::nonblocking_stream();
  std::vector<cudaStream_t> side(branches);
  std::vector<cudaEvent_t> joins(branches);
  const cudaEvent_t fork = ex::untimed_event();
  for (int b = 0; b < branches; ++b) {
    side[b] = ex::nonblocking_stream();
    joins[b] = ex::untimed_event();
  }
  // `branches` parallel branches: fork every side stream from the origin, join them all back.
  auto enqueue = [&] {
    EX_CHECK(cudaEventRecord(fork, stream));
    for (int b = 0; b < branches; ++b) {
      EX_CHECK(cudaStreamWaitEvent(side[b], fork, 0));
      work_kernel<<<blocks, 1, 0, side[b]>>>(kCycles);
      EX_CHECK(cudaGetLastError());
      EX_CHECK(cudaEventRecord(joins[b], side[b]));
      EX_CHECK(cudaStreamWaitEvent(stream, joins[b], 0));
    }
  };
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue();
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  const float one_ms = ex::time_ms(stream, 10, [&] { work_kernel<<<1, 1, 0, stream>>>(kCycles); });
  const float graph_ms = ex::time_ms(stream, 10, [&] { EX_CHECK(cudaGraphLaunch(exec, stream)); });
  const float eager_ms = ex::time_ms(stream, 10, enqueue);  // the same branches on eager streams
  ex::destroy_graph(exec, graph);
  const float graph_ratio = graph_ms / one_ms, eager_ratio = eager_ms / one_ms;
  // Fully parallel: about 1x one branch. Broken must show the serialization, fixed must not.
  const bool ok = args.broken() ? graph_ratio > 1.8f : graph_ratio < 1.5f;
  return ex::report(
      "P5", args, ok,
      "%d single-block kernels as %d parallel branches of %d-block kernels, "
      "CUDA_DEVICE_MAX_CONNECTIONS=32: one kernel %.0f us; graph %.0f us (%.1fx); eager "
      "streams %.0f us (%.1fx)",
      kWork, branches, blocks, one_ms * 1e3f, graph_ms * 1e3f, graph_ratio, eager_ms * 1e3f,
      eager_ratio);
}
