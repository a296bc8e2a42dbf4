// prefetch_ring.cpp: the read-ahead ring (prefetch_ring.h).
#include "common/data/prefetch_ring.h"

#include <string>
#include <utility>

#include "common/check.h"

namespace replay::data {

PrefetchRing::PrefetchRing(const Options& options, Fill fill)
    : options_(options), fill_(std::move(fill)) {
  REPLAY_REQUIRE(options.slots >= 1, "the ring needs at least one slot");
  REPLAY_REQUIRE(options.slot_bytes > 0, "the ring's slots need a size");
  if (!options.host_only) REPLAY_CUDA_CHECK(cudaGetDevice(&device_));
  slots_.resize(static_cast<size_t>(options.slots));
  for (Slot& slot : slots_) {
    if (options.host_only) {
      slot.host.resize(options.slot_bytes);
      slot.data = slot.host.data();
      continue;
    }
    void* pinned = nullptr;
    REPLAY_CUDA_CHECK(cudaHostAlloc(&pinned, options.slot_bytes, cudaHostAllocDefault));
    slot.pinned.reset(pinned);
    slot.data = pinned;
    cudaEvent_t event = nullptr;
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    slot.copied.reset(event);
  }
}

PrefetchRing::~PrefetchRing() {
  stop();
  // The last copies may still be reading the ring; errors cannot be reported from here.
  for (Slot& slot : slots_)
    if (slot.copied) cudaEventSynchronize(slot.copied.get());
}

void PrefetchRing::start() {
  REPLAY_REQUIRE(!thread_.joinable(), "PrefetchRing::start: the prefetch thread runs already");
  thread_ = std::thread(&PrefetchRing::loop, this);
}

void PrefetchRing::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PrefetchRing::restart(const char* who, const std::function<void()>& reconfigure) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    REPLAY_REQUIRE(consumed_ == 0, std::string(who) +
                                       " after the first batch was handed out: the ring's copies "
                                       "may still read it");
  }
  stop();
  // Nothing was handed out, so no copy reads the ring: the prefetch starts over.
  reconfigure();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    produced_ = 0;
    error_ = nullptr;
  }
  start();
}

void PrefetchRing::loop() {
  try {
    if (!options_.host_only) {
      REPLAY_CUDA_CHECK(cudaSetDevice(device_));
      // This thread's event waits must not disturb a global-mode capture on the training thread
      // (they only wait on events recorded outside any capture, which is always safe).
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      REPLAY_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    }
    const int64_t ring = static_cast<int64_t>(slots_.size());
    for (int64_t b = 0;; ++b) {
      Slot& slot = slots_[static_cast<size_t>(b % ring)];
      {
        // The slot last held batch b - ring: wait until take() has issued its copies ...
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || consumed_ > b - ring; });
        if (stop_) return;
      }
      // ... and until the device has finished reading it (the training thread never waits here).
      if (slot.copied) REPLAY_CUDA_CHECK(cudaEventSynchronize(slot.copied.get()));
      fill_(b, slot.data);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        produced_ = b + 1;
      }
      cv_.notify_all();
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

void PrefetchRing::take(cudaStream_t stream, const char* who, const Copy& copy) {
  if (!options_.host_only) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    REPLAY_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   std::string(who) +
                       " must run outside any captured region: its copies read a different ring "
                       "slot every step");
  }
  int64_t b = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (produced_ == consumed_ && !error_) {  // the prefetch thread is behind: a stall
      ++stalls_;
      const auto start = std::chrono::steady_clock::now();
      cv_.wait(lock, [&] { return produced_ > consumed_ || error_; });
      stall_time_ += std::chrono::steady_clock::now() - start;
    }
    if (produced_ == consumed_) std::rethrow_exception(error_);
    b = consumed_;
  }
  const Slot& slot = slots_[static_cast<size_t>(b % static_cast<int64_t>(slots_.size()))];
  copy(slot.data, stream);
  if (slot.copied) REPLAY_CUDA_CHECK(cudaEventRecord(slot.copied.get(), stream));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    consumed_ = b + 1;
  }
  cv_.notify_all();
}

int64_t PrefetchRing::taken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return consumed_;
}

int64_t PrefetchRing::stalls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stalls_;
}

double PrefetchRing::stall_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::chrono::duration<double>(stall_time_).count();
}

}  // namespace replay::data
