// speech_generate.h: synthetic RNN-T data (what replay-rnnt-data writes, datasets/rnnt.md): a
// seeded source of utterances whose lengths follow LibriSpeech's spread and whose transcripts are
// a learnable function of their features, the file generator, and the default file a workload
// generates on first use when it is run without --data.
//
// An utterance is a sequence of segments: a gap, token 0's segment, a gap, token 1's segment, ...,
// a final gap. Every frame of token k's segment is a fixed random embedding of k plus noise; every
// gap frame is the embedding of one more symbol, the gap (silence), plus noise. Inner gaps are at
// least one frame, so repeated tokens stay distinguishable (as CTC needs a blank between repeats),
// and a token's segment is at least two frames. A model that learns the V + 1 embeddings reads the
// transcript off the features: oracle_decode() does exactly that, and recovers every transcript
// when the noise is 0.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/data/generate.h"  // default_data_dir
#include "workloads/rnnt/speech_file.h"

namespace replay::rnnt {

struct SpeechDatasetParams {
  int64_t num_utterances = 2048;
  int64_t num_eval = 128;  // the last num_eval utterances: the held-out split
  int64_t feature_dim = 240;
  int64_t vocab_size = 1023;  // label ids, blank excluded
  // Frames: min + floor(x * (max - min + 1)) with x ~ Beta(length_alpha, length_beta). The default
  // is LibriSpeech train-960 after MLPerf's 16.7 s filter, at 30 ms a frame: 1.0 s to 16.7 s
  // (34 to 557 frames), mean 12.3 s (411 frames), mode near 15 s.
  int64_t min_frames = 34;
  int64_t max_frames = 557;
  double length_alpha = 3.25;
  double length_beta = 1.25;
  // Labels: round(T * token_rate * exp(token_rate_sigma * z)), z ~ N(0, 1), clamped to
  // [1, min(max_labels, (T + 1) / 3)] (a segment of 2 frames and a gap of 1 per label). The
  // default median is 3.5 labels a second, so the longest utterances reach about 125.
  int64_t max_labels = 125;
  double token_rate = 0.105;  // labels per frame, median over utterances
  double token_rate_sigma = 0.18;
  // Feature noise: a frame is (embedding + noise * N(0, I)) / sqrt(1 + noise^2), unit variance.
  double noise = 1.0;
  FeatureType stored = FeatureType::kFP16;
  uint64_t seed = 1234;
};

// Where an utterance's frames go, drawn before its features (and without them: the length
// statistics and the ladder need only this).
struct UtteranceLayout {
  int32_t frames = 0;
  std::vector<int32_t> tokens;        // U label ids
  std::vector<int32_t> token_frames;  // U: frames of each token's segment, >= 2
  std::vector<int32_t> gap_frames;    // U + 1: gap j comes before token j, gap U after the last;
                                      // inner gaps >= 1, the first and last >= 0
};

class SpeechSource {
 public:
  // Checks the parameters (an Error says which is out of range) and draws the V + 1 embeddings.
  explicit SpeechSource(const SpeechDatasetParams& params);

  const SpeechDatasetParams& params() const { return params_; }
  int32_t gap_symbol() const { return static_cast<int32_t>(params_.vocab_size); }
  // Symbol k's embedding (feature_dim values, iid N(0, 1)); k = gap_symbol() is the gap's.
  const float* embedding(int64_t symbol) const;

  // Utterance i of the source: a pure function of (params, i), so any utterance can be redrawn
  // alone, in any order.
  UtteranceLayout layout(int64_t i) const;
  // Each frame's symbol: the token of its segment, or gap_symbol().
  std::vector<int32_t> frame_symbols(const UtteranceLayout& layout) const;
  // Utterance i's features, [layout.frames, feature_dim] row-major into out.
  void features(int64_t i, const UtteranceLayout& layout, float* out) const;

  // The nearest-embedding decoder: each frame's symbol is the embedding nearest to the frame
  // (undoing the unit-variance scaling), and each maximal run of one non-gap symbol is one label.
  // It knows the embeddings, so its error rate bounds the data's floor from above: at the default
  // noise the nearest wrong embedding is about 11 noise standard deviations further than the right
  // one and the rate is 0, so a model's can fall to 0. At high noise (3 and up) single frames flip
  // and it inserts labels; a decoder that pools each segment's frames would do better.
  std::vector<int32_t> oracle_decode(const float* features, int64_t frames) const;

  // The distributions in one line (the file's 'generator' attribute is "replay-rnnt-data: " + it).
  std::string description() const;

 private:
  SpeechDatasetParams params_;
  std::vector<float> embeddings_;  // [(V + 1), feature_dim]
  std::vector<double> norms_;      // squared norm of each embedding
};

// Called after each block of utterances; returning false cancels the generation.
using SpeechProgress = std::function<bool(int64_t utterances_done, int64_t utterances_total)>;

// Writes `path` (atomically: see SpeechFileWriter) with the source's utterances 0 .. N - 1 and
// returns what it wrote (lengths over both splits). A cancel throws Error and leaves nothing.
SpeechFileInfo generate_speech_dataset(const std::string& path, const SpeechDatasetParams& params,
                                       const SpeechProgress& progress = {});

// <dir>/rnnt-v<V>-d<D>-n<N>-e<E>-f<min>-<max>-len<a>_<b>-u<maxU>-rate<r>_<s>-noise<x>-<type>-
// seed<S>.h5: every parameter is in the name, so a file is never reused for other parameters.
std::string default_speech_dataset_path(const SpeechDatasetParams& params,
                                        const std::string& dir = data::default_data_dir());
// Returns default_speech_dataset_path(params, dir), generating the file first when it does not
// exist (a line on stdout before and after). Concurrent callers each write their own temporary
// file and rename it; the files are identical, so the last rename wins harmlessly.
std::string ensure_speech_dataset(const SpeechDatasetParams& params,
                                  const std::string& dir = data::default_data_dir());

}  // namespace replay::rnnt
