// RNN-T's ladder and sampler on the CPU: rungs from lengths on hand-made cases (equal-count groups,
// labels that follow frames, rounding, merging, covers, equal widths), the fitted ladder against a
// brute-force search, rung selection, padding statistics by hand, the schemes compared on
// LibriSpeech-like lengths, and the sampler: deterministic, every utterance once per epoch, batches
// within one or two length buckets.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

#include "common/check.h"
#include "common/data/splitmix.h"
#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/speech_batches.h"
#include "workloads/rnnt/speech_generate.h"

namespace replay::rnnt {
namespace {

std::vector<Rung> rungs_of(const Ladder& l) {
  return l.rungs();
}

Ladder quantile(const std::vector<int32_t>& frames, const std::vector<int32_t>& labels, int rungs,
                int64_t granule = 8) {
  LadderOptions o;
  o.rungs = rungs;
  o.granule = granule;
  return Ladder::from_lengths(frames.data(), labels.data(), static_cast<int64_t>(frames.size()), o);
}

// ---- Rungs
// ----------------------------------------------------------------------------------------

TEST(Ladder, HandMadeRungsAreValidated) {
  EXPECT_NO_THROW(Ladder({{100, 20}, {200, 20}, {300, 60}}));
  EXPECT_THROW(Ladder(std::vector<Rung>{}), Error);
  EXPECT_THROW(Ladder({{100, 20}, {100, 40}}), Error);  // frames must increase
  EXPECT_THROW(Ladder({{100, 40}, {200, 20}}), Error);  // labels must not decrease
  EXPECT_THROW(Ladder({{0, 4}}), Error);
  EXPECT_THROW(Ladder({{8, -1}}), Error);
  try {
    Ladder({{100, 20}, {200, 40}, {150, 60}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ladder rung 2 (150x60) is not above rung 1 (200x40)"),
              std::string::npos)
        << e.what();
  }
}

// The smallest rung that holds both the frames and the labels.
TEST(Ladder, SelectsTheSmallestRungThatFits) {
  const Ladder l({{100, 20}, {200, 40}, {300, 60}});
  EXPECT_EQ(l.find(100, 20), 0);
  EXPECT_EQ(l.find(1, 0), 0);
  EXPECT_EQ(l.find(101, 5), 1);  // frames push it up
  EXPECT_EQ(l.find(50, 21), 1);  // labels push it up
  EXPECT_EQ(l.find(50, 41), 2);
  EXPECT_EQ(l.find(300, 60), 2);
  EXPECT_EQ(l.find(301, 1), -1);
  EXPECT_EQ(l.find(50, 61), -1);
  EXPECT_EQ(l.select(150, 30), 1);
  try {
    l.select(301, 70);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a batch of 301 frames and 70 labels does not fit the "
                                         "ladder's top rung (300 frames, 60 labels)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(l.describe(), "3 rungs (frames x labels): 100x20 200x40 300x60");
  EXPECT_EQ(l.top(), (Rung{300, 60}));
}

// Utterances of 1..100 frames and frames / 4 labels, 4 rungs: groups of 25 end at 25, 50, 75 and
// 100 frames (rounded up to 32, 56, 80, 104); each rung's labels are the most of any utterance
// whose frames fit it (32 / 4 = 8, 56 / 4 = 14 -> 16, 80 / 4 = 20 -> 24, 100 / 4 = 25 -> 32).
TEST(Ladder, QuantileRungsOnHandMadeLengths) {
  std::vector<int32_t> frames(100), labels(100);
  for (int i = 0; i < 100; ++i) {
    frames[i] = 100 - i;  // any order
    labels[i] = frames[i] / 4;
  }
  EXPECT_EQ(rungs_of(quantile(frames, labels, 4)),
            (std::vector<Rung>{{32, 8}, {56, 16}, {80, 24}, {104, 32}}));
  // One short utterance with a long transcript: labels follow frames, so every rung holds it
  // and no batch is pushed up by it.
  labels[90] = 40;  // frames 10
  EXPECT_EQ(rungs_of(quantile(frames, labels, 4)),
            (std::vector<Rung>{{32, 40}, {56, 40}, {80, 40}, {104, 40}}));
  // numpy's array_split: 10 utterances in 4 groups of 3, 3, 2, 2 (granule 1 shows the edges).
  std::vector<int32_t> ten(10), ten_labels(10, 1);
  std::iota(ten.begin(), ten.end(), 1);
  EXPECT_EQ(rungs_of(quantile(ten, ten_labels, 4, 1)),
            (std::vector<Rung>{{3, 1}, {6, 1}, {8, 1}, {10, 1}}));
  // More rungs than utterances, and rungs that coincide after rounding, merge.
  EXPECT_EQ(quantile({7, 9}, {1, 2}, 4).size(), 2);
  EXPECT_EQ(rungs_of(quantile({7, 9}, {1, 2}, 4, 1)), (std::vector<Rung>{{7, 1}, {9, 2}}));
  EXPECT_EQ(rungs_of(quantile({50, 50, 50, 49}, {3, 4, 5, 6}, 4)), (std::vector<Rung>{{56, 8}}));
  // Covers raise the top rung (the held-out split's longest utterance).
  LadderOptions o;
  o.rungs = 2;
  o.cover_frames = 200;
  o.cover_labels = 50;
  EXPECT_EQ(rungs_of(Ladder::from_lengths(ten.data(), ten_labels.data(), 10, o)),
            (std::vector<Rung>{{8, 8}, {200, 56}}));
}

// NVIDIA's equal widths: rung g of N at min + ceil((max - min) (g + 1) / N), frames and labels.
TEST(Ladder, EqualWidthRungsOnHandMadeLengths) {
  const std::vector<int32_t> frames = {10, 100, 55, 30}, labels = {2, 20, 9, 4};
  LadderOptions o;
  o.rungs = 3;
  o.granule = 1;
  o.scheme = LadderScheme::kEqualWidth;
  EXPECT_EQ(rungs_of(Ladder::from_lengths(frames.data(), labels.data(), 4, o)),
            (std::vector<Rung>{{40, 8}, {70, 14}, {100, 20}}));
  o.granule = 8;
  EXPECT_EQ(rungs_of(Ladder::from_lengths(frames.data(), labels.data(), 4, o)),
            (std::vector<Rung>{{40, 8}, {72, 16}, {104, 24}}));
}

// The padded lattice of `batches` on ladder `l` (the objective fit_to_batches minimises).
int64_t lattice(const Ladder& l, const std::vector<BatchLengths>& batches) {
  return ladder_padding(l, batches).padded_lattice;
}

// fit_to_batches finds the cheapest ladder: the same cost as trying every monotone ladder of up to
// `rungs` rungs built from the candidate values, on random small sets of batches.
TEST(Ladder, FittedLadderIsTheCheapestOfAll) {
  uint64_t state = 2024;
  auto draw = [&](int64_t n) { return static_cast<int64_t>(data::splitmix(state) % n); };
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<BatchLengths> batches;
    const int64_t nb = 1 + draw(12);
    for (int64_t b = 0; b < nb; ++b) {
      BatchLengths x;
      x.slots = 1 + draw(4);
      const int64_t members = 1 + draw(x.slots);
      for (int64_t m = 0; m < members; ++m) {
        x.frames.push_back(static_cast<int32_t>(1 + draw(6) * 8 + draw(3)));
        x.labels.push_back(static_cast<int32_t>(draw(4) * 8 + draw(2)));
      }
      batches.push_back(x);
    }
    LadderOptions o;
    o.rungs = 1 + static_cast<int>(draw(3));
    const Ladder fitted = Ladder::fit_to_batches(batches, o);
    ASSERT_LE(fitted.size(), o.rungs);
    // Every monotone ladder of at most o.rungs rungs over the candidate values, ending at the top.
    std::set<int64_t> ts, us;
    for (const BatchLengths& b : batches) {
      ts.insert((b.max_frames() + 7) / 8 * 8);
      us.insert((b.max_labels() + 7) / 8 * 8);
    }
    const std::vector<int64_t> tv(ts.begin(), ts.end()), uv(us.begin(), us.end());
    int64_t best = INT64_MAX;
    std::vector<Rung> current;
    std::function<void(size_t, size_t)> search = [&](size_t ti, size_t ui) {
      for (size_t i = ti; i < tv.size(); ++i) {
        for (size_t j = ui; j < uv.size(); ++j) {
          current.push_back({tv[i], uv[j]});
          if (i + 1 == tv.size() && j + 1 == uv.size())
            best = std::min(best, lattice(Ladder(current), batches));
          else if (static_cast<int>(current.size()) < o.rungs)
            search(i + 1, j);
          current.pop_back();
        }
      }
    };
    search(0, 0);
    ASSERT_EQ(lattice(fitted, batches), best) << "trial " << trial << ": " << fitted.describe();
  }
}

// The fitted ladder holds every batch, respects the covers, and drops rungs nobody uses (but
// the top, which the covers may need).
TEST(Ladder, FittedLadderCoversEverything) {
  std::vector<BatchLengths> batches(3);
  batches[0] = {4, {10, 12}, {3, 4}};
  batches[1] = {4, {30}, {9}};
  batches[2] = {4, {31, 2}, {1, 20}};
  LadderOptions o;
  o.rungs = 4;
  o.cover_frames = 50;
  o.cover_labels = 30;
  const Ladder l = Ladder::fit_to_batches(batches, o);
  EXPECT_EQ(l.top(), (Rung{56, 32}));
  for (const BatchLengths& b : batches) EXPECT_GE(l.find(b.max_frames(), b.max_labels()), 0);
  const PaddingStats s = ladder_padding(l, batches);
  for (int r = 0; r + 1 < l.size(); ++r) EXPECT_GT(s.batches_per_rung[r], 0) << l.describe();
  EXPECT_THROW(Ladder::fit_to_batches({}, o), Error);
  o.granule = 1;
  std::vector<BatchLengths> many;
  for (int i = 1; i <= 100; ++i) many.push_back({1, {i}, {i}});
  EXPECT_THROW(Ladder::fit_to_batches(many, o), Error);  // 100 x 100 candidates: coarser, please
}

// ---- Padding statistics
// ---------------------------------------------------------------------------

TEST(PaddingStats, HandMadeBatches) {
  // 4 slots, 2 utterances (10 frames / 1 label, 20 / 2), at a 24 x 8 rung: the GPU computes 96
  // frames for 30 real ones, 32 label positions for 3, and 4 x 24 x 9 = 864 lattice cells for
  // 10 x 2 + 20 x 3 = 80.
  const BatchLengths a{4, {10, 20}, {1, 2}};
  PaddingStats s;
  s.add(a, {24, 8}, 0);
  EXPECT_EQ(s.real_frames, 30);
  EXPECT_EQ(s.padded_frames, 96);
  EXPECT_EQ(s.real_labels, 3);
  EXPECT_EQ(s.padded_labels, 32);
  EXPECT_EQ(s.real_lattice, 80);
  EXPECT_EQ(s.padded_lattice, 864);
  EXPECT_DOUBLE_EQ(s.frame_ratio(), 3.2);
  EXPECT_DOUBLE_EQ(s.lattice_ratio(), 10.8);
  EXPECT_EQ(s.batches_per_rung, (std::vector<int64_t>{1}));

  // On a ladder, and with exact shapes (each batch padded to its own longest).
  const BatchLengths b{2, {40, 40}, {5, 5}};
  const Ladder ladder({{24, 8}, {48, 8}});
  const PaddingStats on_ladder = ladder_padding(ladder, {a, b});
  EXPECT_EQ(on_ladder.batches_per_rung, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(on_ladder.padded_frames, 96 + 2 * 48);
  EXPECT_EQ(on_ladder.real_frames, 110);
  EXPECT_EQ(on_ladder.padded_lattice, 864 + 2 * 48 * 9);
  const PaddingStats exact = exact_padding({a, b});
  EXPECT_EQ(exact.padded_frames, 4 * 20 + 2 * 40);
  EXPECT_EQ(exact.padded_labels, 4 * 2 + 2 * 5);
  EXPECT_EQ(exact.padded_lattice, 4 * 20 * 3 + 2 * 40 * 6);
  EXPECT_TRUE(exact.batches_per_rung.empty());
  EXPECT_NE(on_ladder.describe().find("batches per rung: 1 1"), std::string::npos);
}

TEST(PaddingStats, LengthStatsByNearestRank) {
  const std::vector<int32_t> v = {5, 1, 3, 2, 4};
  const LengthStats s = length_stats(v.data(), 5);
  EXPECT_EQ(s.count, 5);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.max, 5);
  EXPECT_DOUBLE_EQ(s.mean, 3.0);
  EXPECT_EQ(s.p10, 1);
  EXPECT_EQ(s.p50, 3);
  EXPECT_EQ(s.p90, 5);
  EXPECT_EQ(s.p99, 5);
}

// ---- The schemes on LibriSpeech-like data
// ---------------------------------------------------------

struct Lengths {
  std::vector<int32_t> frames, labels;
};

Lengths librispeech_like(int64_t n) {
  SpeechDatasetParams p;
  p.num_utterances = n;
  p.num_eval = 0;
  const SpeechSource source(p);
  Lengths l;
  for (int64_t i = 0; i < n; ++i) {
    const UtteranceLayout u = source.layout(i);
    l.frames.push_back(u.frames);
    l.labels.push_back(static_cast<int32_t>(u.tokens.size()));
  }
  return l;
}

// One epoch of MLPerf's sampler (6 buckets) on 20,000 LibriSpeech-like utterances in batches of 64,
// 4 rungs: the fitted ladder pads least, the quantile rungs less than equal widths, and all more
// than exact shapes; the ladder fitted to epoch 0 serves epoch 1 about as well.
TEST(LadderSchemes, FittedBeatsQuantilesBeatsEqualWidths) {
  const Lengths d = librispeech_like(20000);
  SamplerOptions so;
  so.batch_size = 64;
  so.seed = 5;
  SpeechSampler sampler(d.frames, 0, 20000, so);
  const std::vector<BatchLengths> epoch0 = epoch_batches(sampler, 0, d.frames, d.labels);
  const std::vector<BatchLengths> epoch1 = epoch_batches(sampler, 1, d.frames, d.labels);
  LadderOptions o;
  o.rungs = 4;
  const Ladder fitted = Ladder::fit_to_batches(epoch0, o);
  const Ladder by_quantile = Ladder::from_lengths(d.frames.data(), d.labels.data(), 20000, o);
  o.scheme = LadderScheme::kEqualWidth;
  const Ladder by_width = Ladder::from_lengths(d.frames.data(), d.labels.data(), 20000, o);
  const double exact = exact_padding(epoch0).lattice_ratio();
  const double fit0 = ladder_padding(fitted, epoch0).lattice_ratio();
  const double fit1 = ladder_padding(fitted, epoch1).lattice_ratio();
  const double quant = ladder_padding(by_quantile, epoch0).lattice_ratio();
  const double width = ladder_padding(by_width, epoch0).lattice_ratio();
  EXPECT_EQ(fitted.size(), 4);
  EXPECT_LT(exact, fit0);
  EXPECT_LT(fit0, quant);
  EXPECT_LT(quant, width);
  EXPECT_NEAR(fit1, fit0, 0.03 * fit0);
  EXPECT_LT(fit0, 2.4);
  // Frames alone: the quantile ladder's rungs sit where the batches are; equal widths waste rungs
  // below the bulk of LibriSpeech's lengths.
  EXPECT_LT(ladder_padding(by_quantile, epoch0).frame_ratio(),
            ladder_padding(by_width, epoch0).frame_ratio());
  EXPECT_EQ(ladder_padding(by_width, epoch0).batches_per_rung[0], 0);
}

// ---- The sampler
// ----------------------------------------------------------------------------------

std::vector<int64_t> epoch_slots(SpeechSampler& s, int64_t epoch) {
  std::vector<int64_t> all;
  for (int64_t k = 0; k < s.batches_per_epoch(); ++k) {
    const std::vector<int64_t> b = s.batch(epoch * s.batches_per_epoch() + k);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}

// 1000 utterances in batches of 64: 15 full batches and one of 40 with 24 empty slots; every
// utterance exactly once in every epoch; a split (first 200 .. 999) likewise.
TEST(SpeechSampler, EveryUtteranceOncePerEpoch) {
  const Lengths d = librispeech_like(1000);
  for (int64_t first : {0, 200}) {
    const int64_t count = 1000 - first;
    SamplerOptions o;
    o.batch_size = 64;
    o.seed = 11;
    SpeechSampler s(d.frames, first, count, o);
    EXPECT_EQ(s.batches_per_epoch(), (count + 63) / 64);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      const std::vector<int64_t> all = epoch_slots(s, epoch);
      std::vector<int64_t> used;
      int64_t empty = 0;
      for (int64_t i : all) {
        if (i < 0)
          ++empty;
        else
          used.push_back(i);
      }
      std::sort(used.begin(), used.end());
      std::vector<int64_t> want(static_cast<size_t>(count));
      std::iota(want.begin(), want.end(), first);
      EXPECT_EQ(used, want) << "epoch " << epoch;
      EXPECT_EQ(empty, s.batches_per_epoch() * 64 - count);
      // The empty slots are all in one batch: the epoch's partial one.
      int64_t partial = 0;
      for (int64_t k = 0; k < s.batches_per_epoch(); ++k)
        partial += std::count(all.begin() + k * 64, all.begin() + (k + 1) * 64, -1) > 0;
      EXPECT_EQ(partial, empty > 0 ? 1 : 0);
    }
  }
}

// drop_last: MLPerf's epoch of floor(N / B) full batches, each utterance at most once.
TEST(SpeechSampler, DropLastKeepsFullBatchesOnly) {
  const Lengths d = librispeech_like(1000);
  SamplerOptions o;
  o.batch_size = 64;
  o.drop_last = true;
  SpeechSampler s(d.frames, 0, 1000, o);
  EXPECT_EQ(s.batches_per_epoch(), 15);
  const std::vector<int64_t> all = epoch_slots(s, 0);
  const std::set<int64_t> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), 960u);
  EXPECT_EQ(distinct.count(-1), 0u);
  o.batch_size = 2000;
  EXPECT_THROW(SpeechSampler(d.frames, 0, 1000, o), Error);
}

// The same options give the same batches whatever the order they are asked in; another seed or
// another epoch gives another order.
TEST(SpeechSampler, IsDeterministic) {
  const Lengths d = librispeech_like(1000);
  SamplerOptions o;
  o.batch_size = 32;
  o.seed = 3;
  SpeechSampler a(d.frames, 0, 1000, o), b(d.frames, 0, 1000, o);
  std::vector<std::vector<int64_t>> forward;
  for (int64_t k = 0; k < 80; ++k) forward.push_back(a.batch(k));
  for (int64_t k = 79; k >= 0; --k) EXPECT_EQ(b.batch(k), forward[k]) << "batch " << k;
  EXPECT_NE(epoch_slots(a, 0), epoch_slots(a, 1));
  o.seed = 4;
  SpeechSampler c(d.frames, 0, 1000, o);
  EXPECT_NE(epoch_slots(c, 0), epoch_slots(a, 0));
}

// A batch holds utterances of one length bucket, or of two neighbours where it straddles their
// boundary; with one bucket the epoch is a plain shuffle.
TEST(SpeechSampler, BatchesStayWithinNeighbouringBuckets) {
  const Lengths d = librispeech_like(3000);
  SamplerOptions o;
  o.batch_size = 64;
  o.num_buckets = 6;
  SpeechSampler s(d.frames, 0, 3000, o);
  // Each utterance's bucket: its rank by (frames, index), split as numpy's array_split.
  std::vector<int64_t> order(3000), bucket(3000);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return d.frames[x] < d.frames[y]; });
  for (int64_t r = 0; r < 3000; ++r) bucket[order[r]] = r / 500;
  int64_t straddling = 0;
  for (int64_t k = 0; k < s.batches_per_epoch(); ++k) {
    int64_t lo = 99, hi = -1;
    for (int64_t i : s.batch(k)) {
      if (i < 0) continue;
      lo = std::min(lo, bucket[i]);
      hi = std::max(hi, bucket[i]);
    }
    EXPECT_LE(hi - lo, 1) << "batch " << k;
    straddling += hi > lo;
  }
  EXPECT_LE(straddling, 5);  // at most one per boundary
  o.num_buckets = 1;
  SpeechSampler plain(d.frames, 0, 3000, o);
  int64_t wide = 0;
  for (int64_t k = 0; k < plain.batches_per_epoch(); ++k) {
    int64_t lo = 99, hi = -1;
    for (int64_t i : plain.batch(k)) {
      if (i < 0) continue;
      lo = std::min(lo, bucket[i]);
      hi = std::max(hi, bucket[i]);
    }
    wide += hi - lo >= 4;
  }
  EXPECT_GT(wide, plain.batches_per_epoch() / 2);
}

// Evaluation orders: the file's, or ascending frames; the last batch padded with empty slots.
TEST(SpeechSampler, SequentialAndSortedOrders) {
  const Lengths d = librispeech_like(100);
  SamplerOptions o;
  o.batch_size = 16;
  o.order = SamplerOrder::kSequential;
  SpeechSampler seq(d.frames, 50, 50, o);
  EXPECT_EQ(seq.batches_per_epoch(), 4);
  std::vector<int64_t> want(64, -1);
  std::iota(want.begin(), want.begin() + 50, int64_t{50});
  EXPECT_EQ(epoch_slots(seq, 0), want);
  EXPECT_EQ(epoch_slots(seq, 1), want);
  o.order = SamplerOrder::kLengthSorted;
  SpeechSampler sorted(d.frames, 50, 50, o);
  const std::vector<int64_t> all = epoch_slots(sorted, 0);
  for (size_t k = 1; k < 50; ++k) EXPECT_LE(d.frames[all[k - 1]], d.frames[all[k]]);
  EXPECT_EQ(std::count(all.begin(), all.end(), -1), 14);
}

}  // namespace
}  // namespace replay::rnnt
