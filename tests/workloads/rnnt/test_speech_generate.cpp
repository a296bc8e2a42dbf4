// The synthetic RNN-T source on the CPU: determinism, the layout's invariants, the length
// distributions against their definitions (LibriSpeech's spread: up to 557 frames of 30 ms and 125
// labels), and learnability: a decoder that knows the embeddings recovers every transcript without
// noise and at the default noise through an fp16 file, and one that learns class means from
// training utterances decodes held-out ones. Also the error rate decoding is scored by.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tests/common/test_data_util.h"
#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/speech_generate.h"
#include "workloads/rnnt/wer.h"

namespace replay::rnnt {
namespace {

using test::TempDir;

std::vector<UtteranceLayout> layouts(const SpeechSource& source, int64_t n) {
  std::vector<UtteranceLayout> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(source.layout(i));
  return out;
}

TEST(SpeechSource, IsAPureFunctionOfSeedAndIndex) {
  SpeechDatasetParams p;
  p.feature_dim = 8;
  const SpeechSource a(p), b(p);
  // Any order, any instance: the same utterance.
  for (int64_t i : {5, 0, 3, 5}) {
    const UtteranceLayout x = a.layout(i), y = b.layout(i);
    EXPECT_EQ(x.frames, y.frames);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.token_frames, y.token_frames);
    EXPECT_EQ(x.gap_frames, y.gap_frames);
    std::vector<float> fx(static_cast<size_t>(x.frames * 8)), fy(fx.size());
    a.features(i, x, fx.data());
    b.features(i, y, fy.data());
    EXPECT_EQ(fx, fy);
  }
  p.seed += 1;
  const SpeechSource c(p);
  int differ = 0;
  for (int64_t i = 0; i < 10; ++i) differ += a.layout(i).tokens != c.layout(i).tokens;
  EXPECT_GE(differ, 9);
  EXPECT_NE(a.embedding(0)[0], c.embedding(0)[0]);
  // Utterances differ from one another.
  EXPECT_NE(a.layout(0).tokens, a.layout(1).tokens);

  SpeechDatasetParams bad;
  bad.min_frames = 1;
  EXPECT_THROW(SpeechSource{bad}, Error);
  bad = SpeechDatasetParams{};
  bad.num_eval = bad.num_utterances;
  EXPECT_THROW(SpeechSource{bad}, Error);
  bad = SpeechDatasetParams{};
  bad.noise = -1;
  EXPECT_THROW(SpeechSource{bad}, Error);
}

// Segments of >= 2 frames, inner gaps >= 1, everything adds up to the frames, the counts in range.
TEST(SpeechSource, LayoutsKeepTheirInvariants) {
  const SpeechDatasetParams p;
  const SpeechSource source(p);
  for (const UtteranceLayout& l : layouts(source, 5000)) {
    const int64_t u = static_cast<int64_t>(l.tokens.size());
    ASSERT_GE(l.frames, p.min_frames);
    ASSERT_LE(l.frames, p.max_frames);
    ASSERT_GE(u, 1);
    ASSERT_LE(u, std::min<int64_t>(p.max_labels, (l.frames + 1) / 3));
    ASSERT_EQ(l.token_frames.size(), l.tokens.size());
    ASSERT_EQ(l.gap_frames.size(), l.tokens.size() + 1);
    int64_t sum = 0;
    for (size_t j = 0; j < l.tokens.size(); ++j) {
      ASSERT_GE(l.tokens[j], 0);
      ASSERT_LT(l.tokens[j], p.vocab_size);
      ASSERT_GE(l.token_frames[j], 2);
      if (j > 0) {
        ASSERT_GE(l.gap_frames[j], 1);
      }
      sum += l.token_frames[j] + l.gap_frames[j];
    }
    ASSERT_EQ(sum + l.gap_frames.back(), l.frames);
    const std::vector<int32_t> symbols = source.frame_symbols(l);
    ASSERT_EQ(static_cast<int64_t>(symbols.size()), l.frames);
  }
}

// The regularised incomplete beta function I_x(a, b) on a grid, by Simpson's rule on each cell.
std::vector<double> beta_cdf(double a, double b, int64_t cells) {
  auto density = [&](double x) { return std::pow(x, a - 1) * std::pow(1 - x, b - 1); };
  std::vector<double> cdf(static_cast<size_t>(cells + 1), 0.0);
  const int steps = 64;
  for (int64_t c = 0; c < cells; ++c) {
    const double x0 = static_cast<double>(c) / cells, h = 1.0 / cells / steps;
    double s = 0;
    for (int k = 0; k < steps; k += 2)
      s +=
          h / 3 * (density(x0 + k * h) + 4 * density(x0 + (k + 1) * h) + density(x0 + (k + 2) * h));
    cdf[c + 1] = cdf[c] + s;
  }
  for (double& v : cdf) v /= cdf.back();
  return cdf;
}

// Frames are min + floor(x * span), x ~ Beta(3.25, 1.25): the empirical distribution matches
// (Kolmogorov-Smirnov), and so do the summary figures of LibriSpeech train-960 after MLPerf's
// 16.7 s filter: 1 to 16.7 s, mean 12.3 s (411 frames).
TEST(SpeechSource, FrameLengthsFollowTheBetaShape) {
  const SpeechDatasetParams p;
  const SpeechSource source(p);
  const int64_t n = 20000, span = p.max_frames - p.min_frames + 1;
  std::vector<int64_t> count(static_cast<size_t>(span), 0);
  double mean = 0;
  int64_t longest = 0, shortest = p.max_frames;
  for (const UtteranceLayout& l : layouts(source, n)) {
    ++count[l.frames - p.min_frames];
    mean += l.frames;
    longest = std::max<int64_t>(longest, l.frames);
    shortest = std::min<int64_t>(shortest, l.frames);
  }
  mean /= n;
  // P(T <= min + k) = P(x < (k + 1) / span) = I_{(k+1)/span}.
  const std::vector<double> cdf = beta_cdf(p.length_alpha, p.length_beta, span);
  double ks = 0, seen = 0;
  for (int64_t k = 0; k < span; ++k) {
    seen += static_cast<double>(count[k]) / n;
    ks = std::max(ks, std::fabs(seen - cdf[k + 1]));
  }
  EXPECT_LT(ks, 1.63 / std::sqrt(static_cast<double>(n)));  // 99% critical value
  const double expected_mean =
      p.min_frames + span * p.length_alpha / (p.length_alpha + p.length_beta) - 0.5;
  EXPECT_NEAR(mean, expected_mean, 3.0);
  EXPECT_NEAR(mean * 0.030, 12.35, 0.1);  // seconds
  EXPECT_EQ(longest, 557);                // 16.7 s: ceil(16.7 / 0.03)
  EXPECT_GE(shortest, 34);
  EXPECT_LT(shortest, 120);
}

// Labels per frame are log-normal around 0.105 (3.5 a second) with spread 0.18; over
// LibriSpeech's 281,241 training utterances the longest transcript comes to about 125 labels
// without piling up at the cap.
TEST(SpeechSource, LabelCountsFollowTheRate) {
  const SpeechDatasetParams p;
  const SpeechSource source(p);
  const int64_t n = 281241;
  std::vector<double> log_rate;
  std::vector<int32_t> labels;
  int64_t at_cap = 0;
  for (int64_t i = 0; i < n; ++i) {
    const UtteranceLayout l = source.layout(i);
    const int64_t u = static_cast<int64_t>(l.tokens.size());
    labels.push_back(static_cast<int32_t>(u));
    at_cap += u == p.max_labels;
    // Long utterances, away from the clamps: rounding moves log(U/T) by under 2%.
    if (l.frames >= 300 && u < p.max_labels && u < (l.frames + 1) / 3)
      log_rate.push_back(std::log(static_cast<double>(u) / l.frames));
  }
  std::sort(log_rate.begin(), log_rate.end());
  const double median = std::exp(log_rate[log_rate.size() / 2]);
  const double mean = std::accumulate(log_rate.begin(), log_rate.end(), 0.0) / log_rate.size();
  double var = 0;
  for (double v : log_rate) var += (v - mean) * (v - mean);
  const double sigma = std::sqrt(var / log_rate.size());
  EXPECT_NEAR(median, p.token_rate, 0.02 * p.token_rate);
  EXPECT_NEAR(sigma, p.token_rate_sigma, 0.015);
  const LengthStats s = length_stats(labels.data(), n);
  EXPECT_LE(s.max, 125);
  EXPECT_GE(s.max, 115);
  EXPECT_LT(at_cap, 10) << "the cap must be a bound, not a mode";
  EXPECT_NEAR(s.mean, 44.0, 1.0);
  EXPECT_GE(s.min, 1);
}

// Ids are uniform over the vocabulary: Pearson's chi-square over 1023 ids.
TEST(SpeechSource, TokenIdsAreUniform) {
  const SpeechDatasetParams p;
  const SpeechSource source(p);
  std::vector<int64_t> count(static_cast<size_t>(p.vocab_size), 0);
  int64_t total = 0;
  for (const UtteranceLayout& l : layouts(source, 20000)) {
    for (int32_t t : l.tokens) ++count[t];
    total += static_cast<int64_t>(l.tokens.size());
  }
  const double expected = static_cast<double>(total) / p.vocab_size;
  double chi2 = 0;
  for (int64_t c : count) chi2 += (c - expected) * (c - expected) / expected;
  const double dof = static_cast<double>(p.vocab_size - 1);
  EXPECT_LT(std::fabs(chi2 - dof), 5 * std::sqrt(2 * dof)) << "chi-square " << chi2;
}

// Frames have about zero mean and unit variance whatever the noise (the scaling by
// 1 / sqrt(1 + noise^2)).
TEST(SpeechSource, FeaturesHaveUnitVariance) {
  for (double noise : {0.0, 1.0, 3.0}) {
    SpeechDatasetParams p;
    p.noise = noise;
    const SpeechSource source(p);
    double sum = 0, sum2 = 0;
    int64_t n = 0;
    for (int64_t i = 0; i < 20; ++i) {
      const UtteranceLayout l = source.layout(i);
      std::vector<float> f(static_cast<size_t>(l.frames * p.feature_dim));
      source.features(i, l, f.data());
      for (float v : f) {
        sum += v;
        sum2 += static_cast<double>(v) * v;
      }
      n += static_cast<int64_t>(f.size());
    }
    // The gap's embedding fills about a third of the frames, and its own mean and mean square
    // over 240 dimensions are off by about 1 / sqrt(240) and sqrt(2 / 240).
    EXPECT_NEAR(sum / n, 0.0, 0.1) << "noise " << noise;
    EXPECT_NEAR(sum2 / n, 1.0, 0.15) << "noise " << noise;
  }
}

// ---- Learnability
// --------------------------------------------------------------------------------

double oracle_error_rate(const SpeechSource& decoder, const SpeechSource& data, int64_t first,
                         int64_t count) {
  ErrorRate er;
  const int64_t dim = data.params().feature_dim;
  for (int64_t i = first; i < first + count; ++i) {
    const UtteranceLayout l = data.layout(i);
    std::vector<float> f(static_cast<size_t>(l.frames * dim));
    data.features(i, l, f.data());
    er.add(decoder.oracle_decode(f.data(), l.frames), l.tokens);
  }
  return er.rate();
}

// Without noise the features are the embeddings themselves: the nearest-embedding decoder reads
// every transcript back exactly, repeated tokens included (the gaps keep them apart).
TEST(Learnability, OracleRecoversEveryTranscriptWithoutNoise) {
  SpeechDatasetParams p;
  p.noise = 0;
  const SpeechSource full(p);
  for (int64_t i = 0; i < 6; ++i) {
    const UtteranceLayout l = full.layout(i);
    std::vector<float> f(static_cast<size_t>(l.frames * p.feature_dim));
    full.features(i, l, f.data());
    EXPECT_EQ(full.oracle_decode(f.data(), l.frames), l.tokens) << "utterance " << i;
  }
  // A small vocabulary repeats tokens often.
  p.vocab_size = 3;
  p.feature_dim = 8;
  const SpeechSource small(p);
  int64_t repeats = 0;
  for (int64_t i = 0; i < 200; ++i) {
    const UtteranceLayout l = small.layout(i);
    for (size_t j = 1; j < l.tokens.size(); ++j) repeats += l.tokens[j] == l.tokens[j - 1];
    std::vector<float> f(static_cast<size_t>(l.frames * p.feature_dim));
    small.features(i, l, f.data());
    ASSERT_EQ(small.oracle_decode(f.data(), l.frames), l.tokens) << "utterance " << i;
  }
  EXPECT_GT(repeats, 1000);
}

// At the default noise, through an fp16 file and the reader, the decoder is still exact on the
// held-out split: the data's floor is 0, so a model's error rate can fall all the way.
TEST(Learnability, OracleIsExactAtTheDefaultNoiseThroughAnFp16File) {
  TempDir dir;
  SpeechDatasetParams p;
  p.num_utterances = 16;
  p.num_eval = 8;
  const std::string path = dir.file("speech.h5");
  generate_speech_dataset(path, p);
  const SpeechFile file(path, {p.feature_dim, p.vocab_size, 0, 0});
  const SpeechSource source(p);
  ErrorRate er;
  std::vector<float> f;
  for (int64_t i = file.info().num_train(); i < file.size(); ++i) {
    f.resize(static_cast<size_t>(file.frame_length(i) * p.feature_dim));
    file.read_features(i, FeatureType::kFP32, f.data());
    const std::vector<int32_t> hyp = source.oracle_decode(f.data(), file.frame_length(i));
    er.add(hyp.data(), static_cast<int64_t>(hyp.size()), file.labels(i), file.label_length(i));
  }
  EXPECT_GT(er.reference, 200);
  EXPECT_EQ(er.errors, 0);
}

// The transcripts depend on this seed's embeddings: a decoder with another seed's reads nothing
// useful, and heavy noise makes even the right one fail (the noise sets the task's difficulty).
TEST(Learnability, TheRightEmbeddingsAndLowNoiseAreWhatMakesItReadable) {
  SpeechDatasetParams p;
  p.vocab_size = 64;
  const SpeechSource data(p);
  SpeechDatasetParams other = p;
  other.seed = p.seed + 1;
  EXPECT_GT(oracle_error_rate(SpeechSource(other), data, 0, 10), 0.8);
  SpeechDatasetParams noisy = p;
  noisy.noise = 6;
  const SpeechSource hard(noisy);
  EXPECT_GT(oracle_error_rate(hard, hard, 0, 10), 0.2);
  EXPECT_EQ(oracle_error_rate(data, data, 0, 10), 0.0);
}

// Learnable from the data alone: class means estimated from training utterances' frames (with
// their alignments, which an RNN-T finds by itself) decode held-out utterances, at the default
// noise, as well as the true embeddings do.
TEST(Learnability, ClassMeansFromTrainingUtterancesDecodeHeldOutOnes) {
  SpeechDatasetParams p;
  p.vocab_size = 64;
  p.num_utterances = 330;
  p.num_eval = 30;
  const SpeechSource source(p);
  const int64_t dim = p.feature_dim, symbols = p.vocab_size + 1;
  std::vector<double> sums(static_cast<size_t>(symbols * dim), 0.0);
  std::vector<int64_t> counts(static_cast<size_t>(symbols), 0);
  std::vector<float> f;
  for (int64_t i = 0; i < p.num_utterances - p.num_eval; ++i) {
    const UtteranceLayout l = source.layout(i);
    f.resize(static_cast<size_t>(l.frames * dim));
    source.features(i, l, f.data());
    const std::vector<int32_t> symbol = source.frame_symbols(l);
    for (int64_t t = 0; t < l.frames; ++t) {
      ++counts[symbol[t]];
      for (int64_t d = 0; d < dim; ++d) sums[symbol[t] * dim + d] += f[t * dim + d];
    }
  }
  for (int64_t k = 0; k < symbols; ++k) ASSERT_GT(counts[k], 50) << "symbol " << k;
  std::vector<double> means(sums.size());
  for (size_t k = 0; k < sums.size(); ++k) means[k] = sums[k] / counts[k / dim];

  ErrorRate er;
  for (int64_t i = p.num_utterances - p.num_eval; i < p.num_utterances; ++i) {
    const UtteranceLayout l = source.layout(i);
    f.resize(static_cast<size_t>(l.frames * dim));
    source.features(i, l, f.data());
    std::vector<int32_t> hyp;
    int32_t previous = source.gap_symbol();
    for (int64_t t = 0; t < l.frames; ++t) {
      int32_t best = 0;
      double best_d2 = INFINITY;
      for (int64_t k = 0; k < symbols; ++k) {
        double d2 = 0;
        for (int64_t d = 0; d < dim; ++d) {
          const double diff = f[t * dim + d] - means[k * dim + d];
          d2 += diff * diff;
        }
        if (d2 < best_d2) {
          best_d2 = d2;
          best = static_cast<int32_t>(k);
        }
      }
      if (best != previous && best != source.gap_symbol()) hyp.push_back(best);
      previous = best;
    }
    er.add(hyp, l.tokens);
  }
  EXPECT_GT(er.reference, 500);
  EXPECT_LT(er.rate(), 0.005) << er.errors << " errors";
}

// ---- The error rate -----------------------------------------------------------------------------

TEST(ErrorRate, EditDistanceOnHandMadeCases) {
  auto ed = [](std::vector<int32_t> a, std::vector<int32_t> b) {
    return edit_distance(a.data(), static_cast<int64_t>(a.size()), b.data(),
                         static_cast<int64_t>(b.size()));
  };
  EXPECT_EQ(ed({1, 2, 3}, {1, 2, 3}), 0);
  EXPECT_EQ(ed({}, {1, 2, 3}), 3);
  EXPECT_EQ(ed({1, 2, 3}, {}), 3);
  EXPECT_EQ(ed({1, 2, 3}, {1, 3}), 1);        // an insertion in the hypothesis
  EXPECT_EQ(ed({1, 3}, {1, 2, 3}), 1);        // a deletion
  EXPECT_EQ(ed({1, 9, 3}, {1, 2, 3}), 1);     // a substitution
  EXPECT_EQ(ed({2, 1, 3, 4}, {1, 2, 3}), 3);  // no transpositions in Levenshtein
  // kitten -> sitting
  EXPECT_EQ(ed({'s', 'i', 't', 't', 'i', 'n', 'g'}, {'k', 'i', 't', 't', 'e', 'n'}), 3);
  ErrorRate er;
  EXPECT_EQ(er.rate(), 0.0);
  er.add({1, 2}, {1, 2, 3, 4});
  er.add({5}, {6});
  EXPECT_EQ(er.errors, 3);
  EXPECT_EQ(er.reference, 5);
  EXPECT_DOUBLE_EQ(er.rate(), 0.6);
}

}  // namespace
}  // namespace replay::rnnt
