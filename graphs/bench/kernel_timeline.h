// kernel_timeline.h: the host side of replay-graphs-bench's kernel timestamps: the record each
// block of an instrumented kernel writes, the choice of clock, and the reduction of a run's records
// into kernel durations, the idle time between kernels and the run's span, and of those into the
// reported gaps. Host-only and header-only, so the CPU test checks exactly what the benchmark
// computes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/check.h"

namespace replay::graphs_bench {

// What thread 0 of every block of an instrumented kernel writes, as one 16-byte store, once all
// threads of the block are done: %globaltimer when the block started (ns) and the block's length,
// both in %globaltimer ns and in clock64 cycles of its own SM. Lengths fit 32 bits for blocks under
// two seconds.
struct alignas(16) BlockStamp {
  uint64_t start_ns;
  uint32_t length_ns;
  uint32_t length_cycles;
};
static_assert(sizeof(BlockStamp) == 16 && offsetof(BlockStamp, length_ns) == 8 &&
                  offsetof(BlockStamp, length_cycles) == 12,
              "the device writes a BlockStamp as one 16-byte store of two 64-bit halves");

// Where a block's end comes from. kGlobaltimer: start_ns + length_ns. kSmClock: start_ns +
// length_cycles / sm_clock_ghz, cycle-exact lengths for when %globaltimer ticks coarsely. clock64
// counters of different SMs are not aligned with each other, so only a block's own cycle delta is
// used; blocks are placed in time (and against each other) by %globaltimer in both cases.
enum class TimerSource { kGlobaltimer, kSmClock };

struct Timer {
  TimerSource source = TimerSource::kGlobaltimer;
  double sm_clock_ghz = 0;  // cycles per ns; used by kSmClock only
};

inline const char* timer_source_name(TimerSource source) {
  return source == TimerSource::kGlobaltimer ? "globaltimer" : "sm_clock";
}

// The coarsest %globaltimer step at which its own readings are used for block lengths: 100 ns is a
// tenth of a 1 us inter-kernel gap and a quarter percent of a 40 us chain kernel. Coarser steps
// (some GPUs update it only every microsecond) switch lengths to the SM clock.
inline constexpr double kMaxGlobaltimerStepNs = 100.0;

// What consecutive %globaltimer reads by one thread show.
struct GlobaltimerProbe {
  double resolution_ns = 0;  // smallest nonzero difference between consecutive reads
  double tick_ns = 0;        // mean time between changes of the value
  double read_ns = 0;        // mean time between reads
  int changes = 0;           // how many times the value changed
};

// From `reads`, consecutive values of %globaltimer read by one thread. Requires at least two
// changes.
inline GlobaltimerProbe probe_globaltimer(const std::vector<uint64_t>& reads) {
  REPLAY_REQUIRE(reads.size() >= 3, "the globaltimer probe needs at least three reads");
  GlobaltimerProbe p;
  uint64_t smallest = std::numeric_limits<uint64_t>::max(), first_change = 0, last_change = 0;
  for (size_t i = 1; i < reads.size(); ++i) {
    REPLAY_REQUIRE(reads[i] >= reads[i - 1],
                   "globaltimer went backwards at read " + std::to_string(i));
    if (reads[i] == reads[i - 1]) continue;
    smallest = std::min(smallest, reads[i] - reads[i - 1]);
    if (p.changes == 0) first_change = reads[i];
    last_change = reads[i];
    ++p.changes;
  }
  REPLAY_REQUIRE(p.changes >= 2, "globaltimer changed " + std::to_string(p.changes) + " times in " +
                                     std::to_string(reads.size()) +
                                     " reads; probe with more reads");
  p.resolution_ns = static_cast<double>(smallest);
  p.tick_ns = static_cast<double>(last_change - first_change) / (p.changes - 1);
  p.read_ns =
      static_cast<double>(reads.back() - reads.front()) / static_cast<double>(reads.size() - 1);
  return p;
}

// %globaltimer when its resolution is at most kMaxGlobaltimerStepNs, the SM clock otherwise.
inline Timer choose_timer(const GlobaltimerProbe& probe, double sm_clock_ghz) {
  if (probe.resolution_ns <= kMaxGlobaltimerStepNs)
    return {TimerSource::kGlobaltimer, sm_clock_ghz};
  REPLAY_REQUIRE(sm_clock_ghz > 0, "the SM clock must be calibrated to time blocks with it");
  return {TimerSource::kSmClock, sm_clock_ghz};
}

// Start and end of one kernel in %globaltimer ns: its first block's start and its last block's end.
struct KernelInterval {
  double start_ns = 0, end_ns = 0;
  double duration_ns() const { return end_ns - start_ns; }
};

inline double block_end_ns(const BlockStamp& b, const Timer& timer) {
  const double length = timer.source == TimerSource::kGlobaltimer
                            ? static_cast<double>(b.length_ns)
                            : static_cast<double>(b.length_cycles) / timer.sm_clock_ghz;
  return static_cast<double>(b.start_ns) + length;
}

inline KernelInterval kernel_interval(const BlockStamp* blocks, int count, const Timer& timer) {
  REPLAY_REQUIRE(count > 0, "a kernel has at least one block");
  KernelInterval k{std::numeric_limits<double>::max(), std::numeric_limits<double>::lowest()};
  for (int i = 0; i < count; ++i) {
    k.start_ns = std::min(k.start_ns, static_cast<double>(blocks[i].start_ns));
    k.end_ns = std::max(k.end_ns, block_end_ns(blocks[i], timer));
  }
  return k;
}

// One run of kernels on one stream, from its stamps.
struct Timeline {
  int kernels = 0;
  double sum_kernel_ns = 0;  // the kernels' own durations, added up
  double span_ns = 0;        // first kernel's start to last kernel's end
  double idle_ns = 0;        // span_ns - sum_kernel_ns: the time between kernels
  double cycles_per_ns =
      0;  // total block cycles / total block %globaltimer ns: the SM clock in this run
};

// `stamps` holds kernel 0's blocks, then kernel 1's, ...: blocks_per_kernel[k] records for kernel
// k.
inline Timeline reduce_timeline(const std::vector<BlockStamp>& stamps,
                                const std::vector<int>& blocks_per_kernel, const Timer& timer) {
  REPLAY_REQUIRE(!blocks_per_kernel.empty(), "a timeline needs at least one kernel");
  Timeline t;
  t.kernels = static_cast<int>(blocks_per_kernel.size());
  double first = std::numeric_limits<double>::max(), last = std::numeric_limits<double>::lowest();
  double cycles = 0, ns = 0;
  size_t at = 0;
  for (const int blocks : blocks_per_kernel) {
    REPLAY_REQUIRE(
        blocks > 0 && at + static_cast<size_t>(blocks) <= stamps.size(),
        "stamps hold " + std::to_string(stamps.size()) + " blocks, fewer than the kernels launch");
    const KernelInterval k = kernel_interval(stamps.data() + at, blocks, timer);
    t.sum_kernel_ns += k.duration_ns();
    first = std::min(first, k.start_ns);
    last = std::max(last, k.end_ns);
    for (int b = 0; b < blocks; ++b) {
      cycles += stamps[at + static_cast<size_t>(b)].length_cycles;
      ns += stamps[at + static_cast<size_t>(b)].length_ns;
    }
    at += static_cast<size_t>(blocks);
  }
  REPLAY_REQUIRE(at == stamps.size(), "stamps hold " + std::to_string(stamps.size()) +
                                          " blocks, the kernels " + std::to_string(at));
  t.span_ns = last - first;
  t.idle_ns = t.span_ns - t.sum_kernel_ns;
  t.cycles_per_ns = ns > 0 ? cycles / ns : 0;
  return t;
}

// The times one workload's measurements produced, in microseconds.
struct RunTimes {
  int kernels = 0;
  double sum_kernel_us = 0;        // kernels' own durations in one graph replay (from the stamps)
  double replay_span_us = 0;       // first kernel's start to last kernel's end in that replay
  double graph_us = 0;             // one graph replay, events around the launch
  double eager_sum_kernel_us = 0;  // kernels' own durations in one eager run (from the stamps)
  double eager_us = 0;             // one eager run, events around it
};

// What the benchmark reports about the time a replay spends outside its kernels.
struct Gaps {
  double gap_us = 0;               // graph_us - sum_kernel_us
  double gap_us_per_kernel = 0;    // gap_us / kernels
  double inter_kernel_gap_us = 0;  // (replay_span_us - sum_kernel_us) / (kernels - 1): mean idle
                                   // time between consecutive kernels inside the replay
  double graph_overhead_us = 0;    // graph_us - replay_span_us: launch to first kernel plus last
                                   // kernel to completion
  double graph_over_sum = 0;       // graph_us / sum_kernel_us
  double eager_gap_us_per_kernel = 0;  // (eager_us - eager_sum_kernel_us) / kernels
};

inline Gaps gaps(const RunTimes& t) {
  REPLAY_REQUIRE(t.kernels >= 2 && t.sum_kernel_us > 0 && t.eager_sum_kernel_us > 0,
                 "gaps need two or more kernels with positive durations");
  Gaps g;
  g.gap_us = t.graph_us - t.sum_kernel_us;
  g.gap_us_per_kernel = g.gap_us / t.kernels;
  g.inter_kernel_gap_us = (t.replay_span_us - t.sum_kernel_us) / (t.kernels - 1);
  g.graph_overhead_us = t.graph_us - t.replay_span_us;
  g.graph_over_sum = t.graph_us / t.sum_kernel_us;
  g.eager_gap_us_per_kernel = (t.eager_us - t.eager_sum_kernel_us) / t.kernels;
  return g;
}

}  // namespace replay::graphs_bench
