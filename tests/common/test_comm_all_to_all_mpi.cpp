// Communicator::all_to_all (common/comm.h) across two or more GPUs under mpiexec (label mpi; exit
// 77 with fewer than two ranks or GPUs): block p of each rank's send buffer lands in block (sender)
// of rank p's receive buffer, for int32 and bf16 and counts of 1, 1000 and an odd 65,539 elements
// a peer, checked element by element on the host against the pattern every rank can compute; the
// same call captured in a CUDA graph (the capture check passing, one all_to_all recorded) and
// replayed after the send buffer changed delivers the new data: what replay-moe's expert-parallel
// dispatch relies on.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/comm.h"
#include "common/context.h"

namespace {

int failures = 0;
int rank_ = 0;

void expect(bool cond, const std::string& what) {
  if (!cond) {
    std::fprintf(stderr, "rank %d: CHECK FAILED: %s\n", rank_, what.c_str());
    ++failures;
  }
}

// The value rank `from` sends to rank `to` at element i of its block, in round `round`: exact in
// int32 and in bf16 (small integers).
int32_t pattern(int from, int to, uint64_t i, int round) {
  return static_cast<int32_t>((from * 7 + to * 3 + round * 11 + static_cast<int>(i % 97)) % 251);
}

template <typename T>
T from_int(int32_t v);
template <>
int32_t from_int<int32_t>(int32_t v) {
  return v;
}
template <>
__nv_bfloat16 from_int<__nv_bfloat16>(int32_t v) {
  return __float2bfloat16(static_cast<float>(v));
}
int32_t to_int(int32_t v) {
  return v;
}
int32_t to_int(__nv_bfloat16 v) {
  return static_cast<int32_t>(__bfloat162float(v));
}

template <typename T>
void fill(void* send, uint64_t count, int r, int n, int round) {
  std::vector<T> host(count * static_cast<uint64_t>(n));
  for (int p = 0; p < n; ++p)
    for (uint64_t i = 0; i < count; ++i) host[p * count + i] = from_int<T>(pattern(r, p, i, round));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  REPLAY_CUDA_CHECK(cudaMemcpy(send, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
}

template <typename T>
uint64_t wrong(const void* recv, uint64_t count, int r, int n, int round, std::string* first) {
  std::vector<T> host(count * static_cast<uint64_t>(n));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  REPLAY_CUDA_CHECK(cudaMemcpy(host.data(), recv, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  uint64_t bad = 0;
  for (int s = 0; s < n; ++s)
    for (uint64_t i = 0; i < count; ++i) {
      const int32_t got = to_int(host[s * count + i]), want = pattern(s, r, i, round);
      if (got != want && bad++ == 0 && first != nullptr)
        *first = "block " + std::to_string(s) + " element " + std::to_string(i) + ": " +
                 std::to_string(got) + " instead of " + std::to_string(want);
    }
  return bad;
}

template <typename T>
void check_type(replay::comm::Communicator& c, replay::comm::CollectiveLog& log,
                const replay::comm::World& w, ncclDataType_t type, void* send, void* recv,
                cudaStream_t s) {
  const int n = c.size(), r = c.rank();
  for (uint64_t count : {uint64_t{1}, uint64_t{1000}, uint64_t{65539}}) {
    const std::string what =
        std::string(replay::comm::dtype_name(type)) + " x " + std::to_string(count);
    REPLAY_CUDA_CHECK(cudaMemset(recv, 0xff, count * n * sizeof(T)));
    fill<T>(send, count, r, n, 0);
    c.all_to_all(send, recv, count, type, s);
    std::string first;
    const uint64_t bad = wrong<T>(recv, count, r, n, 0, &first);
    expect(bad == 0, what + ": " + std::to_string(bad) + " wrong, first " + first);

    // Captured, then replayed on new data.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    c.all_to_all(send, recv, count, type, s);
    REPLAY_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    replay::comm::check_same_collectives(w, log);
    expect(log.captured().size() == 1 && log.captured()[0].kind == replay::comm::Kind::kAllToAll,
           what + ": one all_to_all captured");
    log.clear_captured();
    for (int round = 1; round <= 2; ++round) {
      REPLAY_CUDA_CHECK(cudaMemset(recv, 0xff, count * n * sizeof(T)));
      fill<T>(send, count, r, n, round);
      REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s));
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
      const uint64_t gbad = wrong<T>(recv, count, r, n, round, &first);
      expect(gbad == 0, what + " (graph, replay " + std::to_string(round) +
                            "): " + std::to_string(gbad) + " wrong, first " + first);
    }
    REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
    REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const replay::comm::World& w = replay::comm::init_world(&argc, &argv);
  rank_ = w.rank;
  if (w.size < 2) {
    std::printf("SKIPPED: run under mpiexec with 2 or more ranks (this is a world of %d)\n",
                w.size);
    return 77;
  }
  const int gpus = replay::Context::device_count();
  if (gpus < 2 || gpus < w.local_size) {
    if (w.rank == 0)
      std::printf("SKIPPED: %d GPU(s) for %d ranks on this host; needs 2 or more, one a rank\n",
                  gpus, w.local_size);
    replay::comm::finalize_world();
    return 77;
  }
  try {
    replay::Context ctx(w.local_rank);
    cudaStream_t s = ctx.stream();
    replay::comm::CollectiveLog log;
    {
      replay::comm::Communicator c(w, "expert-parallel", 0, &log);
      const size_t bytes = 65539 * static_cast<size_t>(c.size()) * 4;
      void *send = nullptr, *recv = nullptr;
      REPLAY_CUDA_CHECK(cudaMalloc(&send, bytes));
      REPLAY_CUDA_CHECK(cudaMalloc(&recv, bytes));
      check_type<int32_t>(c, log, w, ncclInt32, send, recv, s);
      check_type<__nv_bfloat16>(c, log, w, ncclBfloat16, send, recv, s);
      const replay::comm::Traffic& t = c.eager_traffic();
      expect(t.calls == 6, "six eager calls counted, got " + std::to_string(t.calls));
      REPLAY_CUDA_CHECK(cudaFree(send));
      REPLAY_CUDA_CHECK(cudaFree(recv));
    }
    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (w.rank == 0)
      std::printf(total == 0 ? "all_to_all across %d GPUs: all checks passed\n"
                             : "all_to_all across %d GPUs: CHECK FAILED\n",
                  w.size);
    failures = total;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", w.rank, e.what());
    replay::comm::abort_world(1);
  }
  replay::comm::finalize_world();
  return failures == 0 ? 0 : 1;
}
