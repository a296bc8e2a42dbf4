// latent_stream.cpp: the prefetch thread and ring of LatentStream (latent_stream.h), as
// common/data/batch_stream.cpp does for token files.
#include "workloads/unet/latent_stream.h"

#include <cstring>
#include <utility>

#include "common/check.h"
#include "common/data/batch_stream.h"
#include "workloads/unet/fp16_bits.h"

namespace replay::unet {

LatentStream::LatentStream(const std::string& path, const LatentDataShape& shape,
                           const LatentStreamOptions& options)
    : file_(path, shape),
      options_(options),
      batch_(shape.micro_batch),
      moment_elements_(shape.moment_elements()),
      text_elements_(shape.text_elements()),
      num_samples_(options.num_samples > 0 ? options.num_samples
                                           : file_.info().training_samples()) {
  REPLAY_REQUIRE(options.ring_slots >= 1, "the ring needs at least one slot");
  REPLAY_REQUIRE(num_samples_ >= batch_ && num_samples_ <= file_.info().training_samples(),
                 "samples [0, " + std::to_string(num_samples_) + ") of " + path + " (" +
                     std::to_string(file_.info().training_samples()) +
                     " training samples) do not hold a batch of " + std::to_string(batch_));
  const size_t slot_elements = static_cast<size_t>(batch_ * (moment_elements_ + text_elements_));
  if (!options.host_only) REPLAY_CUDA_CHECK(cudaGetDevice(&device_));
  slots_.resize(static_cast<size_t>(options.ring_slots));
  for (Slot& slot : slots_) {
    if (options.host_only) {
      slot.host.resize(slot_elements);
      slot.data = slot.host.data();
      continue;
    }
    void* pinned = nullptr;
    REPLAY_CUDA_CHECK(
        cudaHostAlloc(&pinned, slot_elements * sizeof(uint16_t), cudaHostAllocDefault));
    slot.pinned.reset(static_cast<uint16_t*>(pinned));
    slot.data = slot.pinned.get();
    cudaEvent_t event = nullptr;
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    slot.copied.reset(event);
  }
  start();  // last: nothing after it may throw
}

LatentStream::~LatentStream() {
  stop();
  // The last copies may still be reading the ring; errors cannot be reported from here.
  for (Slot& slot : slots_)
    if (slot.copied) cudaEventSynchronize(slot.copied.get());
}

void LatentStream::start() {
  thread_ = std::thread(&LatentStream::prefetch_loop, this);
}

void LatentStream::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void LatentStream::seek(int64_t index) {
  REPLAY_REQUIRE(index >= 0, "LatentStream::seek: negative batch index");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    REPLAY_REQUIRE(consumed_ == 0, "LatentStream::seek after the first batch was handed out");
  }
  stop();
  // Nothing was handed out, so no copy reads the ring: the prefetch restarts from `index`.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    produced_ = 0;
    error_ = nullptr;
    first_ = index;
  }
  start();
}

int64_t LatentStream::position() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_ + consumed_;
}

int64_t LatentStream::delivered() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return consumed_;
}

int64_t LatentStream::stalls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stalls_;
}

void LatentStream::prefetch_loop() {
  try {
    if (!options_.host_only) {
      REPLAY_CUDA_CHECK(cudaSetDevice(device_));
      // This thread's event waits must not disturb a global-mode capture on the training thread
      // (they only wait on events recorded outside any capture, which is always safe).
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      REPLAY_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    }
    data::BatchOrder order(num_samples_, batch_, options_.shuffle, options_.seed);
    std::vector<int64_t> rows(static_cast<size_t>(batch_));
    const int64_t ring = static_cast<int64_t>(slots_.size());
    for (int64_t b = 0;; ++b) {
      Slot& slot = slots_[static_cast<size_t>(b % ring)];
      {
        // The slot last held batch b - ring: wait until next() has issued its copies.
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || consumed_ > b - ring; });
        if (stop_) return;
      }
      // ... and until the device has finished reading it (the training thread never waits here).
      if (slot.copied) REPLAY_CUDA_CHECK(cudaEventSynchronize(slot.copied.get()));
      order.rows(first_ + b, rows.data());
      uint16_t* moments = slot.data;
      uint16_t* text = slot.data + batch_ * moment_elements_;
      file_.read_batch(rows.data(), batch_, moments, text);
      if (options_.text_bf16)
        for (int64_t i = 0; i < batch_ * text_elements_; ++i)
          text[i] = float_to_bf16_bits(half_bits_to_float(text[i]));
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

void LatentStream::next(cudaStream_t stream, void* dst_moments, void* dst_text) {
  REPLAY_REQUIRE(dst_moments != nullptr && dst_text != nullptr, "null destination buffer");
  if (!options_.host_only) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    REPLAY_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "LatentStream::next must run outside any captured region: its copies read a "
                   "different ring slot every step");
  }
  int64_t b = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (produced_ == consumed_ && !error_) {  // the prefetch thread is behind: a stall
      ++stalls_;
      cv_.wait(lock, [&] { return produced_ > consumed_ || error_; });
    }
    if (produced_ == consumed_) std::rethrow_exception(error_);
    b = consumed_;
  }
  Slot& slot = slots_[static_cast<size_t>(b % static_cast<int64_t>(slots_.size()))];
  const size_t moment_bytes = static_cast<size_t>(batch_ * moment_elements_) * sizeof(uint16_t);
  const size_t text_bytes = static_cast<size_t>(batch_ * text_elements_) * sizeof(uint16_t);
  const uint16_t* text = slot.data + batch_ * moment_elements_;
  if (options_.host_only) {
    std::memcpy(dst_moments, slot.data, moment_bytes);
    std::memcpy(dst_text, text, text_bytes);
  } else {
    REPLAY_CUDA_CHECK(
        cudaMemcpyAsync(dst_moments, slot.data, moment_bytes, cudaMemcpyHostToDevice, stream));
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(dst_text, text, text_bytes, cudaMemcpyHostToDevice, stream));
    REPLAY_CUDA_CHECK(cudaEventRecord(slot.copied.get(), stream));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    consumed_ = b + 1;
  }
  cv_.notify_all();
}

}  // namespace replay::unet
