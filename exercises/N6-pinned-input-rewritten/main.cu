// N6: the host rewrites a pinned input buffer for the next step while earlier replays, still
// queued, have not copied it yet. Replays launch asynchronously; their H2D copies read the buffer
// when they run, so they all see the last value written (no error).
#include "common.h"

// out[*slot] = *in, then the slot advances: one output per replay.
__global__ void record(const int* in, int* out, int* slot) {
  out[(*slot)++] = *in;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N6");
  ex::require_gpu();
  constexpr int steps = 4;
  const cudaStream_t stream = ex::nonblocking_stream();
  int* pinned;
  EX_CHECK(cudaMallocHost(&pinned, sizeof(int)));
  int *in, *out, *slot;
  EX_CHECK(cudaMalloc(&in, sizeof(int)));
  EX_CHECK(cudaMalloc(&out, steps * sizeof(int)));
  EX_CHECK(cudaMalloc(&slot, sizeof(int)));
  EX_CHECK(cudaMemset(slot, 0, sizeof(int)));
  const cudaEvent_t consumed = ex::untimed_event();

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EX_CHECK(cudaMemcpyAsync(in, pinned, sizeof(int), cudaMemcpyHostToDevice, stream));
  record<<<1, 1, 0, stream>>>(in, out, slot);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  // The GPU is busy with earlier work (~50 ms), so the replays below queue up behind it.
  ex::spin_kernel<<<1, 1, 0, stream>>>(100'000'000LL);
  EX_CHECK(cudaEventRecord(consumed, stream));
  for (int step = 0; step < steps; ++step) {
    // Fixed: wait until the previous replay has copied the buffer before overwriting it.
    if (!args.broken()) EX_CHECK(cudaEventSynchronize(consumed));
    *pinned = step;
    EX_CHECK(cudaGraphLaunch(exec, stream));
    EX_CHECK(cudaEventRecord(consumed, stream));
  }
  int host[steps];
  EX_CHECK(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  EX_CHECK(cudaFreeHost(pinned));
  bool in_order = true, all_last = true;
  for (int step = 0; step < steps; ++step) {
    in_order = in_order && host[step] == step;
    all_last = all_last && host[step] == steps - 1;
  }
  // Broken: documented only as every replay reading the last value written (3 3 3 3); any other
  // output (in order, or a mix) is not what this exercise shows.
  const char* what = in_order   ? "one per step"
                     : all_last ? "every replay read the last value written; expected 0 1 2 3"
                                : "expected 0 1 2 3";
  return ex::report("N6", args, args.broken() ? all_last : in_order, "outputs %d %d %d %d (%s)",
                    host[0], host[1], host[2], host[3], what);
}
