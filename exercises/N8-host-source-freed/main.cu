// N8: the host buffer that a captured host-to-device copy reads is freed while the graph lives on.
// The memcpy node keeps the raw host address; the next replay reads freed memory and the process
// crashes (or copies garbage). The broken run happens in a child process so the crash can be
// reported.
#include "common.h"

// The broken child's last line before the replay: a crash after it happened in the replay.
constexpr const char* kReplayMarker = "N8 child: source freed, launching the replay";

// The child: capture a copy from a pinned buffer, (broken) free the buffer, replay, check the
// value.
static int child(const ex::Args& args) {
  const cudaStream_t stream = ex::nonblocking_stream();
  float* host;
  float* device;
  EX_CHECK(cudaMallocHost(&host, 1 << 20));
  EX_CHECK(cudaMalloc(&device, 1 << 20));
  host[0] = 42.0f;
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EX_CHECK(cudaMemcpyAsync(device, host, 1 << 20, cudaMemcpyHostToDevice, stream));
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  // Broken: "the batch is consumed, release it" while the graph still holds its address. Then the
  // marker the parent looks for: a crash after it is the replay's, not the set-up's.
  if (args.broken()) {
    EX_CHECK(cudaFreeHost(host));
    std::printf("%s\n", kReplayMarker);
    std::fflush(stdout);
  }
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  float got = 0;
  EX_CHECK(cudaMemcpy(&got, device, sizeof(float), cudaMemcpyDeviceToHost));
  ex::destroy_graph(exec, graph);
  // Fixed: the host buffer lives as long as the graph and is freed after it.
  if (!args.broken()) EX_CHECK(cudaFreeHost(host));
  std::fprintf(stderr, "N8 child: replay copied %.1f\n", got);
  return got == 42.0f ? 0 : 3;  // 3: the replay ran but copied the wrong value
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N8");
  if (args.child) return child(args);
  ex::require_gpu();
  const ex::ChildResult run = ex::run_child(args, 60.0);
  if (args.broken()) {
    // Documented: a segmentation fault in the replay, after the marker (the child printed nothing
    // else after it). An error exit, a hang, another signal or a crash before the replay is not
    // the documented symptom.
    const bool ok = !run.timed_out && run.signal == SIGSEGV && run.last_line == kReplayMarker;
    return ex::report("N8", args, ok, "replay after cudaFreeHost of the copy's source: child %s",
                      run.describe().c_str());
  }
  // Fixed: the child exits 0 only when the replay copied 42, and says so last.
  const bool ok = !run.timed_out && run.signal == 0 && run.exit_code == 0 &&
                  run.last_line == "N8 child: replay copied 42.0";
  return ex::report("N8", args, ok, "host buffer kept alive for the graph: child %s",
                    run.describe().c_str());
}
