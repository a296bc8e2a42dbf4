// capture_check.h: H2's host side, which needs no GPU (tests/exercises/test_h2_capture_check.cu
// runs it on the CPU under mpiexec -n 2): the log of the collectives a rank captured (kind, count,
// type, reduction, in order) and its hash; the check that compares the ranks' logs over MPI before
// the first replay and names the first differing collective on each side; the MPI helpers that
// gather every rank's state (they run on the host, so they work while a GPU spins in a
// collective); and the broken mode's verdict from that state.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace h2 {

inline const char* dtype_name(ncclDataType_t t) {
  return t == ncclFloat32 ? "f32" : t == ncclInt32 ? "i32" : "other";
}
inline const char* op_name(ncclRedOp_t op) {
  return op == ncclSum ? "sum" : op == ncclMax ? "max" : "op";
}

// One collective as a rank enqueued it; its place in the sequence is its order.
struct Collective {
  const char* kind;
  size_t count;
  ncclDataType_t dtype;
  ncclRedOp_t op;
  std::string describe() const {
    return std::string(kind) + "(" + dtype_name(dtype) + " x " + std::to_string(count) + ", " +
           op_name(op) + ")";
  }
};

// The collectives one rank captured, in order.
class CaptureLog {
 public:
  void record(const Collective& c) { captured_.push_back(c); }
  const std::vector<Collective>& captured() const { return captured_; }
  void clear_captured() { captured_.clear(); }

  // FNV-1a over "index:description" of every captured collective, in order.
  uint64_t hash() const {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < captured_.size(); ++i) {
      const std::string line = std::to_string(i) + ":" + captured_[i].describe() + "\n";
      for (unsigned char c : line) h = (h ^ c) * 1099511628211ull;
    }
    return h;
  }

  // Collective #i, or what a reader needs to see when the sequence has no #i.
  std::string at(size_t i) const {
    return i < captured_.size()
               ? captured_[i].describe()
               : "nothing (the sequence ends after " + std::to_string(captured_.size()) + ")";
  }

 private:
  std::vector<Collective> captured_;
};

// ---- MPI helpers: every rank's value, in rank order, on every rank ------------------------------

inline std::vector<std::string> gather_strings(const std::string& mine, int ranks) {
  const int len = static_cast<int>(mine.size());
  std::vector<int> lens(ranks), offsets(ranks);
  MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < ranks; ++r) {
    offsets[r] = total;
    total += lens[r];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPI_Allgatherv(mine.data(), len, MPI_CHAR, &all[0], lens.data(), offsets.data(), MPI_CHAR,
                 MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < ranks; ++r) out.push_back(all.substr(offsets[r], lens[r]));
  return out;
}

inline std::vector<long long> gather_ints(long long mine, int ranks) {
  std::vector<long long> out(ranks);
  MPI_Allgather(&mine, 1, MPI_LONG_LONG, out.data(), 1, MPI_LONG_LONG, MPI_COMM_WORLD);
  return out;
}

// ---- The captured-sequence check ---------------------------------------------------------------

struct Comparison {
  bool same = true;
  uint64_t mine = 0, theirs = 0;
  int other = -1;         // the first rank whose hash differs from this rank's
  size_t first_diff = 0;  // the first collective that differs between this rank and `other`
  std::string here, there;
  size_t n_here = 0, n_there = 0;
};

// Every rank's captured sequence against every other's: the hashes over MPI_Allgather, and where
// they differ the lists, to name the first differing collective on each side. Every rank calls it.
inline Comparison compare_captures(const CaptureLog& log, int rank, int ranks) {
  Comparison c;
  c.mine = log.hash();
  std::vector<long long> hashes = gather_ints(static_cast<long long>(c.mine), ranks);
  for (int r = 0; r < ranks && c.other < 0; ++r)
    if (static_cast<uint64_t>(hashes[r]) != c.mine) c.other = r;
  int any_differs = 0, local = c.other >= 0 ? 1 : 0;
  MPI_Allreduce(&local, &any_differs, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  c.same = any_differs == 0;
  if (c.same) return c;
  // The lists, one collective a line, to say what differs (every rank takes part).
  std::string text;
  for (const Collective& k : log.captured()) text += k.describe() + "\n";
  const std::vector<std::string> lists = gather_strings(text, ranks);
  if (c.other < 0) return c;  // not reached: this rank's hash differs from one rank's at least
  c.theirs = static_cast<uint64_t>(hashes[c.other]);
  std::vector<std::string> theirs;
  for (size_t pos = 0, end; (end = lists[c.other].find('\n', pos)) != std::string::npos;
       pos = end + 1)
    theirs.push_back(lists[c.other].substr(pos, end - pos));
  const std::vector<Collective>& mine = log.captured();
  size_t i = 0;
  while (i < mine.size() && i < theirs.size() && mine[i].describe() == theirs[i]) ++i;
  c.first_diff = i;
  c.n_here = mine.size();
  c.n_there = theirs.size();
  c.here = log.at(i);
  c.there = i < theirs.size()
                ? theirs[i]
                : "nothing (the sequence ends after " + std::to_string(theirs.size()) + ")";
  return c;
}

// ---- The broken mode's verdict -----------------------------------------------------------------

// Rank 0's result line for the broken mode, from every rank's state after the watchdog (gathered
// over MPI): which rank stalled, in which collective, and whether another rank never captured that
// collective. Documented (exit 0) only when a rank's replay timed out without an NCCL error in a
// collective that a rank whose replay completed never captured.
inline int report_broken(const ex::Args& args, double timeout_s,
                         const std::vector<long long>& completed,
                         const std::vector<long long>& progress,
                         const std::vector<long long>& counts,
                         const std::vector<std::string>& errors,
                         const std::vector<std::string>& waits, const std::vector<double>& seconds,
                         const std::vector<std::string>& aborts) {
  const int ranks = static_cast<int>(completed.size());
  int stalled = -1;
  for (int r = 0; r < ranks && stalled < 0; ++r)
    if (!completed[r]) stalled = r;
  if (stalled < 0)
    return ex::report("H2", args, false,
                      "every rank's replay completed (captured %lld and %lld collectives): "
                      "the documented stall did not happen",
                      counts[0], counts[ranks > 1 ? 1 : 0]);
  if (!errors[stalled].empty())
    return ex::report("H2", args, false, "rank %d's replay stopped with NCCL error %s", stalled,
                      errors[stalled].c_str());
  // The stalled rank waited in a collective that another rank never captured: the mismatch.
  int other = -1;
  for (int r = 0; r < ranks && other < 0; ++r)
    if (r != stalled && counts[r] <= progress[stalled]) other = r;
  std::string abort_text;
  for (int r = 0; r < ranks; ++r)
    abort_text += (r ? ", rank " : "rank ") + std::to_string(r) + " " + aborts[r];
  char other_text[192] = "every other rank captured it too";
  if (other >= 0)
    std::snprintf(other_text, sizeof(other_text),
                  "which rank %d never captured (its graph holds %lld collectives; its replay %s "
                  "in %.1f s)",
                  other, counts[other], completed[other] ? "completed" : "stalled too",
                  seconds[other]);
  return ex::report("H2", args, other >= 0 && completed[other] != 0,
                    "replay did not complete within %.0f s: rank %d waited in collective #%lld %s "
                    "(its graph holds %lld), %s; ncclCommAbort: %s",
                    timeout_s, stalled, progress[stalled], waits[stalled].c_str(), counts[stalled],
                    other_text, abort_text.c_str());
}

}  // namespace h2
