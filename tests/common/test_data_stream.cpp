// The batch order and the prefetch ring on the CPU (host-only mode: the ring's logic without CUDA):
// deterministic order for a seed, every batch once per epoch and in order, stalls counted only when
// the prefetch thread is behind, read errors surfacing at the batch that failed.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "common/data/batch_stream.h"
#include "tests/common/test_data_util.h"

namespace replay::data {
namespace {

using test::TempDir;

std::vector<int64_t> rows_of(BatchOrder& order, int64_t index, int64_t mb) {
  std::vector<int64_t> rows(static_cast<size_t>(mb));
  order.rows(index, rows.data());
  return rows;
}

TEST(BatchOrder, SequentialWrapsAroundAndSkipsTheRemainder) {
  BatchOrder order(10, 3, /*shuffle=*/false, 0);
  EXPECT_EQ(order.batches_per_epoch(), 3);
  EXPECT_EQ(rows_of(order, 0, 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(rows_of(order, 2, 3), (std::vector<int64_t>{6, 7, 8}));
  EXPECT_EQ(rows_of(order, 3, 3), (std::vector<int64_t>{0, 1, 2}));  // epoch 1; row 9 is skipped
  EXPECT_THROW(BatchOrder(2, 3, false, 0), Error);
}

TEST(BatchOrder, ShuffledIsAPermutationPerEpochAndDeterministicForASeed) {
  const int64_t n = 40, mb = 4, epochs = 3;
  BatchOrder a(n, mb, true, 11), b(n, mb, true, 11), other_seed(n, mb, true, 12);
  std::vector<std::vector<int64_t>> epoch_rows(epochs);
  bool seed_matters = false;
  for (int64_t i = 0; i < epochs * a.batches_per_epoch(); ++i) {
    const std::vector<int64_t> rows = rows_of(a, i, mb);
    EXPECT_EQ(rows, rows_of(b, i, mb)) << "batch " << i;
    seed_matters = seed_matters || rows != rows_of(other_seed, i, mb);
    auto& e = epoch_rows[i / a.batches_per_epoch()];
    e.insert(e.end(), rows.begin(), rows.end());
  }
  EXPECT_TRUE(seed_matters);
  for (auto& e : epoch_rows) {
    std::vector<int64_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t r = 0; r < n; ++r) ASSERT_EQ(sorted[r], r) << "every row once per epoch";
  }
  EXPECT_NE(epoch_rows[0], epoch_rows[1]) << "each epoch is shuffled anew";
  // Random access (a resumed run) gives the same batch as iterating to it.
  BatchOrder fresh(n, mb, true, 11);
  EXPECT_EQ(rows_of(fresh, 2 * a.batches_per_epoch() + 3, mb),
            rows_of(a, 2 * a.batches_per_epoch() + 3, mb));
}

StreamOptions host_options(bool shuffle, int slots) {
  StreamOptions o;
  o.shuffle = shuffle;
  o.seed = 5;
  o.ring_slots = slots;
  o.host_only = true;
  return o;
}

// Three epochs through a ring of 3 slots: each batch is the one BatchOrder names, split into inputs
// and targets; each epoch covers every row exactly once.
TEST(BatchStream, DeliversEveryBatchOncePerEpochInOrder) {
  TempDir dir;
  const int64_t rows = 12, seq = 7, mb = 2;
  test::write_indexed_file(dir.file("i.h5"), rows, seq);
  const BatchShape shape{mb, seq, test::indexed_vocab(rows, seq)};
  for (bool shuffle : {false, true}) {
    BatchStream stream(TokenFile(dir.file("i.h5"), shape), host_options(shuffle, 3));
    const TokenFile reference(dir.file("i.h5"), shape);
    BatchOrder order(rows, mb, shuffle, 5);
    ASSERT_EQ(stream.batches_per_epoch(), 6);
    std::vector<int32_t> tokens(mb * seq), targets(mb * seq);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::set<int64_t> seen;
      for (int64_t i = 0; i < 6; ++i) {
        const int64_t index = epoch * 6 + i;
        stream.next(nullptr, tokens.data(), targets.data());
        const test::ExpectedBatch e = test::expected_batch(reference, order, index);
        ASSERT_EQ(tokens, e.tokens) << "shuffle " << shuffle << " batch " << index;
        ASSERT_EQ(targets, e.targets) << "shuffle " << shuffle << " batch " << index;
        for (int64_t r = 0; r < mb; ++r) seen.insert(tokens[r * seq] / (seq + 1));
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(rows)) << "epoch " << epoch;
    }
    EXPECT_EQ(stream.delivered(), 18);
  }
}

// A stream over rows [4, 12) of a 16-row file (a training split stopping short of a held-out one):
// every epoch visits exactly those rows, shuffled or not; a range that is not in the file, or holds
// no micro-batch, is refused.
TEST(BatchStream, VisitsOnlyItsRowRange) {
  TempDir dir;
  const int64_t rows = 16, seq = 5, mb = 2;
  test::write_indexed_file(dir.file("i.h5"), rows, seq);
  const BatchShape shape{mb, seq, test::indexed_vocab(rows, seq)};
  for (bool shuffle : {false, true}) {
    StreamOptions o = host_options(shuffle, 2);
    o.first_row = 4;
    o.num_rows = 8;
    BatchStream stream(TokenFile(dir.file("i.h5"), shape), o);
    EXPECT_EQ(stream.num_rows(), 8);
    ASSERT_EQ(stream.batches_per_epoch(), 4);
    std::vector<int32_t> tokens(mb * seq), targets(mb * seq);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      std::set<int64_t> seen;
      for (int64_t i = 0; i < 4; ++i) {
        stream.next(nullptr, tokens.data(), targets.data());
        for (int64_t r = 0; r < mb; ++r) seen.insert(tokens[r * seq] / (seq + 1));
      }
      EXPECT_EQ(seen, (std::set<int64_t>{4, 5, 6, 7, 8, 9, 10, 11})) << "shuffle " << shuffle;
    }
  }
  StreamOptions past = host_options(false, 2);
  past.first_row = 12;
  past.num_rows = 8;
  EXPECT_THROW(BatchStream(TokenFile(dir.file("i.h5"), shape), past), Error);
  StreamOptions too_few = host_options(false, 2);
  too_few.first_row = 15;
  EXPECT_THROW(BatchStream(TokenFile(dir.file("i.h5"), shape), too_few), Error);
}

TEST(BatchStream, StallsOnlyWhenThePrefetchThreadIsBehind) {
  TempDir dir;
  test::write_indexed_file(dir.file("i.h5"), 16, 15);
  const BatchShape shape{1, 15, test::indexed_vocab(16, 15)};
  BatchStream stream(TokenFile(dir.file("i.h5"), shape), host_options(false, 4));
  std::vector<int32_t> tokens(15), targets(15);
  stream.next(nullptr, tokens.data(), targets.data());
  // Give the prefetch thread ample time to fill the ring: the next 4 batches are then waiting.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t before = stream.stalls();
  for (int i = 0; i < 4; ++i) stream.next(nullptr, tokens.data(), targets.data());
  EXPECT_EQ(stream.stalls(), before);
  EXPECT_EQ(tokens[0], 4 * 16);  // batch 4 is row 4
  EXPECT_GE(stream.stall_seconds(), 0.0);
  // Destroying a stream whose prefetch thread waits on a full ring joins it cleanly.
}

TEST(BatchStream, ReadErrorSurfacesAtTheBatchThatFailed) {
  TempDir dir;
  const std::string path = dir.file("bad.h5");
  std::vector<int32_t> tokens(6 * 5, 1);
  tokens[4 * 5 + 2] = 99;  // row 4 breaks a 50-token model
  TokenFileWriter writer(path, 50, 4, 6);
  writer.write_rows(0, 6, tokens.data());
  writer.commit({});
  BatchStream stream(TokenFile(path, {1, 4, 50}), host_options(false, 2));
  std::vector<int32_t> in(4), out(4);
  for (int i = 0; i < 4; ++i) ASSERT_NO_THROW(stream.next(nullptr, in.data(), out.data()));
  try {
    stream.next(nullptr, in.data(), out.data());
    ADD_FAILURE() << "expected the read error of row 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 4 holds token id 99"), std::string::npos) << e.what();
  }
  EXPECT_THROW(stream.next(nullptr, in.data(), out.data()), Error);  // and it stays failed
  EXPECT_EQ(stream.delivered(), 4);
}

}  // namespace
}  // namespace replay::data
