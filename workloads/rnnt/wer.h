// wer.h: the error rate greedy decoding is scored by: the Levenshtein distance between a
// hypothesis and its reference over label ids, summed over utterances and divided by the
// references' total length. MLPerf scores words (detokenized word pieces); the synthetic data has
// no words, so replay scores its labels the same way and logs the result as eval_accuracy.
#pragma once

#include <cstdint>
#include <vector>

namespace replay::rnnt {

// The fewest substitutions, insertions and deletions that turn hyp[0, n) into ref[0, m).
int64_t edit_distance(const int32_t* hyp, int64_t n, const int32_t* ref, int64_t m);

struct ErrorRate {
  int64_t errors = 0;     // summed edit distances
  int64_t reference = 0;  // summed reference lengths

  void add(const int32_t* hyp, int64_t n, const int32_t* ref, int64_t m);
  void add(const std::vector<int32_t>& hyp, const std::vector<int32_t>& ref) {
    add(hyp.data(), static_cast<int64_t>(hyp.size()), ref.data(), static_cast<int64_t>(ref.size()));
  }
  // errors / reference (0 when there is no reference at all).
  double rate() const { return reference > 0 ? static_cast<double>(errors) / reference : 0.0; }
};

}  // namespace replay::rnnt
