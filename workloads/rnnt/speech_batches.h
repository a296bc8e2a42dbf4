// speech_batches.h: which utterances form each RNN-T batch (the sampler), and the batch itself as
// padded host arrays at a ladder rung: features [B, T_rung, feature_dim], frame lengths [B],
// labels [B, U_rung], label lengths [B]. CPU only; the prefetch ring and the copies to the device
// are the workload's.
//
// The training order is MLPerf's (rnn_speech_recognition/pytorch/common/data/dali/sampler.py,
// BucketingSampler, --num_buckets 6): sort the utterances by length and split them into
// num_buckets buckets of equal count; every epoch, shuffle each bucket, concatenate the buckets in
// order, cut the result into batches of consecutive entries and shuffle the order of the batches.
// A batch therefore holds utterances of one bucket (two where it straddles a boundary), so its
// padding is about the bucket's spread, while the epoch still visits the lengths in random order.
// Where MLPerf drops the epoch's last N mod B utterances (from the end of the longest bucket),
// this sampler by default keeps them as one last batch with empty slots (the transducer loss
// counts a slot of 0 frames as empty), so every utterance is used exactly once per epoch;
// drop_last gives MLPerf's behaviour.
#pragma once

#include <cstdint>
#include <vector>

#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/speech_file.h"

namespace replay::rnnt {

enum class SamplerOrder {
  kBuckets,       // the training order above (num_buckets 1: a plain shuffle)
  kSequential,    // file order, no shuffle (evaluation as MLPerf's SimpleSampler)
  kLengthSorted,  // ascending frames, no shuffle (evaluation with the least padding)
};

struct SamplerOptions {
  int64_t batch_size = 0;  // slots per batch: the global batch when ranks share it
  SamplerOrder order = SamplerOrder::kBuckets;
  int num_buckets = 6;  // MLPerf's default
  bool drop_last = false;
  uint64_t seed = 0;
};

// The batches over utterances [first, first + count) of a file (a split: [0, num_train) to train,
// [num_train, N) to evaluate). Batch `index` belongs to epoch index / batches_per_epoch(); the
// order wraps into the next epoch for as many steps as a run takes. A pure function of (the
// lengths, the options, index): every rank and every rerun sees the same batches. With data
// parallelism a rank takes its share of each global batch (rank r of n: slots [r B/n, (r+1) B/n));
// the slots of a batch are in random order, so every share is alike.
class SpeechSampler {
 public:
  SpeechSampler(const std::vector<int32_t>& frame_lengths, int64_t first, int64_t count,
                const SamplerOptions& options);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t slots() const { return options_.batch_size; }
  // Batch `index`: slots() file indices, -1 for an empty slot (only in an epoch's last, partial
  // batch, and never with drop_last).
  void batch(int64_t index, int64_t* out);
  std::vector<int64_t> batch(int64_t index);

 private:
  void draw_epoch(int64_t epoch);

  SamplerOptions options_;
  int64_t first_, count_, batches_per_epoch_;
  std::vector<int64_t> sorted_;       // positions in the split, by (frames, position)
  int64_t epoch_ = -1;                // the epoch slots_ holds
  std::vector<int64_t> epoch_slots_;  // [batches_per_epoch, batch_size] file indices or -1
};

// One batch's lengths for the ladder and the padding statistics.
BatchLengths batch_lengths(const std::vector<int32_t>& frame_lengths,
                           const std::vector<int32_t>& label_lengths, const int64_t* indices,
                           int64_t slots);

// The lengths of every batch of one epoch of a sampler.
std::vector<BatchLengths> epoch_batches(SpeechSampler& sampler, int64_t epoch,
                                        const std::vector<int32_t>& frame_lengths,
                                        const std::vector<int32_t>& label_lengths);

// A padded batch in host memory.
struct HostSpeechBatch {
  int64_t slots = 0, max_frames = 0, max_labels = 0, feature_dim = 0;
  FeatureType type = FeatureType::kFP16;
  int rung = -1;                  // the ladder rung it was padded to; -1: its own longest
  std::vector<int64_t> indices;   // [slots] file indices, -1: empty
  std::vector<uint8_t> features;  // [slots, max_frames, feature_dim] of `type`
  std::vector<int32_t> frame_lengths, labels, label_lengths;

  PaddedBatchRef ref();
  // The features as fp32, or as 16-bit patterns (fp16 or bf16); the type must match.
  const float* features_fp32() const;
  const uint16_t* features_16bit() const;
};

// Reads utterances indices[0, slots) (-1: empty) from `file` into `out`, padded to the smallest
// rung of `ladder` that fits them, or to their own longest utterance (frames and labels) when
// ladder is null (the exact shapes of --graphs none). Reuses out's buffers.
void assemble_batch(const SpeechFile& file, const Ladder* ladder, const int64_t* indices,
                    int64_t slots, FeatureType type, HostSpeechBatch& out);

}  // namespace replay::rnnt
