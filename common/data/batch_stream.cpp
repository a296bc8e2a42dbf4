// batch_stream.cpp: the batch order and the prefetch ring.
#include "common/data/batch_stream.h"

#include <cstring>
#include <numeric>
#include <utility>

#include "common/data/splitmix.h"

namespace replay::data {

BatchOrder::BatchOrder(int64_t num_sequences, int64_t micro_batch, bool shuffle, uint64_t seed)
    : num_sequences_(num_sequences),
      micro_batch_(micro_batch),
      batches_per_epoch_(micro_batch > 0 ? num_sequences / micro_batch : 0),
      shuffle_(shuffle),
      seed_(seed) {
  REPLAY_REQUIRE(micro_batch > 0 && batches_per_epoch_ > 0,
                 "the batch order needs at least one full micro-batch of rows");
}

void BatchOrder::rows(int64_t index, int64_t* out) {
  REPLAY_REQUIRE(index >= 0, "negative batch index");
  const int64_t epoch = index / batches_per_epoch_;
  const int64_t first = (index % batches_per_epoch_) * micro_batch_;
  if (!shuffle_) {
    for (int64_t r = 0; r < micro_batch_; ++r) out[r] = first + r;
    return;
  }
  if (epoch != perm_epoch_) {  // Fisher-Yates from the epoch's own stream
    perm_.resize(static_cast<size_t>(num_sequences_));
    std::iota(perm_.begin(), perm_.end(), int64_t{0});
    uint64_t state = mix64(seed_ ^ 0x3C6EF372FE94F82Bull) ^ mix64(static_cast<uint64_t>(epoch));
    for (int64_t i = num_sequences_ - 1; i > 0; --i)  // modulo bias below 2^-32: irrelevant here
      std::swap(perm_[i], perm_[splitmix(state) % static_cast<uint64_t>(i + 1)]);
    perm_epoch_ = epoch;
  }
  for (int64_t r = 0; r < micro_batch_; ++r) out[r] = perm_[first + r];
}

BatchStream::BatchStream(TokenFile file, const StreamOptions& options)
    : file_(std::move(file)),
      options_(options),
      micro_batch_(file_.shape().micro_batch),
      seq_len_(file_.info().seq_len),
      num_rows_(options.num_rows > 0 ? options.num_rows
                                     : file_.info().num_sequences - options.first_row),
      batches_per_epoch_(num_rows_ / micro_batch_) {
  REPLAY_REQUIRE(options.ring_slots >= 1, "the ring needs at least one slot");
  REPLAY_REQUIRE(options.first_row >= 0 && num_rows_ >= micro_batch_ &&
                     options.first_row + num_rows_ <= file_.info().num_sequences,
                 "rows [" + std::to_string(options.first_row) + ", " +
                     std::to_string(options.first_row + num_rows_) + ") of a file of " +
                     std::to_string(file_.info().num_sequences) +
                     " sequences do not hold a micro-batch of " + std::to_string(micro_batch_));
  const size_t slot_tokens = static_cast<size_t>(micro_batch_ * (seq_len_ + 1));
  if (!options.host_only) REPLAY_CUDA_CHECK(cudaGetDevice(&device_));
  slots_.resize(static_cast<size_t>(options.ring_slots));
  for (Slot& slot : slots_) {
    if (options.host_only) {
      slot.host.resize(slot_tokens);
      slot.data = slot.host.data();
      continue;
    }
    void* pinned = nullptr;
    REPLAY_CUDA_CHECK(cudaHostAlloc(&pinned, slot_tokens * sizeof(int32_t), cudaHostAllocDefault));
    slot.pinned.reset(static_cast<int32_t*>(pinned));
    slot.data = slot.pinned.get();
    cudaEvent_t event = nullptr;
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    slot.copied.reset(event);
  }
  thread_ = std::thread(&BatchStream::prefetch_loop, this);  // last: nothing after it may throw
}

BatchStream::~BatchStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // The last copies may still be reading the ring; errors cannot be reported from here.
  for (Slot& slot : slots_)
    if (slot.copied) cudaEventSynchronize(slot.copied.get());
}

void BatchStream::seek(int64_t index) {
  REPLAY_REQUIRE(index >= 0, "BatchStream::seek: negative batch index");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    REPLAY_REQUIRE(consumed_ == 0, "BatchStream::seek after the first batch was handed out");
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // Nothing was handed out, so no copy reads the ring: the prefetch restarts from `index`.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    produced_ = 0;
    error_ = nullptr;
    first_ = index;
  }
  thread_ = std::thread(&BatchStream::prefetch_loop, this);
}

void BatchStream::shard(int64_t stride, int64_t offset) {
  REPLAY_REQUIRE(stride >= 1 && offset >= 0 && offset < stride, "BatchStream::shard: bad share");
  const int64_t at = position();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    REPLAY_REQUIRE(consumed_ == 0, "BatchStream::shard after the first batch was handed out");
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    produced_ = 0;
    error_ = nullptr;
    first_ = at;
    options_.stride = stride;
    options_.offset = offset;
  }
  thread_ = std::thread(&BatchStream::prefetch_loop, this);
}

int64_t BatchStream::position() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_ + consumed_;
}

void BatchStream::prefetch_loop() {
  try {
    if (!options_.host_only) {
      REPLAY_CUDA_CHECK(cudaSetDevice(device_));
      // This thread's event waits must not disturb a global-mode capture on the training thread
      // (they only wait on events recorded outside any capture, which is always safe).
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      REPLAY_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    }
    BatchOrder order(num_rows_, micro_batch_, options_.shuffle, options_.seed);
    std::vector<int64_t> rows(static_cast<size_t>(micro_batch_));
    const int64_t ring = static_cast<int64_t>(slots_.size());
    const int64_t row_tokens = seq_len_ + 1;
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
      order.rows((first_ + b) * options_.stride + options_.offset, rows.data());
      for (int64_t r = 0; r < micro_batch_;) {  // one read per run of consecutive rows
        int64_t n = 1;
        while (r + n < micro_batch_ && rows[r + n] == rows[r] + n) ++n;
        file_.read_rows(options_.first_row + rows[r], n, slot.data + r * row_tokens);
        r += n;
      }
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

void BatchStream::next(cudaStream_t stream, int32_t* dst_tokens, int32_t* dst_targets) {
  REPLAY_REQUIRE(dst_tokens != nullptr && dst_targets != nullptr, "null destination buffer");
  if (!options_.host_only) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    REPLAY_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "BatchStream::next must run outside any captured region: its copies read a "
                   "different ring slot every step");
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
  const size_t out_bytes = static_cast<size_t>(seq_len_) * sizeof(int32_t);
  if (options_.host_only) {
    for (int64_t r = 0; r < micro_batch_; ++r) {
      const int32_t* row = slot.data + r * (seq_len_ + 1);
      std::memcpy(dst_tokens + r * seq_len_, row, out_bytes);
      std::memcpy(dst_targets + r * seq_len_, row + 1, out_bytes);
    }
  } else {
    copy_rows_to_device(slot.data, micro_batch_, seq_len_, stream, dst_tokens, dst_targets);
    REPLAY_CUDA_CHECK(cudaEventRecord(slot.copied.get(), stream));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++consumed_;
  }
  cv_.notify_all();
}

int64_t BatchStream::delivered() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return consumed_;
}

int64_t BatchStream::stalls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stalls_;
}

double BatchStream::stall_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::chrono::duration<double>(stall_time_).count();
}

void copy_rows_to_device(const int32_t* rows, int64_t count, int64_t seq_len, cudaStream_t stream,
                         int32_t* dst_tokens, int32_t* dst_targets) {
  const size_t row_bytes = static_cast<size_t>(seq_len + 1) * sizeof(int32_t);
  const size_t out_bytes = static_cast<size_t>(seq_len) * sizeof(int32_t);
  const auto n = static_cast<size_t>(count);
  REPLAY_CUDA_CHECK(cudaMemcpy2DAsync(dst_tokens, out_bytes, rows, row_bytes, out_bytes, n,
                                      cudaMemcpyHostToDevice, stream));
  REPLAY_CUDA_CHECK(cudaMemcpy2DAsync(dst_targets, out_bytes, rows + 1, row_bytes, out_bytes, n,
                                      cudaMemcpyHostToDevice, stream));
}

HeldOutRows::HeldOutRows(const TokenFile& file, int64_t first_row, int64_t count)
    : count_(count), seq_len_(file.info().seq_len) {
  REPLAY_REQUIRE(first_row >= 0 && count >= 1 && first_row + count <= file.info().num_sequences,
                 "held-out rows [" + std::to_string(first_row) + ", " +
                     std::to_string(first_row + count) + ") are not in a file of " +
                     std::to_string(file.info().num_sequences) + " sequences");
  const size_t tokens = static_cast<size_t>(count * (seq_len_ + 1));
  REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&rows_), tokens * sizeof(int32_t),
                                  cudaHostAllocDefault));
  try {
    file.read_rows(first_row, count, rows_);
  } catch (...) {
    cudaFreeHost(rows_);
    throw;
  }
}

HeldOutRows::~HeldOutRows() {
  if (rows_) cudaFreeHost(rows_);
}

void HeldOutRows::copy(int64_t index, int64_t micro_batch, cudaStream_t stream, int32_t* dst_tokens,
                       int32_t* dst_targets) const {
  REPLAY_REQUIRE(index >= 0 && (index + 1) * micro_batch <= count_,
                 "held-out batch " + std::to_string(index) + " of " + std::to_string(micro_batch) +
                     " rows is past the " + std::to_string(count_) + " held-out rows");
  copy_rows_to_device(rows_ + index * micro_batch * (seq_len_ + 1), micro_batch, seq_len_, stream,
                      dst_tokens, dst_targets);
}

}  // namespace replay::data
