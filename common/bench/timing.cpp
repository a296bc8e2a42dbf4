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

int repeats_within(double budget_ms, double call_ms, int min_repeats, int max_repeats) {
  REPLAY_REQUIRE(max_repeats > 0 && min_repeats >= 0, "repeats must be positive");
  // No budget, or a call too fast to time: the count is not the limit.
  if (budget_ms <= 0 || !(call_ms > 0)) return max_repeats;
  const double fit = std::floor(budget_ms / call_ms);
  return static_cast<int>(
      std::clamp(fit, double(std::min(min_repeats, max_repeats)), double(max_repeats)));
}

namespace {

// Events created up front and destroyed on every path.
class EventPairs {
 public:
  explicit EventPairs(int n) : events_(2 * static_cast<size_t>(n), nullptr) {
    try {
      for (auto& e : events_) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~EventPairs() { destroy(); }
  EventPairs(const EventPairs&) = delete;
  EventPairs& operator=(const EventPairs&) = delete;

  // Runs enqueue `n` times (n <= the pairs), call i between pair i.
  void run(cudaStream_t stream, int n, const std::function<void(cudaStream_t)>& enqueue) {
    for (int i = 0; i < n; ++i) {
      REPLAY_CUDA_CHECK(cudaEventRecord(events_[2 * i], stream));
      enqueue(stream);
      REPLAY_CUDA_CHECK(cudaEventRecord(events_[2 * i + 1], stream));
    }
  }
  // Pair i's elapsed time in ms (after the stream has drained).
  double elapsed(int i) const {
    float t = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&t, events_[2 * i], events_[2 * i + 1]));
    return t;
  }

 private:
  void destroy() {
    for (auto& e : events_)
      if (e) cudaEventDestroy(e);
  }
  std::vector<cudaEvent_t> events_;
};

}  // namespace

std::vector<double> time_repeats(cudaStream_t stream, int warmup, int repeats,
                                 const std::function<void(cudaStream_t)>& enqueue, double lead_ms,
                                 double budget_ms) {
  REPLAY_REQUIRE(repeats > 0 && warmup >= 0, "repeats must be positive, warm-up non-negative");
  REPLAY_REQUIRE(
      budget_ms <= 0 || warmup >= 2,
      "a time budget needs 2 or more warm-up calls (the first builds plans; the others give "
      "the time a call takes)");
  if (budget_ms > 0) {
    enqueue(stream);
    EventPairs warm(warmup - 1);
    warm.run(stream, warmup - 1, enqueue);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> warm_ms(static_cast<size_t>(warmup - 1));
    for (int i = 0; i < warmup - 1; ++i) warm_ms[i] = warm.elapsed(i);
    repeats = repeats_within(budget_ms, summarize(warm_ms).median, kMinBudgetRepeats, repeats);
  } else {
    for (int i = 0; i < warmup; ++i) enqueue(stream);
  }
  if (lead_ms > 0) {
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    gpu_idle(stream, lead_ms);
  }
  EventPairs timed(repeats);
  timed.run(stream, repeats, enqueue);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms(static_cast<size_t>(repeats));
  for (int i = 0; i < repeats; ++i) ms[i] = timed.elapsed(i);
  return ms;
}

}  // namespace replay::bench
