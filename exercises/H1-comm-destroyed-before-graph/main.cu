// H1: destroying an NCCL communicator while a graph that captured one of its collectives is still
// alive. The graph holds resources of the communicator; on 2 GPUs ncclCommDestroy hangs on a rank.
// Destroy the graph first. The destroy runs in a helper thread with a timeout, so the hang is
// reported instead of stalling the test. Run with 2 ranks: mpiexec -n 2 exercise-h1 --mode
// broken|fixed.
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <future>

#include "common.h"

constexpr double kTimeoutS = 20.0;
constexpr int kCount = 1024;

#define NCCL_CHECK(call)                                                                        \
  do {                                                                                          \
    ncclResult_t r_ = (call);                                                                   \
    if (r_ != ncclSuccess) {                                                                    \
      std::printf("CHECK FAILED: %s -> %s at %s:%d\n", #call, ncclGetErrorString(r_), __FILE__, \
                  __LINE__);                                                                    \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                             \
    }                                                                                           \
  } while (0)

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "H1");
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < 2 || ranks < 2) {
    if (rank == 0)
      std::printf("SKIPPED: H1 needs 2 ranks on 2 GPUs (%d ranks, %d GPUs)\n", ranks, devices);
    MPI_Finalize();
    return 77;
  }
  EX_CHECK(cudaSetDevice(rank % devices));
  ncclUniqueId id;
  if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm;
  NCCL_CHECK(ncclCommInitRank(&comm, ranks, id, rank));
  const cudaStream_t stream = ex::nonblocking_stream();
  float* buf;
  EX_CHECK(cudaMalloc(&buf, kCount * sizeof(float)));

  // One eager all-reduce first (NCCL initializes lazily, see C18), then capture one.
  EX_CHECK(cudaMemsetAsync(buf, 0, kCount * sizeof(float), stream));
  NCCL_CHECK(ncclAllReduce(buf, buf, kCount, ncclFloat, ncclSum, comm, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  NCCL_CHECK(ncclAllReduce(buf, buf, kCount, ncclFloat, ncclSum, comm, stream));
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  const float one = 1.0f;
  EX_CHECK(cudaMemcpyAsync(buf, &one, sizeof(float), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaGraphLaunch(exec, stream));
  float sum = 0;
  EX_CHECK(cudaMemcpyAsync(&sum, buf, sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));

  // Fixed: the graph goes first. Broken: the communicator goes while the graph is alive.
  if (!args.broken()) ex::destroy_graph(exec, graph);
  const auto start = std::chrono::steady_clock::now();
  std::packaged_task<ncclResult_t()> destroy([comm] { return ncclCommDestroy(comm); });
  std::future<ncclResult_t> done = destroy.get_future();
  std::thread(std::move(destroy)).detach();  // a hung destroy cannot be joined
  const bool hung =
      done.wait_for(std::chrono::duration<double>(kTimeoutS)) == std::future_status::timeout;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool destroy_failed = !hung && done.get() != ncclSuccess;

  int local[2] = {hung ? 1 : 0, destroy_failed ? 1 : 0}, any[2] = {0, 0};
  MPI_Allreduce(local, any, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  double slowest = 0;
  MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  int code = 0;
  if (rank == 0) {
    if (args.broken()) {
      code = ex::report(
          "H1", args, any[0] || any[1],
          "ncclCommDestroy with the graph alive: %s (slowest rank %.1f s, timeout %.0f s)",
          any[0]   ? "hung"
          : any[1] ? "returned an error"
                   : "finished",
          slowest, kTimeoutS);
    } else {
      code = ex::report("H1", args, !any[0] && !any[1] && sum == ranks,
                        "graph destroyed first, ncclCommDestroy finished in %.1f s; all-reduce "
                        "gave %.0f (expected %d)",
                        slowest, sum, ranks);
    }
  }
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  std::_Exit(code);  // the hung destroy thread (broken mode) is abandoned, not joined
}
