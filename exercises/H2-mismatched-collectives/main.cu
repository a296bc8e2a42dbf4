// H2: ranks that captured different collective sequences. Each rank captures its training step
// (a gradient all-reduce, a loss all-reduce and, behind a host branch, a found-inf all-reduce) into
// a CUDA graph. The branch reads a rank-local value ("did MY gradients overflow?") at capture time,
// so rank 1, whose warm-up step overflowed, captures one all-reduce more than rank 0. Nothing
// notices at capture: each graph is valid on its own. At replay rank 1's GPU waits in the extra
// all-reduce for a partner that never comes, forever.
//
// Broken: the graphs are replayed. A watchdog polls the replay's event and ncclCommGetAsyncError
// for kTimeoutS seconds, then aborts the communicator (on a helper thread with a deadline: the
// abort may wait for the spinning collective) and names the stall: "replay did not complete within
// 10 s: rank 1 waited in collective #2 all_reduce(i32 x 1, max)". A progress word in mapped host
// memory, written by a marker kernel after each captured collective, tells which collective the
// graph was waiting in. Nothing is freed after a stall (a free would wait for the spinning kernel).
//
// Fixed: before the first replay every rank hashes the collectives it enqueued during capture
// (kind, count, type, reduction, in order: a thin wrapper around ncclAllReduce records them) and
// the ranks compare the hashes with MPI_Allgather. The planted mismatch is found there, each rank
// names the first differing collective on both sides, and nothing is replayed. Then, as a rerun
// after the fix would (a fresh communicator, warmed), the corrected step (the found-inf all-reduce
// on every rank, unconditionally) is captured, passes the check and is replayed kReplays times,
// every all-reduced value checked against its expected sum.
//
// The log, the check and the broken mode's verdict need no GPU: they are in capture_check.h, which
// tests/exercises/test_h2_capture_check.cu runs on the CPU.
//
// Run with 2 ranks, one GPU each: mpiexec -n 2 exercise-h2 --mode broken|fixed.
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "H2-mismatched-collectives/capture_check.h"
#include "common.h"

using namespace h2;  // the capture log, the check and the MPI helpers

constexpr int kGrads = 4096;             // floats in the gradient all-reduce
constexpr double kTimeoutS = 10.0;       // the watchdog's wait for one replay
constexpr double kAbortDeadlineS = 5.0;  // how long ncclCommAbort gets on its helper thread
constexpr int kReplays = 5;              // replays of the corrected step (fixed mode)

#define NCCL_CHECK(call)                                                                        \
  do {                                                                                          \
    ncclResult_t r_ = (call);                                                                   \
    if (r_ != ncclSuccess) {                                                                    \
      std::printf("CHECK FAILED: %s -> %s at %s:%d\n", #call, ncclGetErrorString(r_), __FILE__, \
                  __LINE__);                                                                    \
      std::fflush(stdout);                                                                      \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                             \
    }                                                                                           \
  } while (0)

// ---- The communicator
// ----------------------------------------------------------------------------

// "ncclSuccess (0)": the enumerator, as NCCL's header names it.
std::string nccl_name(ncclResult_t r) {
  const char* names[] = {"ncclSuccess",       "ncclUnhandledCudaError", "ncclSystemError",
                         "ncclInternalError", "ncclInvalidArgument",    "ncclInvalidUsage",
                         "ncclRemoteError",   "ncclInProgress"};
  const int i = static_cast<int>(r);
  return std::string(i >= 0 && i < 8 ? names[i] : "ncclResult") + " (" + std::to_string(i) + ")";
}

// A communicator whose collectives are recorded while the stream captures: what the graph holds
// (the log's part is in capture_check.h).
class LoggedComm : public CaptureLog {
 public:
  explicit LoggedComm(ncclComm_t comm) : comm_(comm) {}
  ncclComm_t handle() const { return comm_; }

  void all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                  cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    EX_CHECK(cudaStreamIsCapturing(stream, &status));  // the one query a capture allows
    if (status == cudaStreamCaptureStatusActive) record({"all_reduce", count, dtype, op});
    NCCL_CHECK(ncclAllReduce(send, recv, count, dtype, op, comm_, stream));
  }

 private:
  ncclComm_t comm_;
};

// ---- The step ----------------------------------------------------------------------------------

struct Buffers {
  float* grads = nullptr;            // this rank's gradients, then their sum over the ranks
  float* loss = nullptr;             // this rank's loss, then the sum
  int* found_inf = nullptr;          // this rank's overflow flag (rank-local data)
  int* any_inf = nullptr;            // the flag's maximum over the ranks
  int* step = nullptr;               // the step counter, on the device, advanced inside the graph
  volatile int* progress = nullptr;  // mapped host memory: collectives completed in this replay
  int* progress_device = nullptr;
};

// Rank r's step s: gradients (r + 1) * (i % 13 + 1) + s, loss 0.5 (r + 1) + s; rank 1 overflows on
// even steps. Every value is an exact float, so the sums can be compared exactly.
__global__ void produce(int rank, const int* step, float* grads, float* loss, int* found_inf) {
  const int s = *step;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kGrads; i += gridDim.x * blockDim.x)
    grads[i] = static_cast<float>((rank + 1) * (i % 13 + 1) + s);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *loss = 0.5f * static_cast<float>(rank + 1) + static_cast<float>(s);
    *found_inf = rank == 1 && s % 2 == 0 ? 1 : 0;
  }
}

// Written after each collective: the replay's progress, visible to the host while the GPU waits.
__global__ void mark(volatile int* progress, int value) {
  *progress = value;
  __threadfence_system();
}

__global__ void advance(int* step) {
  *step += 1;
}

// The step: produce, all-reduce the gradients and the loss and, when `reduce_found_inf`, the
// overflow flag; a progress mark after each collective; the step counter advanced.
void enqueue_step(LoggedComm& comm, const Buffers& b, int rank, bool reduce_found_inf,
                  cudaStream_t s) {
  produce<<<16, 256, 0, s>>>(rank, b.step, b.grads, b.loss, b.found_inf);
  EX_CHECK(cudaGetLastError());
  comm.all_reduce(b.grads, b.grads, kGrads, ncclFloat32, ncclSum, s);
  mark<<<1, 1, 0, s>>>(b.progress_device, 1);
  comm.all_reduce(b.loss, b.loss, 1, ncclFloat32, ncclSum, s);
  mark<<<1, 1, 0, s>>>(b.progress_device, 2);
  if (reduce_found_inf) {
    comm.all_reduce(b.found_inf, b.any_inf, 1, ncclInt32, ncclMax, s);
    mark<<<1, 1, 0, s>>>(b.progress_device, 3);
  }
  advance<<<1, 1, 0, s>>>(b.step);
  EX_CHECK(cudaGetLastError());
}

struct Captured {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

Captured capture_step(LoggedComm& comm, const Buffers& b, int rank, bool reduce_found_inf,
                      cudaStream_t s) {
  comm.clear_captured();
  Captured c;
  // Thread-local, as nccl-tests captures: NCCL's own threads may make CUDA calls meanwhile.
  EX_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  enqueue_step(comm, b, rank, reduce_found_inf, s);
  c.exec = ex::end_capture_and_instantiate(s, &c.graph);
  return c;
}

// ---- The watchdog ------------------------------------------------------------------------------

struct Wait {
  bool completed = false;
  double seconds = 0;
  int progress = 0;         // collectives the replay got through
  std::string async_error;  // ncclCommGetAsyncError's error, "" when none
};

// Polls the replay's event and the communicator's asynchronous error until the event completes,
// an error shows, or `timeout_s` passes. Never blocks: no synchronize, no blocking copy.
Wait watch_replay(cudaEvent_t done, ncclComm_t comm, const Buffers& b, double timeout_s) {
  Wait w;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) {
      w.completed = true;
      break;
    }
    if (q != cudaErrorNotReady) EX_CHECK(q);
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      w.async_error = nccl_name(async);
      break;
    }
    w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (w.seconds > timeout_s) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  w.progress = *b.progress;
  return w;
}

// ncclCommAbort on a helper thread: it may wait for a collective kernel that never ends, so it
// gets kAbortDeadlineS and is then abandoned (a hung abort cannot be joined).
std::string abort_with_deadline(ncclComm_t comm) {
  auto task =
      std::make_shared<std::packaged_task<ncclResult_t()>>([comm] { return ncclCommAbort(comm); });
  std::future<ncclResult_t> result = task->get_future();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(std::chrono::duration<double>(kAbortDeadlineS)) ==
      std::future_status::timeout) {
    char text[64];
    std::snprintf(text, sizeof(text), "did not return within %.0f s", kAbortDeadlineS);
    return text;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char text[96];
  std::snprintf(text, sizeof(text), "returned %s in %.1f s", nccl_name(result.get()).c_str(), s);
  return text;
}

// One replay, launched and watched: *progress reset, the graph launched, an event after it.
Wait replay_and_watch(const Captured& c, const Buffers& b, ncclComm_t comm, cudaEvent_t done,
                      cudaStream_t s) {
  *b.progress = 0;
  EX_CHECK(cudaGraphLaunch(c.exec, s));
  EX_CHECK(cudaEventRecord(done, s));
  return watch_replay(done, comm, b, kTimeoutS);
}

// What a stalled rank says: where its replay waited, from the progress word and its capture log.
std::string describe_stall(const Wait& w, const LoggedComm& comm, int rank) {
  char text[512];
  const size_t n = comm.captured().size();
  if (!w.async_error.empty()) {
    std::snprintf(text, sizeof(text),
                  "NCCL error %s after %.1f s: rank %d's replay stopped in collective #%d %s",
                  w.async_error.c_str(), w.seconds, rank, w.progress,
                  comm.at(static_cast<size_t>(w.progress)).c_str());
  } else if (static_cast<size_t>(w.progress) < n) {
    std::snprintf(text, sizeof(text),
                  "replay did not complete within %.0f s: rank %d waited in collective #%d %s "
                  "(progress mark %d of %zu captured collectives)",
                  kTimeoutS, rank, w.progress, comm.at(static_cast<size_t>(w.progress)).c_str(),
                  w.progress, n);
  } else {
    std::snprintf(text, sizeof(text),
                  "replay did not complete within %.0f s: rank %d got past all %zu collectives",
                  kTimeoutS, rank, n);
  }
  return text;
}

// The end of a job after a stall: the result line is printed; nothing is freed or destroyed (that
// would wait for the collective kernel still spinning), the abort threads are abandoned.
[[noreturn]] void end_job(int code) {
  std::fflush(stdout);
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  std::_Exit(code);
}

// A communicator over every rank: rank 0's unique id sent over MPI.
ncclComm_t make_comm(int rank, int ranks) {
  ncclUniqueId id;
  if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm;
  NCCL_CHECK(ncclCommInitRank(&comm, ranks, id, rank));
  return comm;
}

// One eager step on every rank, every collective included: it warms each collective kind before
// any capture (C18). Returns this rank's overflow flag (rank-local data); the step counter is
// reset.
bool warm_up(LoggedComm& comm, const Buffers& b, int rank, cudaStream_t s) {
  enqueue_step(comm, b, rank, true, s);
  EX_CHECK(cudaStreamSynchronize(s));
  const bool overflow = ex::read_back(b.found_inf) != 0;
  EX_CHECK(cudaMemsetAsync(b.step, 0, sizeof(int), s));
  EX_CHECK(cudaStreamSynchronize(s));
  return overflow;
}

// ---- The two modes -----------------------------------------------------------------------------

// Broken: the mismatched graphs replayed, the watchdog names the stall.
[[noreturn]] void run_broken(const ex::Args& args, LoggedComm& comm, const Buffers& b, int rank,
                             int ranks, bool local_overflow, cudaStream_t s) {
  const Captured step = capture_step(comm, b, rank, local_overflow, s);
  cudaEvent_t done = ex::untimed_event();
  const Wait w = replay_and_watch(step, b, comm.handle(), done, s);
  std::string aborted = "not needed";
  if (!w.completed) {
    aborted = abort_with_deadline(comm.handle());
    // Whether the abort ended the spinning collective (NCCL's kernels poll an abort flag). Not
    // asked while the abort still runs: it may hold CUDA locks a query would wait on.
    const std::string after = aborted.rfind("returned", 0) == 0
                                  ? ex::name(cudaEventQuery(done))
                                  : std::string("not queried (the abort still runs)");
    std::printf(
        "H2 rank %d watchdog: %s; ncclCommAbort %s; the replay's event after the abort: %s\n", rank,
        describe_stall(w, comm, rank).c_str(), aborted.c_str(), after.c_str());
    std::fflush(stdout);
  }
  // Over MPI (the host is free even while the GPU spins): who completed, where each one waited.
  const std::vector<long long> completed = gather_ints(w.completed ? 1 : 0, ranks);
  const std::vector<long long> progress = gather_ints(w.progress, ranks);
  const std::vector<long long> counts =
      gather_ints(static_cast<long long>(comm.captured().size()), ranks);
  const std::vector<std::string> errors = gather_strings(w.async_error, ranks);
  const std::vector<std::string> waits =
      gather_strings(w.completed ? "" : comm.at(static_cast<size_t>(w.progress)), ranks);
  std::vector<double> seconds(ranks);
  MPI_Allgather(&w.seconds, 1, MPI_DOUBLE, seconds.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
  int stalled = -1;
  for (int r = 0; r < ranks && stalled < 0; ++r)
    if (!completed[r]) stalled = r;
  // The job ends: a rank whose replay completed aborts too (destroying the communicator with its
  // graph alive would hang, H1, and its peer is gone).
  if (stalled >= 0 && w.completed) aborted = abort_with_deadline(comm.handle());
  const std::vector<std::string> aborts = gather_strings(aborted, ranks);

  int code = rank == 0 ? report_broken(args, kTimeoutS, completed, progress, counts, errors, waits,
                                       seconds, aborts)
                       : 0;
  if (stalled >= 0) end_job(code);  // nothing freed: a rank's GPU may still spin
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ex::destroy_graph(step.exec, step.graph);
  NCCL_CHECK(ncclCommDestroy(comm.handle()));
  MPI_Finalize();
  std::_Exit(code);
}

// Fixed: the capture check stops the mismatched graphs before any replay; the corrected step is
// captured, checked and replayed kReplays times with its sums checked.
[[noreturn]] void run_fixed(const ex::Args& args, LoggedComm& planted_comm, const Buffers& b,
                            int rank, int ranks, bool local_overflow, cudaStream_t s) {
  // 1. The same mismatched capture as the broken mode, compared before the first replay.
  const auto t0 = std::chrono::steady_clock::now();
  const Captured planted = capture_step(planted_comm, b, rank, local_overflow, s);
  const Comparison check = compare_captures(planted_comm, rank, ranks);
  const double check_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!check.same)
    std::printf(
        "H2 rank %d check: captured-sequence hash 0x%016llx, rank %d's 0x%016llx: "
        "collective #%zu is %s here and %s on rank %d; not replayed\n",
        rank, static_cast<unsigned long long>(check.mine), check.other,
        static_cast<unsigned long long>(check.theirs), check.first_diff, check.here.c_str(),
        check.there.c_str(), check.other);
  std::fflush(stdout);
  ex::destroy_graph(planted.exec, planted.graph);  // never launched
  int code = 0;
  if (rank == 0) {
    code |= ex::report(
        "H2", args, !check.same && check.first_diff == 2 && check.n_here != check.n_there,
        "capture check before the first replay: the ranks' hashes %s (rank 0 0x%016llx, rank "
        "%d 0x%016llx); first difference at collective #%zu: rank 0 %s, rank %d %s; not "
        "replayed, no hang (%.2f s from capture to verdict)",
        check.same ? "are equal (the planted mismatch was not seen)" : "differ",
        static_cast<unsigned long long>(check.mine), check.other,
        static_cast<unsigned long long>(check.theirs), check.first_diff, check.here.c_str(),
        check.other, check.there.c_str(), check_s);
  }

  // 2. The corrected program, as a rerun after the fix would start: a fresh communicator (the
  // first one's host state saw the mismatched captures; its graphs go first, H1), warmed, and the
  // step with the found-inf all-reduce on every rank, whatever this rank saw.
  NCCL_CHECK(ncclCommDestroy(planted_comm.handle()));
  LoggedComm comm(make_comm(rank, ranks));
  warm_up(comm, b, rank, s);
  const Captured step = capture_step(comm, b, rank, true, s);
  const Comparison recheck = compare_captures(comm, rank, ranks);
  cudaEvent_t done = ex::untimed_event();
  const long long tri = static_cast<long long>(ranks) * (ranks + 1) / 2;  // sum of (r + 1)
  long long wrong_grads = 0, wrong_scalars = 0;
  std::string losses, flags, expected_losses, expected_flags;
  std::vector<float> grads(kGrads);
  int replays = 0;
  for (int i = 0; recheck.same && i < kReplays; ++i) {
    const Wait w = replay_and_watch(step, b, comm.handle(), done, s);
    int stalled = 0, local = w.completed ? 0 : 1;
    MPI_Allreduce(&local, &stalled, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (stalled) {  // not expected: the watchdog ends the job instead of hanging it
      const std::string what = w.completed ? "completed" : describe_stall(w, comm, rank);
      const std::string aborted = abort_with_deadline(comm.handle());
      std::printf("H2 rank %d watchdog: replay %d: %s; ncclCommAbort %s\n", rank, i, what.c_str(),
                  aborted.c_str());
      if (rank == 0)
        code = ex::report("H2", args, false,
                          "corrected capture: replay %d stalled (see the ranks' "
                          "watchdog lines)",
                          i);
      end_job(code != 0 ? code : 1);
    }
    EX_CHECK(cudaMemcpy(grads.data(), b.grads, kGrads * sizeof(float), cudaMemcpyDeviceToHost));
    const float loss = ex::read_back(b.loss);
    const int any_inf = ex::read_back(b.any_inf);
    for (int k = 0; k < kGrads; ++k)
      wrong_grads += grads[k] != static_cast<float>(tri * (k % 13 + 1) + ranks * i);
    const float want_loss = 0.5f * static_cast<float>(tri) + static_cast<float>(ranks * i);
    const int want_inf = i % 2 == 0 ? 1 : 0;  // rank 1 overflows on even steps
    wrong_scalars += (loss != want_loss) + (any_inf != want_inf);
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%s%.1f", i ? " " : "", loss);
    losses += buf;
    std::snprintf(buf, sizeof(buf), "%s%.1f", i ? " " : "", want_loss);
    expected_losses += buf;
    flags += (i ? " " : "") + std::to_string(any_inf);
    expected_flags += (i ? " " : "") + std::to_string(want_inf);
    replays += 1;
  }
  long long wrong[2] = {wrong_grads, wrong_scalars}, total[2] = {0, 0};
  MPI_Allreduce(wrong, total, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    code |= ex::report(
        "H2", args, recheck.same && replays == kReplays && total[0] == 0 && total[1] == 0,
        "corrected capture (the found-inf all-reduce on every rank: %zu collectives each, hashes "
        "%s 0x%016llx): %d replays on %d ranks, gradient sums wrong in %lld of %lld elements, "
        "wrong scalars %lld; loss %s (expected %s), found-inf %s (expected %s)",
        comm.captured().size(), recheck.same ? "equal" : "DIFFER",
        static_cast<unsigned long long>(recheck.mine), replays, ranks, total[0],
        static_cast<long long>(kGrads) * kReplays * ranks, total[1], losses.c_str(),
        expected_losses.c_str(), flags.c_str(), expected_flags.c_str());
  }
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ex::destroy_graph(step.exec, step.graph);  // before the communicator (H1)
  NCCL_CHECK(ncclCommDestroy(comm.handle()));
  MPI_Finalize();
  std::_Exit(code);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "H2");
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < 2 || ranks < 2) {
    if (rank == 0)
      std::printf("SKIPPED: H2 needs 2 ranks on 2 GPUs (%d ranks, %d GPUs)\n", ranks, devices);
    MPI_Finalize();
    return 77;
  }
  if (ranks > devices) {
    if (rank == 0)
      std::printf("H2: %d ranks on %d GPUs: run one rank per GPU (mpiexec -n 2)\n", ranks, devices);
    MPI_Finalize();
    return 2;
  }
  EX_CHECK(cudaSetDevice(rank % devices));
  LoggedComm comm(make_comm(rank, ranks));
  const cudaStream_t stream = ex::nonblocking_stream();

  Buffers b;
  b.grads = ex::device_zeros<float>(kGrads);
  b.loss = ex::device_zeros<float>();
  b.found_inf = ex::device_zeros<int>();
  b.any_inf = ex::device_zeros<int>();
  b.step = ex::device_zeros<int>();
  int* progress = nullptr;
  EX_CHECK(cudaHostAlloc(&progress, sizeof(int), cudaHostAllocMapped));
  EX_CHECK(cudaHostGetDevicePointer(&b.progress_device, progress, 0));
  b.progress = progress;
  *b.progress = 0;

  // The eager warm-up step; its rank-local overflow flag is what the broken branch reads.
  const bool local_overflow = warm_up(comm, b, rank, stream);  // rank 1: yes, rank 0: no

  // The planted bug, in both modes: skip the found-inf all-reduce where this rank saw no overflow.
  if (args.broken()) run_broken(args, comm, b, rank, ranks, local_overflow, stream);
  run_fixed(args, comm, b, rank, ranks, local_overflow, stream);
}
