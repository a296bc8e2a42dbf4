// test_h2_capture_check: exercise H2's host side on the CPU, under mpiexec -n 2 (no GPU, no NCCL
// call): the captured-sequence check over MPI on planted logs (one rank with an extra collective,
// collectives in another order, another count, another type, equal logs), the hash, and the broken
// mode's verdict from gathered rank states (documented only for a stall in a collective the other
// rank never captured). Prints "FAIL: ..." per failed check and exits 1; 77 without 2 ranks.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "H2-mismatched-collectives/capture_check.h"

namespace {

int g_rank = 0, g_failures = 0, g_checks = 0;

void check(bool ok, const std::string& what) {
  g_checks += 1;
  if (!ok) {
    g_failures += 1;
    std::printf("FAIL: rank %d: %s\n", g_rank, what.c_str());
  }
}

const h2::Collective kGrads{"all_reduce", 4096, ncclFloat32, ncclSum};
const h2::Collective kLoss{"all_reduce", 1, ncclFloat32, ncclSum};
const h2::Collective kFlag{"all_reduce", 1, ncclInt32, ncclMax};

h2::CaptureLog log_of(const std::vector<h2::Collective>& list) {
  h2::CaptureLog log;
  for (const h2::Collective& c : list) log.record(c);
  return log;
}

// Runs the check with this rank's list; expects a difference at `diff` naming `here` and `there`.
void expect_difference(const char* name, const std::vector<h2::Collective>& mine, size_t diff,
                       const std::string& here, const std::string& there) {
  const h2::Comparison c = h2::compare_captures(log_of(mine), g_rank, 2);
  const std::string at = std::string(name) + ": ";
  check(!c.same, at + "the logs differ");
  check(c.other == 1 - g_rank, at + "the other rank named is " + std::to_string(c.other));
  check(c.first_diff == diff, at + "first difference at #" + std::to_string(c.first_diff));
  check(c.here == here, at + "here '" + c.here + "', expected '" + here + "'");
  check(c.there == there, at + "there '" + c.there + "', expected '" + there + "'");
  check(c.mine != c.theirs, at + "the two hashes differ");
  // Each rank's "theirs" is the other rank's "mine".
  const std::vector<long long> mines = h2::gather_ints(static_cast<long long>(c.mine), 2);
  check(static_cast<uint64_t>(mines[1 - g_rank]) == c.theirs, at + "theirs is the other's hash");
}

// What report_broken prints, and its exit code.
std::string report_text(int* code, const std::vector<long long>& completed,
                        const std::vector<long long>& progress,
                        const std::vector<long long>& counts,
                        const std::vector<std::string>& errors,
                        const std::vector<std::string>& waits) {
  std::fflush(stdout);
  char path[] = "/tmp/test-h2-report-XXXXXX";
  const int fd = mkstemp(path);
  const int saved = dup(STDOUT_FILENO);
  dup2(fd, STDOUT_FILENO);
  ex::Args args;  // broken
  *code = h2::report_broken(args, 10.0, completed, progress, counts, errors, waits, {0.01, 10.0},
                            {"returned ncclSuccess (0) in 0.0 s", "did not return within 5 s"});
  std::fflush(stdout);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  std::string text;
  if (FILE* f = std::fopen(path, "r")) {
    char buf[1024];
    while (std::fgets(buf, sizeof(buf), f)) text += buf;
    std::fclose(f);
  }
  close(fd);
  unlink(path);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (ranks != 2) {
    if (g_rank == 0) std::printf("SKIPPED: test_h2_capture_check needs 2 ranks (%d)\n", ranks);
    MPI_Finalize();
    return 77;
  }
  const std::string nothing2 = "nothing (the sequence ends after 2)";
  const std::string flag = "all_reduce(i32 x 1, max)";

  // The exercise's planted mismatch: rank 1 captured the found-inf all-reduce, rank 0 did not.
  expect_difference("extra collective on rank 1",
                    g_rank == 1 ? std::vector<h2::Collective>{kGrads, kLoss, kFlag}
                                : std::vector<h2::Collective>{kGrads, kLoss},
                    2, g_rank == 0 ? nothing2 : flag, g_rank == 0 ? flag : nothing2);
  // Two collectives in another order.
  const std::string grads = "all_reduce(f32 x 4096, sum)", loss = "all_reduce(f32 x 1, sum)";
  expect_difference("order swapped on rank 1",
                    g_rank == 1 ? std::vector<h2::Collective>{kLoss, kGrads}
                                : std::vector<h2::Collective>{kGrads, kLoss},
                    0, g_rank == 0 ? grads : loss, g_rank == 0 ? loss : grads);
  // Another count (an uneven last batch), and another type with the same bytes.
  h2::Collective shorter = kGrads;
  shorter.count = 4095;
  expect_difference("count differs on rank 1", {g_rank == 1 ? shorter : kGrads, kLoss}, 0,
                    g_rank == 0 ? grads : "all_reduce(f32 x 4095, sum)",
                    g_rank == 0 ? "all_reduce(f32 x 4095, sum)" : grads);
  h2::Collective as_int = kLoss;
  as_int.dtype = ncclInt32;
  expect_difference("type differs on rank 1", {kGrads, g_rank == 1 ? as_int : kLoss}, 1,
                    g_rank == 0 ? loss : "all_reduce(i32 x 1, sum)",
                    g_rank == 0 ? "all_reduce(i32 x 1, sum)" : loss);
  // The corrected capture: the same three collectives on both ranks.
  const h2::Comparison same = h2::compare_captures(log_of({kGrads, kLoss, kFlag}), g_rank, 2);
  check(same.same && same.other == -1, "equal logs: the check passes");
  // The hash: order matters, an empty log has one value, a cleared log is empty.
  check(log_of({kGrads, kLoss}).hash() != log_of({kLoss, kGrads}).hash(), "hash depends on order");
  h2::CaptureLog cleared = log_of({kGrads});
  cleared.clear_captured();
  check(cleared.hash() == h2::CaptureLog().hash() && cleared.at(0) ==
                                                         "nothing (the sequence "
                                                         "ends after 0)",
        "a cleared log is empty");

  // The broken mode's verdict (a pure function of the gathered states; run on rank 0).
  if (g_rank == 0) {
    int code = -1;
    std::string text = report_text(&code, {1, 0}, {2, 2}, {2, 3}, {"", ""}, {"", flag});
    check(code == 0 && text ==
                           "H2 broken: replay did not complete within 10 s: rank 1 waited in "
                           "collective #2 all_reduce(i32 x 1, max) (its graph holds 3), which "
                           "rank 0 never captured (its graph holds 2 collectives; its replay "
                           "completed in 0.0 s); ncclCommAbort: rank 0 returned ncclSuccess (0) "
                           "in 0.0 s, rank 1 did not return within 5 s\n",
          "the documented stall: exit 0 and the line the ctest expects, got " +
              std::to_string(code) + ": " + text);
    text = report_text(&code, {1, 1}, {2, 3}, {2, 3}, {"", ""}, {"", ""});
    check(code == 1 && text.find("UNEXPECTED: every rank's replay completed") != std::string::npos,
          "no stall is not the documented symptom: " + text);
    text = report_text(&code, {1, 0}, {2, 2}, {2, 3}, {"", "ncclRemoteError (6)"}, {"", flag});
    check(code == 1 &&
              text.find("UNEXPECTED: rank 1's replay stopped with NCCL error") != std::string::npos,
          "an NCCL error is not the documented symptom: " + text);
    text = report_text(&code, {1, 0}, {1, 1}, {2, 3}, {"", ""}, {"", loss});
    check(code == 1 && text.find("every other rank captured it too") != std::string::npos,
          "a stall in a collective both ranks captured is not the mismatch: " + text);
    text = report_text(&code, {0, 0}, {2, 2}, {3, 2}, {"", ""}, {flag, ""});
    check(code == 1 && text.find("its replay stalled too") != std::string::npos,
          "both ranks stalled is not the documented symptom: " + text);
  }

  int failures = 0, checks = 0;
  MPI_Allreduce(&g_failures, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&g_checks, &checks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) {
    if (failures == 0)
      std::printf("test_h2_capture_check: all %d checks passed on 2 ranks\n", checks);
    else
      std::printf("test_h2_capture_check: %d of %d checks failed\n", failures, checks);
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
