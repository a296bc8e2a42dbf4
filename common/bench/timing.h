// timing.h: event-based timing of device work and the statistics every benchmark reports (median,
// p10, p90). For set-up and benchmarks only: it synchronizes, so it never runs on a step path.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

namespace replay::bench {

struct Stats {
  double median = 0, p10 = 0, p90 = 0, mean = 0, min = 0, max = 0;
  int count = 0;
};

// Percentiles by linear interpolation between order statistics; an empty input gives zeros.
Stats summarize(std::vector<double> samples);

// The timed calls that fit `budget_ms` at `call_ms` a call: floor(budget_ms / call_ms), at least
// min(min_repeats, max_repeats) and at most max_repeats. budget_ms <= 0 (no budget) gives
// max_repeats.
int repeats_within(double budget_ms, double call_ms, int min_repeats, int max_repeats);

// The fewest timed calls a budget leaves a series (scripts/pytorch_baseline.py's
// MIN_BUDGET_REPEATS).
constexpr int kMinBudgetRepeats = 5;

// Runs `enqueue(stream)` `warmup` times, then `repeats` times each between its own pair of events,
// and returns the per-repeat device times in milliseconds. Events are created once up front.
//
// lead_ms > 0: after the warm-up the stream is drained and then held by gpu_idle for lead_ms before
// the timed calls. A GPU that has just run tens of milliseconds of dense GEMMs sits at its power
// limit with lowered clocks; the idle lead lets every timed series start from the same state, so
// that two tools compared side by side (scripts/pytorch_baseline.py ops does the same) see the same
// clocks.
//
// budget_ms > 0: the timed calls are cut to those that fit the budget (repeats_within, at the
// median time of the warm-up calls after the first, each of which runs between events too; needs
// warmup >= 2). After the lead, a series of dense GEMMs holds its clocks for some 25-85 ms and then
// drops them in one or two steps (reports/h200/2026-11-22/clocks_and_cudnn); a series that ends
// before the drop is timed at one clock level, whichever tool issues it, where a fixed count of
// calls straddles the drop for some ops and not others.
std::vector<double> time_repeats(cudaStream_t stream, int warmup, int repeats,
                                 const std::function<void(cudaStream_t)>& enqueue,
                                 double lead_ms = 0, double budget_ms = 0);

// Holds the stream for `ms` milliseconds with one thread polling the global timer (nanosleep
// between reads): the rest of the GPU idles. Asynchronous, like any launch.
void gpu_idle(cudaStream_t stream, double ms);

}  // namespace replay::bench
