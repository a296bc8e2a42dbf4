// Tensor-parallel slices on the CPU (train/tp_layout.h): for kRows with one, two and three sections
// and kCols, at degrees 1, 2, 4 and 8, on odd shapes (3-D tensors, odd columns and rows): the
// ranks' slices are disjoint and cover the whole tensor, split then assemble gives back every
// byte, a whole tensor made at one degree cuts into another's slices, hand-written examples
// (Megatron's fused QKV and a row-parallel weight) hold each rank's rows and columns, a degree that
// does not divide is named with its reason, and the layout text round-trips.
#include "train/tp_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "common/check.h"

namespace replay::train {
namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// A rank's spec at degree tp: `slice` its shape, sections per rank (kRows).
ParamSpec spec(std::vector<int64_t> slice, TpSplit split, std::vector<int64_t> sections = {}) {
  ParamSpec s;
  s.name = "t";
  s.shape = std::move(slice);
  s.tp_split = split;
  s.tp_sections = std::move(sections);
  return s;
}

struct Case {
  const char* what;
  ParamSpec rank_spec;  // at degree 1: the slice is the whole; scaled by tp below
};

// The specs of the cases at degree tp: the same per-rank slice shape, so the whole grows with tp.
std::vector<Case> cases() {
  return {
      {"rows, one section, 3 x 7", spec({3, 7}, TpSplit::kRows)},
      {"rows, one section, 1-D 5", spec({5}, TpSplit::kRows)},
      {"rows, two sections 3+5 of 3 x 1 x 3 (3-D)", spec({8, 1, 3}, TpSplit::kRows, {3, 5})},
      {"rows, three sections 2+1+1 (GQA's q, k, v) x 9", spec({4, 9}, TpSplit::kRows, {2, 1, 1})},
      {"rows, three sections of a 1-D bias 3+1+1", spec({5}, TpSplit::kRows, {3, 1, 1})},
      {"cols, 5 x 3", spec({5, 3}, TpSplit::kCols)},
      {"cols, 2 x 3 x 1 (3-D)", spec({2, 3, 1}, TpSplit::kCols)},
      {"cols, 1-D 7", spec({7}, TpSplit::kCols)},
      {"none, 3 x 5", spec({3, 5}, TpSplit::kNone)},
  };
}

TEST(TpLayout, SlicesAreDisjointCoverTheWholeAndRoundTrip) {
  for (const int tp : {1, 2, 4, 8})
    for (const Case& c : cases()) {
      SCOPED_TRACE(std::string(c.what) + " at tp " + std::to_string(tp));
      const ParamSpec& s = c.rank_spec;
      const std::vector<int64_t> whole = tp_whole_shape(s, tp);
      const TpLayout layout = tp_layout(s, tp);
      ASSERT_EQ(tp_divides(whole, layout, tp), "");
      EXPECT_EQ(tp_slice_shape(whole, layout, tp), s.shape);  // each rank holds its spec's shape
      const int64_t n = numel(whole), k = numel(s.shape);
      if (s.tp_split == TpSplit::kNone)
        EXPECT_EQ(n, k);
      else
        EXPECT_EQ(n, k * tp);
      // Whole values 1..n (fp32) and the same as 16-bit words.
      std::vector<float> full(static_cast<size_t>(n));
      std::vector<uint16_t> full16(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        full[static_cast<size_t>(i)] = static_cast<float>(i + 1);
        full16[static_cast<size_t>(i)] = static_cast<uint16_t>(i + 1);
      }
      std::vector<int> seen(static_cast<size_t>(n), 0);
      std::vector<float> back(static_cast<size_t>(n), 0.0f);
      std::vector<uint16_t> back16(static_cast<size_t>(n), 0);
      for (int r = 0; r < tp; ++r) {
        std::vector<float> slice(static_cast<size_t>(k), -1.0f);
        std::vector<uint16_t> slice16(static_cast<size_t>(k), 0);
        tp_extract(whole, layout, tp, r, full.data(), slice.data(), sizeof(float));
        tp_extract(whole, layout, tp, r, full16.data(), slice16.data(), sizeof(uint16_t));
        for (int64_t i = 0; i < k; ++i) {
          const float v = slice[static_cast<size_t>(i)];
          ASSERT_GE(v, 1.0f);
          ASSERT_EQ(slice16[static_cast<size_t>(i)], static_cast<uint16_t>(v));
          seen[static_cast<size_t>(v) - 1] += 1;
        }
        tp_insert(whole, layout, tp, r, slice.data(), back.data(), sizeof(float));
        tp_insert(whole, layout, tp, r, slice16.data(), back16.data(), sizeof(uint16_t));
      }
      // Every element in exactly one rank's slice (replicated: in every rank's).
      const int expect = s.tp_split == TpSplit::kNone ? tp : 1;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], expect) << i;
      EXPECT_EQ(back, full);
      EXPECT_EQ(back16, full16);
    }
}

// Slices keep the whole tensor's order inside: row-major within each section (kRows), within each
// row (kCols).
TEST(TpLayout, EachSliceKeepsTheWholeTensorsOrder) {
  for (const int tp : {2, 4, 8})
    for (const Case& c : cases()) {
      SCOPED_TRACE(std::string(c.what) + " at tp " + std::to_string(tp));
      const std::vector<int64_t> whole = tp_whole_shape(c.rank_spec, tp);
      const TpLayout layout = tp_layout(c.rank_spec, tp);
      std::vector<float> full(static_cast<size_t>(numel(whole)));
      std::iota(full.begin(), full.end(), 0.0f);
      for (int r = 0; r < tp; ++r) {
        std::vector<float> slice(static_cast<size_t>(numel(c.rank_spec.shape)));
        tp_extract(whole, layout, tp, r, full.data(), slice.data(), sizeof(float));
        // Within one section's rows (or one row's columns) the elements are consecutive.
        const int64_t run = c.rank_spec.tp_split == TpSplit::kCols
                                ? c.rank_spec.shape.back()
                                : numel(c.rank_spec.shape) / c.rank_spec.shape.front();
        for (size_t i = 1; i < slice.size(); ++i) {
          if (i % static_cast<size_t>(run) != 0) {
            ASSERT_EQ(slice[i], slice[i - 1] + 1.0f) << i;
          }
        }
      }
    }
}

// A whole tensor put together from the slices of one degree cuts into another degree's slices:
// what loading a TP4 checkpoint at TP2 (or TP1) does.
TEST(TpLayout, ReshardsBetweenDegrees) {
  const std::vector<int64_t> whole = {24, 5};
  const TpLayout qkv{TpSplit::kRows, {8, 8, 8}};
  std::vector<float> full(static_cast<size_t>(numel(whole)));
  std::iota(full.begin(), full.end(), 0.0f);
  std::vector<float> assembled(full.size(), -1.0f);
  for (int r = 0; r < 4; ++r) {  // written at TP4
    std::vector<float> slice(full.size() / 4);
    tp_extract(whole, qkv, 4, r, full.data(), slice.data(), sizeof(float));
    tp_insert(whole, qkv, 4, r, slice.data(), assembled.data(), sizeof(float));
  }
  ASSERT_EQ(assembled, full);
  // Read at TP2: rank 1 holds rows 4..7 of q, 12..15 of k (8 + 4..7), 20..23 of v.
  std::vector<float> slice(full.size() / 2);
  tp_extract(whole, qkv, 2, 1, assembled.data(), slice.data(), sizeof(float));
  std::vector<float> expect;
  for (const int64_t row : {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23})
    for (int64_t c = 0; c < 5; ++c) expect.push_back(static_cast<float>(row * 5 + c));
  EXPECT_EQ(slice, expect);
}

// Hand-written: a fused QKV weight of 2 q heads and 1 k and 1 v head of width 2 at TP2 (Megatron:
// rank r holds q head r, and half of the k and v rows); a row-parallel weight's column blocks.
TEST(TpLayout, HandWrittenSlices) {
  {
    const ParamSpec qkv = spec({2 * 1 + 1 + 1, 3}, TpSplit::kRows, {2, 1, 1});  // rank's rows
    const std::vector<int64_t> whole = tp_whole_shape(qkv, 2);
    EXPECT_EQ(whole, (std::vector<int64_t>{8, 3}));
    EXPECT_EQ(tp_layout(qkv, 2), (TpLayout{TpSplit::kRows, {4, 2, 2}}));
    std::vector<int> full(24);
    std::iota(full.begin(), full.end(), 0);
    std::vector<int> slice(12);
    tp_extract(whole, tp_layout(qkv, 2), 2, 1, full.data(), slice.data(), sizeof(int));
    // Rows 2, 3 (q), 5 (k), 7 (v).
    EXPECT_EQ(slice, (std::vector<int>{6, 7, 8, 9, 10, 11, 15, 16, 17, 21, 22, 23}));
  }
  {
    const ParamSpec proj = spec({2, 2}, TpSplit::kCols);
    const std::vector<int64_t> whole = tp_whole_shape(proj, 3);
    EXPECT_EQ(whole, (std::vector<int64_t>{2, 6}));
    std::vector<int> full(12);
    std::iota(full.begin(), full.end(), 0);
    std::vector<int> slice(4);
    tp_extract(whole, tp_layout(proj, 3), 3, 2, full.data(), slice.data(), sizeof(int));
    EXPECT_EQ(slice, (std::vector<int>{4, 5, 10, 11}));
  }
}

TEST(TpLayout, ADegreeThatDoesNotDivideIsNamed) {
  const TpLayout qkv{TpSplit::kRows, {16, 8, 8}};
  EXPECT_EQ(tp_divides({32, 4}, qkv, 8), "");
  EXPECT_EQ(tp_divides({32, 4}, qkv, 3), "its rows' section 0 (16 rows) is not a multiple of 3");
  EXPECT_EQ(tp_divides({32, 4}, qkv, 16), "its rows' section 1 (8 rows) is not a multiple of 16");
  EXPECT_NE(tp_divides({30, 4}, qkv, 2).find("are not its 30 rows"), std::string::npos);
  EXPECT_EQ(tp_divides({4, 10}, TpLayout{TpSplit::kCols, {}}, 4),
            "its 10 columns are not a multiple of 4");
  EXPECT_EQ(tp_divides({7}, TpLayout{}, 3), "");  // replicated: any degree
  EXPECT_THROW(tp_slice_shape({4, 10}, TpLayout{TpSplit::kCols, {}}, 4), Error);
  std::vector<float> a(40), b(10);
  EXPECT_THROW(tp_extract({4, 10}, TpLayout{TpSplit::kCols, {}}, 4, 0, a.data(), b.data(), 4),
               Error);
  EXPECT_THROW(tp_extract({4, 10}, TpLayout{TpSplit::kCols, {}}, 2, 2, a.data(), b.data(), 4),
               Error);  // no rank 2 of 2
  // A spec whose sections are not its rows.
  EXPECT_THROW(tp_layout(spec({5, 2}, TpSplit::kRows, {2, 2}), 2), Error);
}

TEST(TpLayout, LayoutTextRoundTrips) {
  for (const TpLayout& l :
       {TpLayout{}, TpLayout{TpSplit::kCols, {}}, TpLayout{TpSplit::kRows, {512}},
        TpLayout{TpSplit::kRows, {64, 32, 32}}})
    EXPECT_EQ(parse_tp_layout(tp_layout_string(l)), l) << tp_layout_string(l);
  EXPECT_EQ(tp_layout_string(TpLayout{TpSplit::kRows, {64, 32, 32}}), "rows 64,32,32");
  for (const char* bad : {"", "rows", "rows ", "rows 1,,2", "rows -1", "columns", "rows 1,x"})
    EXPECT_THROW(parse_tp_layout(bad), Error) << bad;
}

}  // namespace
}  // namespace replay::train
