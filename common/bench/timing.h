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
std::vector<double> time_repeats(cudaStream_t stream, int warmup, int repeats,
                                 const std::function<void(cudaStream_t)>& enqueue);

}  // namespace replay::bench
