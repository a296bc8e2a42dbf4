// replay-comm-probe's device side (workloads/comm/collectives.h) across two or more GPUs under
// mpiexec (label mpi; exit 77 with fewer than two ranks or GPUs): for every collective, both types,
// out of place and in place, and counts from 1 element a rank to an odd 65,539, the received data
// are copied to the host and compared, element by element, with the exact sums computed on the host
// (independently of the probe's device check), and the device check agrees (zero wrong); the same
// calls captured in a CUDA graph (after the capture check) and replayed give the same data; and a
// result with one element planted wrong is caught by the device check at that element.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/comm.h"
#include "common/context.h"
#include "workloads/comm/collectives.h"
#include "workloads/comm/probe.h"

namespace {

using replay::comm::Kind;
using replay::probe::DType;

int failures = 0;
int rank_ = 0;

void expect(bool cond, const std::string& what) {
  if (!cond) {
    std::fprintf(stderr, "rank %d: CHECK FAILED: %s\n", rank_, what.c_str());
    ++failures;
  }
}

float to_float(const std::vector<unsigned char>& bytes, uint64_t i, DType t) {
  if (t == DType::kFP32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The host's count of wrong elements in the call's result.
uint64_t host_wrong(const replay::probe::CallBuffers& b, Kind k, uint64_t count, DType t, int rank,
                    int ranks, std::string* first) {
  const uint64_t n = replay::probe::recv_elements(k, count, ranks);
  std::vector<unsigned char> host(n * static_cast<uint64_t>(replay::probe::dtype_bytes(t)));
  // The collective ran on the context's non-blocking stream, which a cudaMemcpy (the legacy default
  // stream) does not wait for: wait for the whole device first.
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  REPLAY_CUDA_CHECK(cudaMemcpy(host.data(), b.recv, host.size(), cudaMemcpyDeviceToHost));
  uint64_t wrong = 0;
  for (uint64_t j = 0; j < n; ++j) {
    // The exact result, written out here rather than taken from collectives.h.
    float want = 0;
    if (k == Kind::kAllGather) {
      const uint64_t r = j / count, i = j % count;
      want = static_cast<float>((13 * (i % 8) + 7 * r) % 8);
    } else {
      const uint64_t i = k == Kind::kReduceScatter ? static_cast<uint64_t>(rank) * count + j : j;
      for (int r = 0; r < ranks; ++r)
        want += static_cast<float>((13 * (i % 8) + 7 * static_cast<uint64_t>(r)) % 8);
    }
    const float got = to_float(host, j, t);
    if (got != want) {
      if (wrong == 0 && first != nullptr)
        *first = "element " + std::to_string(j) + ": " + std::to_string(got) + " instead of " +
                 std::to_string(want);
      ++wrong;
    }
  }
  return wrong;
}

uint64_t device_wrong(const replay::probe::CallBuffers& b, Kind k, uint64_t count, DType t,
                      int rank, int ranks, unsigned long long* counter, cudaStream_t s,
                      unsigned long long* first_index = nullptr) {
  replay::probe::clear_counter(counter, s);
  replay::probe::count_mismatches(b, k, count, t, rank, ranks, counter, s);
  unsigned long long host[2];
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(host, counter, sizeof(host), cudaMemcpyDeviceToHost, s));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  if (first_index != nullptr) *first_index = host[1];
  return host[0];
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
    replay::comm::Communicator c(w, "probe-test", 0, &log);
    const int n = c.size(), r = c.rank();
    expect(n == w.size, "the communicator spans the world");

    constexpr uint64_t kMaxCount = 65539;  // odd, and not a multiple of a warp or a block
    const size_t bytes = kMaxCount * static_cast<size_t>(n) * 4;
    void *send = nullptr, *recv = nullptr;
    unsigned long long* counter = nullptr;
    REPLAY_CUDA_CHECK(cudaMalloc(&send, bytes));
    REPLAY_CUDA_CHECK(cudaMalloc(&recv, bytes));
    REPLAY_CUDA_CHECK(cudaMalloc(&counter, 2 * sizeof(unsigned long long)));

    int cases = 0;
    for (DType t : {DType::kBF16, DType::kFP32}) {
      for (Kind k : {Kind::kAllReduce, Kind::kReduceScatter, Kind::kAllGather}) {
        for (bool in_place : {false, true}) {
          for (uint64_t count : {uint64_t{1}, uint64_t{1000}, kMaxCount}) {
            const std::string what = std::string(replay::comm::kind_name(k)) + " " +
                                     replay::probe::dtype_name(t) + " x " + std::to_string(count) +
                                     (in_place ? " in place" : " out of place");
            // Poison both buffers (NaN in either type), so that nothing passes by accident.
            REPLAY_CUDA_CHECK(cudaMemsetAsync(send, 0xff, bytes, s));
            REPLAY_CUDA_CHECK(cudaMemsetAsync(recv, 0xff, bytes, s));
            const replay::probe::CallBuffers b =
                replay::probe::call_buffers(k, send, recv, count, t, r, in_place);
            replay::probe::fill_pattern(b, k, count, t, r, n, s);
            replay::probe::enqueue(c, k, b, count, t, s);
            std::string first;
            const uint64_t hw = host_wrong(b, k, count, t, r, n, &first);
            expect(hw == 0,
                   what + ": " + std::to_string(hw) + " wrong on the host, first " + first);
            const uint64_t dw = device_wrong(b, k, count, t, r, n, counter, s);
            expect(dw == 0, what + ": the device check counted " + std::to_string(dw) + " wrong");
            ++cases;

            // The same call captured in a graph and replayed, out of place (in place, a replay
            // would reduce its own result again).
            if (in_place) continue;
            REPLAY_CUDA_CHECK(cudaMemsetAsync(recv, 0xff, bytes, s));
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            replay::probe::enqueue(c, k, b, count, t, s);
            REPLAY_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
            REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            replay::comm::check_same_collectives(w, log);
            expect(log.captured().size() == 1, what + ": one collective captured");
            log.clear_captured();
            REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s));
            REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
            const uint64_t gw = host_wrong(b, k, count, t, r, n, &first);
            expect(gw == 0, what + " (graph): " + std::to_string(gw) + " wrong, first " + first);
            REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
            REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
          }
        }
      }
    }

    // A planted error: one element of a correct all-reduce's result changed on this rank; the
    // device check counts exactly it, at its index, and the host agrees.
    const replay::probe::CallBuffers b =
        replay::probe::call_buffers(Kind::kAllReduce, send, recv, 1000, DType::kFP32, r, false);
    replay::probe::fill_pattern(b, Kind::kAllReduce, 1000, DType::kFP32, r, n, s);
    replay::probe::enqueue(c, Kind::kAllReduce, b, 1000, DType::kFP32, s);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    const float planted = 12345.0f;
    REPLAY_CUDA_CHECK(cudaMemcpy(static_cast<float*>(recv) + 417 + r, &planted, sizeof(float),
                                 cudaMemcpyHostToDevice));
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());  // the copy done before the check's stream reads it
    unsigned long long first_index = 0;
    const uint64_t dw =
        device_wrong(b, Kind::kAllReduce, 1000, DType::kFP32, r, n, counter, s, &first_index);
    expect(dw == 1 && first_index == 417u + static_cast<unsigned>(r),
           "the planted error: the device check counted " + std::to_string(dw) + " at " +
               std::to_string(first_index) + " (expected 1 at " + std::to_string(417 + r) + ")");
    expect(host_wrong(b, Kind::kAllReduce, 1000, DType::kFP32, r, n, nullptr) == 1,
           "the planted error: the host counts one");

    REPLAY_CUDA_CHECK(cudaFree(send));
    REPLAY_CUDA_CHECK(cudaFree(recv));
    REPLAY_CUDA_CHECK(cudaFree(counter));
    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (w.rank == 0)
      std::printf(total == 0 ? "comm probe across %d GPUs: %d cases exact, all checks passed\n"
                             : "comm probe across %d GPUs: %d cases, CHECK FAILED\n",
                  w.size, cases);
    failures = total;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", w.rank, e.what());
    replay::comm::abort_world(1);
  }
  replay::comm::finalize_world();
  return failures == 0 ? 0 : 1;
}
