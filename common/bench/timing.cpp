// timing.cpp: per-repeat event timing and percentile statistics.
#include "common/bench/timing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/check.h"

namespace replay::bench {

Stats summarize(std::vector<double> s) {
  Stats r;
  r.count = static_cast<int>(s.size());
  if (s.empty()) return r;
  std::sort(s.begin(), s.end());
  auto pct = [&](double p) {
    const double pos = p * static_cast<double>(s.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, s.size() - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - static_cast<double>(lo));
  };
  r.median = pct(0.5);
  r.p10 = pct(0.1);
  r.p90 = pct(0.9);
  r.min = s.front();
  r.max = s.back();
  r.mean = std::accumulate(s.begin(), s.end(), 0.0) / static_cast<double>(s.size());
  return r;
}

std::vector<double> time_repeats(cudaStream_t stream, int warmup, int repeats,
                                 const std::function<void(cudaStream_t)>& enqueue, double lead_ms) {
  REPLAY_REQUIRE(repeats > 0 && warmup >= 0, "repeats must be positive, warm-up non-negative");
  for (int i = 0; i < warmup; ++i) enqueue(stream);
  if (lead_ms > 0) {
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    gpu_idle(stream, lead_ms);
  }
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(repeats));
  for (auto& e : events) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < repeats; ++i) {
    REPLAY_CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    enqueue(stream);
    REPLAY_CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms(static_cast<size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    float t = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]));
    ms[i] = t;
  }
  for (auto& e : events) cudaEventDestroy(e);
  return ms;
}

}  // namespace replay::bench
