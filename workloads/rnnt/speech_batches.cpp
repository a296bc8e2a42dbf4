// speech_batches.cpp: the sampler and padded host batches.
#include "workloads/rnnt/speech_batches.h"

#include <algorithm>
#include <numeric>

#include "common/check.h"
#include "common/data/splitmix.h"

namespace replay::rnnt {

namespace {

constexpr uint64_t kSamplerKey = 0x9B05688C2B3E6C1Full;

// Fisher-Yates over [begin, end) from `state` (modulo bias below 2^-40 for any real split size).
void shuffle(int64_t* begin, int64_t* end, uint64_t& state) {
  for (int64_t i = (end - begin) - 1; i > 0; --i)
    std::swap(begin[i], begin[data::splitmix(state) % static_cast<uint64_t>(i + 1)]);
}

}  // namespace

SpeechSampler::SpeechSampler(const std::vector<int32_t>& frame_lengths, int64_t first,
                             int64_t count, const SamplerOptions& options)
    : options_(options), first_(first), count_(count) {
  REPLAY_REQUIRE(options.batch_size > 0, "the sampler needs a positive batch size");
  REPLAY_REQUIRE(
      first >= 0 && count > 0 && first + count <= static_cast<int64_t>(frame_lengths.size()),
      "the sampler's utterances lie outside the file");
  REPLAY_REQUIRE(options.order != SamplerOrder::kBuckets || options.num_buckets >= 1,
                 "bucketing needs at least one bucket");
  const int64_t full = count / options.batch_size;
  const bool partial = count % options.batch_size != 0 && !options.drop_last;
  batches_per_epoch_ = full + (partial ? 1 : 0);
  REPLAY_REQUIRE(batches_per_epoch_ > 0,
                 std::to_string(count) + " utterances do not fill one batch of " +
                     std::to_string(options.batch_size) + " with drop_last");
  sorted_.resize(static_cast<size_t>(count));
  std::iota(sorted_.begin(), sorted_.end(), int64_t{0});
  std::stable_sort(sorted_.begin(), sorted_.end(), [&](int64_t a, int64_t b) {
    return frame_lengths[first + a] < frame_lengths[first + b];
  });
}

void SpeechSampler::draw_epoch(int64_t epoch) {
  const int64_t b = options_.batch_size;
  std::vector<int64_t> order(static_cast<size_t>(count_));
  uint64_t state =
      data::mix64(options_.seed ^ kSamplerKey) ^ data::mix64(static_cast<uint64_t>(epoch));
  switch (options_.order) {
    case SamplerOrder::kSequential:
      std::iota(order.begin(), order.end(), int64_t{0});
      break;
    case SamplerOrder::kLengthSorted:
      order = sorted_;
      break;
    case SamplerOrder::kBuckets: {
      order = sorted_;
      const int64_t k = std::min<int64_t>(options_.num_buckets, count_);
      int64_t begin = 0;
      for (int64_t bucket = 0; bucket < k; ++bucket) {  // numpy's array_split
        const int64_t size = count_ / k + (bucket < count_ % k ? 1 : 0);
        shuffle(order.data() + begin, order.data() + begin + size, state);
        begin += size;
      }
      break;
    }
  }
  // Batches of consecutive entries; the remainder is dropped or becomes a batch with empty slots.
  epoch_slots_.assign(static_cast<size_t>(batches_per_epoch_ * b), -1);
  const int64_t used = std::min(count_, batches_per_epoch_ * b);
  for (int64_t j = 0; j < used; ++j) epoch_slots_[j] = first_ + order[j];
  if (options_.order == SamplerOrder::kBuckets) {
    std::vector<int64_t> batch_order(static_cast<size_t>(batches_per_epoch_));
    std::iota(batch_order.begin(), batch_order.end(), int64_t{0});
    shuffle(batch_order.data(), batch_order.data() + batches_per_epoch_, state);
    std::vector<int64_t> shuffled(epoch_slots_.size());
    for (int64_t i = 0; i < batches_per_epoch_; ++i)
      std::copy_n(epoch_slots_.begin() + batch_order[i] * b, b, shuffled.begin() + i * b);
    epoch_slots_ = std::move(shuffled);
  }
  epoch_ = epoch;
}

void SpeechSampler::batch(int64_t index, int64_t* out) {
  REPLAY_REQUIRE(index >= 0, "negative batch index");
  const int64_t epoch = index / batches_per_epoch_;
  if (epoch != epoch_) draw_epoch(epoch);
  const int64_t b = options_.batch_size;
  std::copy_n(epoch_slots_.begin() + (index % batches_per_epoch_) * b, b, out);
}

std::vector<int64_t> SpeechSampler::batch(int64_t index) {
  std::vector<int64_t> out(static_cast<size_t>(options_.batch_size));
  batch(index, out.data());
  return out;
}

BatchLengths batch_lengths(const std::vector<int32_t>& frame_lengths,
                           const std::vector<int32_t>& label_lengths, const int64_t* indices,
                           int64_t slots) {
  BatchLengths lengths;
  lengths.slots = slots;
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t i = indices[s];
    if (i < 0) continue;
    REPLAY_REQUIRE(i < static_cast<int64_t>(frame_lengths.size()) &&
                       i < static_cast<int64_t>(label_lengths.size()),
                   "a batch names an utterance the lengths do not have");
    lengths.frames.push_back(frame_lengths[i]);
    lengths.labels.push_back(label_lengths[i]);
  }
  return lengths;
}

std::vector<BatchLengths> epoch_batches(SpeechSampler& sampler, int64_t epoch,
                                        const std::vector<int32_t>& frame_lengths,
                                        const std::vector<int32_t>& label_lengths) {
  std::vector<BatchLengths> batches;
  std::vector<int64_t> slots(static_cast<size_t>(sampler.slots()));
  for (int64_t k = 0; k < sampler.batches_per_epoch(); ++k) {
    sampler.batch(epoch * sampler.batches_per_epoch() + k, slots.data());
    batches.push_back(batch_lengths(frame_lengths, label_lengths, slots.data(), sampler.slots()));
  }
  return batches;
}

PaddedBatchRef HostSpeechBatch::ref() {
  return {features.data(), frame_lengths.data(), labels.data(), label_lengths.data()};
}

const float* HostSpeechBatch::features_fp32() const {
  REPLAY_REQUIRE(type == FeatureType::kFP32, "the batch's features are not fp32");
  return reinterpret_cast<const float*>(features.data());
}

const uint16_t* HostSpeechBatch::features_16bit() const {
  REPLAY_REQUIRE(type != FeatureType::kFP32, "the batch's features are fp32");
  return reinterpret_cast<const uint16_t*>(features.data());
}

void assemble_batch(const SpeechFile& file, const Ladder* ladder, const int64_t* indices,
                    int64_t slots, FeatureType type, HostSpeechBatch& out) {
  const BatchLengths lengths =
      batch_lengths(file.frame_lengths(), file.label_lengths(), indices, slots);
  REPLAY_REQUIRE(!lengths.frames.empty(), "a batch needs at least one utterance");
  out.slots = slots;
  out.feature_dim = file.info().feature_dim;
  out.type = type;
  if (ladder) {
    out.rung = ladder->select(lengths.max_frames(), lengths.max_labels());
    out.max_frames = (*ladder)[out.rung].max_frames;
    out.max_labels = (*ladder)[out.rung].max_labels;
  } else {
    out.rung = -1;
    out.max_frames = lengths.max_frames();
    out.max_labels = lengths.max_labels();
  }
  out.indices.assign(indices, indices + slots);
  out.features.resize(static_cast<size_t>(slots * out.max_frames * out.feature_dim) *
                      feature_bytes(type));
  out.frame_lengths.resize(static_cast<size_t>(slots));
  out.labels.resize(static_cast<size_t>(slots * out.max_labels));
  out.label_lengths.resize(static_cast<size_t>(slots));
  file.read_batch(indices, slots, out.max_frames, out.max_labels, type, out.ref());
}

}  // namespace replay::rnnt
