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

// Runs `enqueue(stream)` `warmup` times, then `repeats` times each between its own pair of events, and
// returns the per-repeat device times in milliseconds. Events are created once up front.
//
// lead_ms > 0: after the warm-up the stream is drained and then held by gpu_idle for lead_ms before
// the timed calls. A GPU that has just run tens of milliseconds of dense GEMMs sits at its power limit
// with lowered clocks; the idle lead lets every timed series start from the same state, so that two
// tools compared side by side (scripts/pytorch_baseline.py ops does the same) see the same clocks.
std::vector<double> time_repeats(cudaStream_t stream, int warmup, int repeats,
                                 const std::function<void(cudaStream_t)>& enqueue, double lead_ms = 0);

// Holds the stream for `ms` milliseconds with one thread polling the global timer (nanosleep between
// reads): the rest of the GPU idles. Asynchronous, like any launch.
void gpu_idle(cudaStream_t stream, double ms);

}  // namespace replay::bench
