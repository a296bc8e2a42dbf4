// C5: a side stream forked into the capture but never joined back. Every stream that joined a
// capture must rejoin the origin stream before cudaStreamEndCapture, otherwise it fails with 904.
#include "fork_join.h"

__global__ void add(int* value, int amount) {
  atomicAdd(value, amount);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C5");
  ex::require_gpu();
  const auto [main_stream, side, fork, join, value] = ex::ForkJoin{};

  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(main_stream, cudaStreamCaptureModeGlobal));
  add<<<1, 1, 0, main_stream>>>(value, 1);
  EX_CHECK(cudaEventRecord(fork, main_stream));  // fork: the side stream joins the capture
  EX_CHECK(cudaStreamWaitEvent(side, fork, 0));
  add<<<1, 1, 0, side>>>(value, 10);
  if (args.broken()) {
    // Broken: the side stream's work is left dangling; no join before the end.
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(main_stream, &graph));
    return ex::report("C5", args, end == cudaErrorStreamCaptureUnjoined,
                      "cudaStreamEndCapture -> %s", ex::name(end).c_str());
  }
  // Fixed: join, the origin stream waits on the side stream's last work.
  EX_CHECK(cudaEventRecord(join, side));
  EX_CHECK(cudaStreamWaitEvent(main_stream, join, 0));
  const int host = ex::end_capture_and_replay(main_stream, value);
  return ex::report("C5", args, host == 11,
                    "joined before EndCapture, replay gave %d (expected 11)", host);
}
