// ladder.h: the ladder of padded shapes RNN-T's graphs are captured at (--ladder N), on the CPU.
// Each rung is a maximum number of frames and of labels; a batch runs on the smallest rung that
// holds it, padded to that rung's shape, and the workload captures one graph per rung (NVIDIA's
// submission did the same with --num_cg). This file decides the rungs, selects one per batch and
// measures the padding that costs; nothing here touches a GPU.
//
// What padding costs. The encoder's work grows with B x T, the prediction network's with B x U,
// and the joint's and the loss's with B x T x (U + 1): the [B, T, U + 1, 1024] logits are the
// workload's memory problem, so the lattice is what a ladder should keep small. Labels matter as
// much as frames there, and a batch's longest transcript is an extreme value (the most of B
// draws), far above its typical one.
//
// Three schemes, all rounding rungs up to a multiple of the granule (8: the encoder's 2x time
// stacking needs an even T, fp16 rows stay 16-byte aligned, and nearby data sets share rungs):
//  - fit_to_batches (the one for the workload): rungs chosen, by dynamic programming over the
//    candidates, to minimise the padded lattice of the batches the sampler actually makes (one
//    epoch of them: speech_batches.h), a batch running on the first rung that holds it. It is the
//    optimum for that epoch, and other epochs have the same statistics. With as many rungs as the
//    sampler's length buckets, its frame rungs came out at the buckets' upper edges on
//    LibriSpeech-like lengths;
//  - from_lengths, kQuantile: no sampler needed. Frames: split the utterances sorted by frames into
//    N equal-count groups (numpy's array_split, as MLPerf's sampler splits its buckets); rung g
//    is the longest of groups 0..g. Labels: the most of any utterance whose frames fit the rung, so
//    a batch is never pushed up a rung by its transcript, at the price of labels set by outliers;
//  - from_lengths, kEqualWidth: NVIDIA's (audio 400/800/1200/1600): rung g of N is
//    min + ceil((max - min) (g + 1) / N), frames and labels alike. LibriSpeech's lengths are
//    skewed (most utterances are 11 to 16.7 s), so the low rungs serve few batches.
// On LibriSpeech-like lengths (281,241 utterances, batches of 192 from 6 buckets, 4 rungs) the
// padded lattice over the real one is 2.20 fitted, 2.68 by quantiles and 2.92 by equal widths,
// against 1.72 with exact shapes (replay-rnnt-data --lengths-only --utterances 281241 --eval 0
// --ladder 4).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace replay::rnnt {

struct Rung {
  int64_t max_frames = 0;
  int64_t max_labels = 0;
  bool operator==(const Rung& o) const {
    return max_frames == o.max_frames && max_labels == o.max_labels;
  }
};

// The schemes of from_lengths (above).
enum class LadderScheme { kQuantile, kEqualWidth };

struct LadderOptions {
  int rungs = 4;                                  // at most this many; fewer where they coincide
  LadderScheme scheme = LadderScheme::kQuantile;  // from_lengths only
  int64_t granule = 8;                            // rungs are multiples of it
  // The top rung covers at least these (e.g. the held-out split's longest utterance, when the
  // ladder is computed from the training split's lengths, as MLPerf's buckets are).
  int64_t cover_frames = 0;
  int64_t cover_labels = 0;
};

// One batch's lengths, as the ladder and the statistics see it.
struct BatchLengths {
  int64_t slots = 0;                    // the batch's capacity: utterances plus empty slots
  std::vector<int32_t> frames, labels;  // of the utterances in it

  int64_t max_frames() const;
  int64_t max_labels() const;
};

class Ladder {
 public:
  // A ladder of given rungs (hand-made, or a saved one): at least one, frames strictly
  // increasing, labels non-decreasing, frames > 0 and labels >= 0. An Error says which rung breaks
  // it.
  explicit Ladder(std::vector<Rung> rungs);

  // The rungs for these utterances' lengths (frames[i], labels[i], i < n) by options.scheme.
  // Rungs that coincide after rounding are merged.
  static Ladder from_lengths(const int32_t* frames, const int32_t* labels, int64_t n,
                             const LadderOptions& options);

  // The at most options.rungs rungs that minimise the padded lattice of `batches` (sum over them
  // of slots x T x (U + 1)), each batch running on the first rung that holds it, the top rung
  // holding every batch and the covers; rungs no batch runs on are dropped. Exact over the
  // candidates (the batches' rounded maxima), in O(rungs x (frame values x label values)^2): an
  // Error asks for a larger granule past 4096 candidate pairs (granule 8 at MLPerf's lengths:
  // under 70 x 16).
  static Ladder fit_to_batches(const std::vector<BatchLengths>& batches,
                               const LadderOptions& options);

  const std::vector<Rung>& rungs() const { return rungs_; }
  int size() const { return static_cast<int>(rungs_.size()); }
  const Rung& operator[](int i) const { return rungs_[static_cast<size_t>(i)]; }
  const Rung& top() const { return rungs_.back(); }

  // The smallest rung whose frames and labels both hold a batch of at most `frames` frames and
  // `labels` labels, or -1 when even the top rung does not.
  int find(int64_t frames, int64_t labels) const;
  // find(), but a batch above the top rung is an Error naming both shapes.
  int select(int64_t frames, int64_t labels) const;

  std::string describe() const;  // "4 rungs (frames x labels): 280x40 384x56 464x64 560x128"

 private:
  std::vector<Rung> rungs_;
};

// What padding costs over a run of batches. "padded" counts what the GPU computes (every slot of
// the rung's shape, empty slots included), "real" the utterances' own frames. The ratios are
// >= 1; ratio - 1 is the waste (0.25: a quarter more work than the data holds).
struct PaddingStats {
  int64_t batches = 0, slots = 0, utterances = 0;
  int64_t real_frames = 0, padded_frames = 0;    // encoder input frames
  int64_t real_labels = 0, padded_labels = 0;    // prediction-network label positions
  int64_t real_lattice = 0, padded_lattice = 0;  // joint and loss: sum of T x (U + 1)
  std::vector<int64_t> batches_per_rung;         // with a ladder

  // Adds one batch run at shape `shape` (rung `rung` of a ladder, or -1 for an exact shape).
  void add(const BatchLengths& batch, const Rung& shape, int rung = -1);
  double frame_ratio() const;
  double label_ratio() const;
  double lattice_ratio() const;
  std::string describe() const;
};

// The padding of `batches` on the ladder (each on its smallest fitting rung), and with exact
// shapes (each padded only to its own longest utterance: what --graphs none runs).
PaddingStats ladder_padding(const Ladder& ladder, const std::vector<BatchLengths>& batches);
PaddingStats exact_padding(const std::vector<BatchLengths>& batches);

// Summary of a set of lengths (the generator's and the tool's report).
struct LengthStats {
  int64_t count = 0, min = 0, max = 0;
  double mean = 0;
  int64_t p10 = 0, p50 = 0, p90 = 0, p99 = 0;  // nearest-rank percentiles
};
LengthStats length_stats(const int32_t* lengths, int64_t n);

}  // namespace replay::rnnt
