// The capture check and the MPI helpers of common/comm.h across real MPI ranks, without a GPU
// (run under mpiexec with 3 ranks; CTest does): ranks that captured the same collectives pass;
// one extra all-reduce on one rank, or one count that differs, fails on every rank with a message
// naming the first differing collective on each side; broadcast and all_gather_doubles carry rank
// 0's value and every rank's value in rank order.
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/comm.h"

namespace {

using replay::comm::CollectiveLog;
using replay::comm::CollectiveRecord;
using replay::comm::Kind;

int failures = 0;

void expect(bool cond, const std::string& what, int rank) {
  if (!cond) {
    std::fprintf(stderr, "rank %d: CHECK FAILED: %s\n", rank, what.c_str());
    ++failures;
  }
}

CollectiveLog step_log() {
  CollectiveLog log;
  log.record({Kind::kReduceScatter, 4096, ncclFloat32, ncclAvg, "data-parallel"}, true);
  log.record({Kind::kAllReduce, 1, ncclFloat64, ncclSum, "data-parallel"}, true);
  log.record({Kind::kAllGather, 4096, ncclBfloat16, ncclSum, "data-parallel"}, true);
  return log;
}

// The message check_same_collectives throws here, "" when it does not throw.
std::string check(const replay::comm::World& w, const CollectiveLog& log) {
  try {
    replay::comm::check_same_collectives(w, log);
  } catch (const replay::Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

}  // namespace

int main(int argc, char** argv) {
  const replay::comm::World& w = replay::comm::init_world(&argc, &argv);
  if (w.size < 2) {
    std::printf("SKIPPED: run under mpiexec with 2 or more ranks (this is a world of %d)\n",
                w.size);
    return 77;
  }
  const int r = w.rank;

  // Sizes as nccl-tests counts them (the volume a step reports): the buffer reduced, or the whole
  // buffer gathered or scattered over the ranks.
  using replay::comm::collective_bytes;
  expect(collective_bytes(Kind::kAllReduce, 1000, ncclBfloat16, 4) == 2000, "all-reduce bytes", r);
  expect(collective_bytes(Kind::kAllReduce, 1, ncclFloat64, 4) == 8, "fp64 all-reduce bytes", r);
  expect(collective_bytes(Kind::kReduceScatter, 1000, ncclFloat32, 4) == 16000,
         "reduce-scatter bytes", r);
  expect(collective_bytes(Kind::kAllGather, 1000, ncclBfloat16, 2) == 4000, "all-gather bytes", r);

  // The same captured sequence everywhere; an eager (uncaptured) collective on rank 0 alone does
  // not count, but it is the last one enqueued there (the watchdog's message).
  CollectiveLog same = step_log();
  if (r == 0) same.record({Kind::kAllGather, 99, ncclFloat32, ncclSum, "data-parallel"}, false);
  expect(check(w, same).empty(), "identical sequences pass: " + check(w, same), r);
  expect(same.last() == (r == 0 ? "all_gather(f32 x 99) on 'data-parallel'"
                                : "all_gather(bf16 x 4096) on 'data-parallel'"),
         "last() " + same.last(), r);

  // Rank 1 captured one extra all-reduce at the end (what --inject collective-mismatch plants).
  CollectiveLog extra = step_log();
  if (r == 1) extra.record({Kind::kAllReduce, 1, ncclFloat32, ncclSum, "data-parallel"}, true);
  std::string m = check(w, extra);
  expect(has(m, "captured different collective sequences"), "mismatch reported: '" + m + "'", r);
  expect(has(m, "collective #3"), "names the first differing collective: " + m, r);
  if (r == 1) {
    expect(has(m, "all_reduce(f32 x 1, sum) on 'data-parallel' on rank 1 (4 captured)"),
           "rank 1 names its extra all-reduce: " + m, r);
    expect(has(m, "nothing (the sequence ends) on rank 0 (3 captured)"),
           "rank 1 names rank 0's side: " + m, r);
  } else {
    expect(has(m, "nothing (the sequence ends) on rank " + std::to_string(r) + " (3 captured)"),
           "names this rank's side: " + m, r);
    expect(has(m, "all_reduce(f32 x 1, sum) on 'data-parallel' on rank 1"),
           "names rank 1's extra collective: " + m, r);
  }

  // The last rank reduces a different count in its first collective.
  CollectiveLog count;
  count.record({Kind::kReduceScatter, r == w.size - 1 ? 2048u : 4096u, ncclFloat32, ncclAvg,
                "data-parallel"},
               true);
  m = check(w, count);
  expect(has(m, "collective #0"), "a count mismatch at the first collective: " + m, r);
  expect(has(m, "reduce_scatter(f32 x 2048, avg)") && has(m, "reduce_scatter(f32 x 4096, avg)"),
         "both counts named: " + m, r);

  // The MPI helpers.
  expect(replay::comm::broadcast(w, r == 0 ? 1234u : 7u) == 1234u, "broadcast of rank 0's value",
         r);
  const std::vector<double> all = replay::comm::all_gather_doubles(w, 10.0 * r);
  bool ordered = static_cast<int>(all.size()) == w.size;
  for (int i = 0; ordered && i < w.size; ++i) ordered = all[static_cast<size_t>(i)] == 10.0 * i;
  expect(ordered, "all_gather_doubles in rank order", r);

  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (r == 0)
    std::printf(total == 0 ? "comm across %d ranks: all checks passed\n"
                           : "comm across %d ranks: CHECK FAILED\n",
                w.size);
  replay::comm::finalize_world();
  return total == 0 ? 0 : 1;
}
