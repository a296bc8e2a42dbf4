// latent_stream.cpp: LatentStream (latent_stream.h) over the prefetch ring the token workloads use
// (common/data/prefetch_ring.h).
#include "workloads/unet/latent_stream.h"

#include <cstring>
#include <utility>

#include "common/check.h"
#include "workloads/unet/fp16_bits.h"

namespace replay::unet {

namespace {

// The samples the stream visits, checked to hold a batch inside the file's training split.
int64_t samples_visited(const LatentFile& file, const std::string& path,
                        const LatentDataShape& shape, const LatentStreamOptions& options) {
  const int64_t n = options.num_samples > 0 ? options.num_samples : file.info().training_samples();
  REPLAY_REQUIRE(n >= shape.micro_batch && n <= file.info().training_samples(),
                 "samples [0, " + std::to_string(n) + ") of " + path + " (" +
                     std::to_string(file.info().training_samples()) +
                     " training samples) do not hold a batch of " +
                     std::to_string(shape.micro_batch));
  return n;
}

data::PrefetchRing::Options ring_options(const LatentDataShape& shape,
                                         const LatentStreamOptions& options) {
  data::PrefetchRing::Options r;
  r.slot_bytes =
      static_cast<size_t>(shape.micro_batch * (shape.moment_elements() + shape.text_elements())) *
      sizeof(uint16_t);
  r.slots = options.ring_slots;
  r.host_only = options.host_only;
  return r;
}

}  // namespace

LatentStream::LatentStream(const std::string& path, const LatentDataShape& shape,
                           const LatentStreamOptions& options)
    : file_(path, shape),
      options_(options),
      batch_(shape.micro_batch),
      moment_elements_(shape.moment_elements()),
      text_elements_(shape.text_elements()),
      num_samples_(samples_visited(file_, path, shape, options)),
      order_(num_samples_, batch_, options.shuffle, options.seed),
      rows_(static_cast<size_t>(batch_)),
      ring_(ring_options(shape, options), [this](int64_t b, void* slot) { fill(b, slot); }) {
  ring_.start();  // last: nothing after it may throw
}

LatentStream::~LatentStream() = default;  // the ring stops its thread and waits for the copies

void LatentStream::seek(int64_t index) {
  REPLAY_REQUIRE(index >= 0, "LatentStream::seek: negative batch index");
  ring_.restart("LatentStream::seek", [&] { first_ = index; });
}

int64_t LatentStream::position() const {
  return first_ + ring_.taken();
}

int64_t LatentStream::delivered() const {
  return ring_.taken();
}

int64_t LatentStream::stalls() const {
  return ring_.stalls();
}

double LatentStream::stall_seconds() const {
  return ring_.stall_seconds();
}

void LatentStream::fill(int64_t b, void* slot) {
  order_.rows(first_ + b, rows_.data());
  auto* moments = static_cast<uint16_t*>(slot);
  uint16_t* text = moments + batch_ * moment_elements_;
  file_.read_batch(rows_.data(), batch_, moments, text);
  if (options_.text_bf16)
    for (int64_t i = 0; i < batch_ * text_elements_; ++i)
      text[i] = float_to_bf16_bits(half_bits_to_float(text[i]));
}

void LatentStream::next(cudaStream_t stream, void* dst_moments, void* dst_text) {
  REPLAY_REQUIRE(dst_moments != nullptr && dst_text != nullptr, "null destination buffer");
  const size_t moment_bytes = static_cast<size_t>(batch_ * moment_elements_) * sizeof(uint16_t);
  const size_t text_bytes = static_cast<size_t>(batch_ * text_elements_) * sizeof(uint16_t);
  ring_.take(stream, "LatentStream::next", [&](const void* slot, cudaStream_t s) {
    const auto* moments = static_cast<const uint16_t*>(slot);
    const uint16_t* text = moments + batch_ * moment_elements_;
    if (options_.host_only) {
      std::memcpy(dst_moments, moments, moment_bytes);
      std::memcpy(dst_text, text, text_bytes);
      return;
    }
    REPLAY_CUDA_CHECK(
        cudaMemcpyAsync(dst_moments, moments, moment_bytes, cudaMemcpyHostToDevice, s));
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(dst_text, text, text_bytes, cudaMemcpyHostToDevice, s));
  });
}

}  // namespace replay::unet
