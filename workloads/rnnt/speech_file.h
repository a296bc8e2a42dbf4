// speech_file.h: RNN-T's HDF5 file of feature sequences and token transcripts (format
// replay-rnnt-speech; the layout is datasets/rnnt.md): a reader that validates the whole file
// against the model before any GPU work and reads utterances by index into padded host buffers,
// and a writer that never leaves a half-written file under the final name.
//
// The file holds, per utterance, T frames of `feature_dim` features (240 for MLPerf: 80 log-mel
// stacked 3x and subsampled 3x, one frame per 30 ms) and a transcript of U label ids in
// [0, vocab_size) (1023 word pieces for MLPerf; the blank is the model's, never stored). Frames and
// labels are each concatenated into one flat dataset and located by offsets, so an utterance is one
// contiguous slab whatever its length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/data/h5.h"

namespace replay::rnnt {

inline constexpr const char* kSpeechFormatName = "replay-rnnt-speech";
inline constexpr int64_t kSpeechFormatVersion = 1;

// The element type of features: what the file stores (fp16 or fp32) and what a read delivers
// (any of the three; the model trains in fp16, or bf16 with --precision bf16).
enum class FeatureType { kFP32, kFP16, kBF16 };
size_t feature_bytes(FeatureType type);
const char* feature_type_name(FeatureType type);  // "fp32", "fp16", "bf16"

// IEEE binary16 and bfloat16 bit patterns from and to float, rounding to nearest even (the writer
// and the reader convert with these, so a file's bytes do not depend on HDF5's own conversions).
// A finite float beyond fp16's range gives infinity; NaN stays NaN.
uint16_t fp16_from_float(float x);
float float_from_fp16(uint16_t h);
uint16_t bf16_from_float(float x);
float float_from_bf16(uint16_t h);

// What the model takes from its data.
struct SpeechShape {
  int64_t feature_dim = 240;
  int64_t vocab_size = 1023;  // label ids the model emits, blank excluded: every id is below it
  // The longest utterance the model accepts, in frames and in labels (0: no limit). A file with a
  // longer one is refused at open, naming it (MLPerf drops utterances over 16.7 s from training;
  // a file for replay holds only what the run may batch).
  int64_t max_frames = 0;
  int64_t max_labels = 0;
};

// The optional attributes: where the data came from.
struct SpeechProvenance {
  std::optional<uint64_t> seed;
  std::string generator;  // e.g. "replay-rnnt-data: ..." or "LibriSpeech train-960, ..."
  double frame_ms = std::numeric_limits<double>::quiet_NaN();  // ms per frame (30), NaN: unknown
  double noise = std::numeric_limits<double>::quiet_NaN();     // the synthetic source's noise
};

struct SpeechFileInfo {
  std::string path;
  int64_t feature_dim = 0;
  int64_t vocab_size = 0;  // the data's label vocabulary, at most the model's
  int64_t num_utterances = 0;
  int64_t num_eval = 0;  // the last num_eval utterances are the held-out split
  int64_t total_frames = 0;
  int64_t total_labels = 0;
  FeatureType stored = FeatureType::kFP16;  // kFP16 or kFP32
  // Over all utterances (both splits).
  int64_t min_frames = 0, max_frames = 0, min_labels = 0, max_labels = 0;
  SpeechProvenance provenance;

  int64_t num_train() const { return num_utterances - num_eval; }  // utterances [0, num_train)
};

// Where read_batch writes one batch: host memory the caller owns (e.g. a pinned ring slot).
struct PaddedBatchRef {
  void* features = nullptr;          // [slots, max_frames, feature_dim], of the requested type
  int32_t* frame_lengths = nullptr;  // [slots]
  int32_t* labels = nullptr;         // [slots, max_labels]
  int32_t* label_lengths = nullptr;  // [slots]
};

class SpeechFile {
 public:
  // Opens `path` and validates all of it but the feature values against `shape`, in the order of
  // datasets/rnnt.md: missing file, not HDF5 or damaged (truncated), not this format or version,
  // a missing dataset, wrong rank, type or shape, attributes that disagree with the datasets or
  // each other (a truncated write), offsets that do not start at 0, decrease or do not end at the
  // totals, an utterance without frames or longer than the model's limits, a label id outside the
  // vocabulary, and against the model a feature size other than its own or a larger vocabulary.
  // Each is an Error naming the file, the HDF5 dataset or attribute, the utterance where there is
  // one, and the problem. Reads the offsets and every label into host memory (the labels of
  // LibriSpeech's 281k training utterances are about 50 MB); the features stay in the file. Needs
  // no GPU.
  SpeechFile(const std::string& path, const SpeechShape& shape);

  const SpeechFileInfo& info() const { return info_; }
  const SpeechShape& shape() const { return shape_; }
  int64_t size() const { return info_.num_utterances; }

  // Per-utterance lengths (index = utterance), and one utterance's labels (label_length(i) ids).
  const std::vector<int32_t>& frame_lengths() const { return frame_lengths_; }
  const std::vector<int32_t>& label_lengths() const { return label_lengths_; }
  int32_t frame_length(int64_t i) const;
  int32_t label_length(int64_t i) const;
  const int32_t* labels(int64_t i) const;

  // Reads utterance i's features, [frame_length(i), feature_dim] row-major, into dst as `type`.
  // A NaN or infinite value, or an fp32 value beyond fp16's range when fp16 is asked for, is an
  // Error naming the utterance, frame and feature. HDF5 verifies each chunk's checksum (where the
  // file has them) and fails the read on a mismatch.
  void read_features(int64_t i, FeatureType type, void* dst) const;

  // Reads one padded batch: slot b holds utterance indices[b], or nothing when indices[b] is -1
  // (an empty slot: lengths 0, as the transducer loss takes them). Features past an utterance's
  // frames and empty slots are zeros; labels past its length are 0 (a valid id, so an embedding
  // gather over the padded labels stays in bounds; the loss never reads them). An utterance longer
  // than max_frames or max_labels is an Error naming it and the batch's shape. Thread-compatible:
  // const, and every HDF5 call holds the HDF5 lock, so a prefetch thread may call it.
  void read_batch(const int64_t* indices, int64_t slots, int64_t max_frames, int64_t max_labels,
                  FeatureType type, const PaddedBatchRef& out) const;

 private:
  SpeechFileInfo info_;
  SpeechShape shape_;
  std::vector<int64_t> frame_offsets_;  // [N + 1]
  std::vector<int64_t> label_offsets_;  // [N + 1]
  std::vector<int32_t> frame_lengths_, label_lengths_;
  std::vector<int32_t> labels_;  // all of /labels
  data::H5Id file_;
  data::H5Id features_;
};

// What the writer needs before the first utterance: the layout's attributes, and every
// utterance's lengths (the datasets are sized exactly, and the offsets are written up front).
struct SpeechFileHeader {
  int64_t feature_dim = 240;
  int64_t vocab_size = 1023;
  FeatureType stored = FeatureType::kFP16;  // kFP16 or kFP32
  int64_t num_eval = 0;                     // the last num_eval utterances are held out
};

// Writes a speech file under a temporary name beside `path` (unique per process) and renames it to
// `path` in commit(), which first checks that every utterance was written; destroyed without
// commit() (an error, a cancel), it removes the temporary file. Features are chunked by about
// 64 KiB and every dataset carries Fletcher32 checksums.
class SpeechFileWriter {
 public:
  SpeechFileWriter(std::string path, const SpeechFileHeader& header,
                   std::vector<int32_t> frame_lengths, std::vector<int32_t> label_lengths);
  ~SpeechFileWriter();
  SpeechFileWriter(const SpeechFileWriter&) = delete;
  SpeechFileWriter& operator=(const SpeechFileWriter&) = delete;

  // Utterances [first, first + count): their features, consecutive [frames, feature_dim] blocks
  // (finite, within fp16's range when storing fp16), and their labels, consecutive (ids in
  // [0, vocab_size)). A value that breaks this is an Error naming the utterance.
  void write_utterances(int64_t first, int64_t count, const float* features, const int32_t* labels);
  // Writes the attributes, closes the file and renames it to its final path.
  void commit(const SpeechProvenance& provenance);

  const std::string& temp_path() const { return temp_path_; }
  int64_t total_frames() const { return frame_offsets_.back(); }
  int64_t total_labels() const { return label_offsets_.back(); }

 private:
  std::string path_;
  std::string temp_path_;
  SpeechFileHeader header_;
  std::vector<int64_t> frame_offsets_, label_offsets_;
  std::vector<uint8_t> written_;
  data::H5Id file_;
  data::H5Id features_, labels_;
  bool committed_ = false;
};

}  // namespace replay::rnnt
