// C4: work put on a side stream that was never forked from the capture stream. The side stream is
// not capturing, so its kernel runs eagerly, and waiting on its event from the capture crosses the
// capture boundary: 905 (cudaErrorStreamCaptureIsolation), then the capture ends invalidated (901).
#include "fork_join.h"

__global__ void add(int* value, int amount) {
  atomicAdd(value, amount);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C4");
  ex::require_gpu();
  const auto [main_stream, side, fork, join, value] = ex::ForkJoin{};

  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(main_stream, cudaStreamCaptureModeGlobal));
  add<<<1, 1, 0, main_stream>>>(value, 1);
  if (args.broken()) {
    // Broken: no fork, so the side kernel is an ordinary eager launch.
    add<<<1, 1, 0, side>>>(value, 10);
    EX_CHECK(cudaEventRecord(join, side));
    const cudaError_t wait = EX_TRY(cudaStreamWaitEvent(main_stream, join, 0));
    const cudaError_t end = EX_TRY(cudaStreamEndCapture(main_stream, &graph));
    EX_CHECK(cudaStreamSynchronize(side));
    int host = 0;
    EX_CHECK(cudaMemcpy(&host, value, sizeof(int), cudaMemcpyDeviceToHost));
    const bool ok =
        (wait == cudaErrorStreamCaptureIsolation || wait == cudaErrorStreamCaptureInvalidated) &&
        end == cudaErrorStreamCaptureInvalidated;
    return ex::report(
        "C4", args, ok,
        "cudaStreamWaitEvent -> %s, cudaStreamEndCapture -> %s; the side kernel ran eagerly "
        "(value %d)",
        ex::name(wait).c_str(), ex::name(end).c_str(), host);
  }
  // Fixed: fork first (the side stream waits on the capture stream), then join back.
  EX_CHECK(cudaEventRecord(fork, main_stream));
  EX_CHECK(cudaStreamWaitEvent(side, fork, 0));
  add<<<1, 1, 0, side>>>(value, 10);
  EX_CHECK(cudaEventRecord(join, side));
  EX_CHECK(cudaStreamWaitEvent(main_stream, join, 0));
  const int host = ex::end_capture_and_replay(main_stream, value);
  return ex::report("C4", args, host == 11, "forked and joined, replay gave %d (expected 11)",
                    host);
}
