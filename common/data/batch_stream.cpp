// batch_stream.cpp: the batch order, and the token stream over the prefetch ring (prefetch_ring.h).
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

namespace {

PrefetchRing::Options ring_options(const StreamOptions& o, int64_t micro_batch, int64_t seq_len) {
  PrefetchRing::Options r;
  r.slot_bytes = static_cast<size_t>(micro_batch * (seq_len + 1)) * sizeof(int32_t);
  r.slots = o.ring_slots;
  r.host_only = o.host_only;
  return r;
}

// The rows the stream visits, checked to hold a micro-batch inside the file.
int64_t rows_visited(const TokenFile& file, const StreamOptions& o) {
  const int64_t n = o.num_rows > 0 ? o.num_rows : file.info().num_sequences - o.first_row;
  const int64_t mb = file.shape().micro_batch;
  REPLAY_REQUIRE(o.first_row >= 0 && n >= mb && o.first_row + n <= file.info().num_sequences,
                 "rows [" + std::to_string(o.first_row) + ", " + std::to_string(o.first_row + n) +
                     ") of a file of " + std::to_string(file.info().num_sequences) +
                     " sequences do not hold a micro-batch of " + std::to_string(mb));
  return n;
}

}  // namespace

BatchStream::BatchStream(TokenFile file, const StreamOptions& options)
    : file_(std::move(file)),
      options_(options),
      micro_batch_(file_.shape().micro_batch),
      seq_len_(file_.info().seq_len),
      num_rows_(rows_visited(file_, options)),
      batches_per_epoch_(num_rows_ / micro_batch_),
      order_(num_rows_, micro_batch_, options.shuffle, options.seed),
      rows_(static_cast<size_t>(micro_batch_)),
      ring_(ring_options(options, micro_batch_, seq_len_),
            [this](int64_t b, void* slot) { fill(b, slot); }) {
  ring_.start();  // last: nothing after it may throw
}

BatchStream::~BatchStream() = default;  // the ring stops its thread and waits for the copies

void BatchStream::seek(int64_t index) {
  REPLAY_REQUIRE(index >= 0, "BatchStream::seek: negative batch index");
  ring_.restart("BatchStream::seek", [&] { first_ = index; });
}

void BatchStream::shard(int64_t stride, int64_t offset) {
  REPLAY_REQUIRE(stride >= 1 && offset >= 0 && offset < stride, "BatchStream::shard: bad share");
  const int64_t at = position();
  ring_.restart("BatchStream::shard", [&] {
    first_ = at;
    options_.stride = stride;
    options_.offset = offset;
  });
}

int64_t BatchStream::position() const {
  return first_ + ring_.taken();
}

void BatchStream::fill(int64_t b, void* slot) {
  auto* data = static_cast<int32_t*>(slot);
  const int64_t row_tokens = seq_len_ + 1;
  order_.rows((first_ + b) * options_.stride + options_.offset, rows_.data());
  for (int64_t r = 0; r < micro_batch_;) {  // one read per run of consecutive rows
    int64_t n = 1;
    while (r + n < micro_batch_ && rows_[r + n] == rows_[r] + n) ++n;
    file_.read_rows(options_.first_row + rows_[r], n, data + r * row_tokens);
    r += n;
  }
}

void BatchStream::next(cudaStream_t stream, int32_t* dst_tokens, int32_t* dst_targets) {
  REPLAY_REQUIRE(dst_tokens != nullptr && dst_targets != nullptr, "null destination buffer");
  ring_.take(stream, "BatchStream::next", [&](const void* slot, cudaStream_t s) {
    const auto* data = static_cast<const int32_t*>(slot);
    if (!options_.host_only) {
      copy_rows_to_device(data, micro_batch_, seq_len_, s, dst_tokens, dst_targets);
      return;
    }
    const size_t out_bytes = static_cast<size_t>(seq_len_) * sizeof(int32_t);
    for (int64_t r = 0; r < micro_batch_; ++r) {
      const int32_t* row = data + r * (seq_len_ + 1);
      std::memcpy(dst_tokens + r * seq_len_, row, out_bytes);
      std::memcpy(dst_targets + r * seq_len_, row + 1, out_bytes);
    }
  });
}

int64_t BatchStream::delivered() const {
  return ring_.taken();
}

int64_t BatchStream::stalls() const {
  return ring_.stalls();
}

double BatchStream::stall_seconds() const {
  return ring_.stall_seconds();
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
