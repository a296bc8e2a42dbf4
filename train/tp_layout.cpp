// tp_layout.cpp: a tensor-parallel rank's slice of a whole tensor (tp_layout.h).
#include "train/tp_layout.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace replay::train {

namespace {

int64_t product(const std::vector<int64_t>& shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Calls fn(slice element, whole element, elements) for every contiguous run of rank `rank`'s
// slice, in slice order.
template <typename Fn>
void for_each_run(const std::vector<int64_t>& whole, const TpLayout& layout, int tp, int rank,
                  Fn&& fn) {
  const std::string why = tp_divides(whole, layout, tp);
  REPLAY_REQUIRE(why.empty(), "tensor parallel: degree " + std::to_string(tp) +
                                  " does not split the tensor: " + why);
  REPLAY_REQUIRE(rank >= 0 && rank < tp,
                 "tensor parallel: rank " + std::to_string(rank) + " of " + std::to_string(tp));
  switch (layout.split) {
    case TpSplit::kNone:
      fn(int64_t{0}, int64_t{0}, product(whole));
      return;
    case TpSplit::kRows: {
      const int64_t row = product(whole, 1);
      int64_t whole_row = 0, slice_row = 0;
      for (const int64_t s : layout.sections) {
        const int64_t rows = s / tp;
        fn(slice_row * row, (whole_row + rank * rows) * row, rows * row);
        whole_row += s;
        slice_row += rows;
      }
      return;
    }
    case TpSplit::kCols: {
      const int64_t cols = whole.back(), part = cols / tp, rows = product(whole) / cols;
      for (int64_t r = 0; r < rows; ++r) fn(r * part, r * cols + rank * part, part);
      return;
    }
  }
}

}  // namespace

std::vector<int64_t> tp_whole_shape(const ParamSpec& spec, int tp) {
  REPLAY_REQUIRE(tp >= 1 && !spec.shape.empty(), "tp_whole_shape: " + spec.name);
  std::vector<int64_t> shape = spec.shape;
  if (spec.tp_split == TpSplit::kRows) shape.front() *= tp;
  if (spec.tp_split == TpSplit::kCols) shape.back() *= tp;
  return shape;
}

TpLayout tp_layout(const ParamSpec& spec, int tp) {
  TpLayout layout;
  layout.split = spec.tp_split;
  if (spec.tp_split != TpSplit::kRows) return layout;
  int64_t rows = 0;
  for (const int64_t s : spec.tp_sections) {
    layout.sections.push_back(s * tp);
    rows += s;
  }
  if (spec.tp_sections.empty()) {
    layout.sections.push_back(spec.shape.front() * tp);
    rows = spec.shape.front();
  }
  REPLAY_REQUIRE(rows == spec.shape.front(), "tensor parallel: the sections of " + spec.name +
                                                 " do not add up to its " +
                                                 std::to_string(spec.shape.front()) + " rows");
  return layout;
}

std::string tp_divides(const std::vector<int64_t>& whole, const TpLayout& layout, int tp) {
  if (tp < 1) return "degree " + std::to_string(tp) + " is not positive";
  if (whole.empty() && layout.split != TpSplit::kNone) return "a scalar cannot be split";
  switch (layout.split) {
    case TpSplit::kNone:
      return "";
    case TpSplit::kRows: {
      int64_t rows = 0;
      for (size_t k = 0; k < layout.sections.size(); ++k) {
        const int64_t s = layout.sections[k];
        if (s <= 0) return "its rows' section " + std::to_string(k) + " is empty";
        if (s % tp != 0)
          return "its rows' section " + std::to_string(k) + " (" + std::to_string(s) +
                 " rows) is not a multiple of " + std::to_string(tp);
        rows += s;
      }
      if (layout.sections.empty() || rows != whole.front())
        return "its sections (" + tp_layout_string(layout) + ") are not its " +
               std::to_string(whole.front()) + " rows";
      return "";
    }
    case TpSplit::kCols:
      if (whole.back() % tp != 0)
        return "its " + std::to_string(whole.back()) + " columns are not a multiple of " +
               std::to_string(tp);
      return "";
  }
  return "an unknown layout";
}

std::vector<int64_t> tp_slice_shape(const std::vector<int64_t>& whole, const TpLayout& layout,
                                    int tp) {
  const std::string why = tp_divides(whole, layout, tp);
  REPLAY_REQUIRE(why.empty(), "tensor parallel: degree " + std::to_string(tp) +
                                  " does not split the tensor: " + why);
  std::vector<int64_t> shape = whole;
  if (layout.split == TpSplit::kRows) shape.front() /= tp;
  if (layout.split == TpSplit::kCols) shape.back() /= tp;
  return shape;
}

int64_t tp_slice_numel(const std::vector<int64_t>& whole, const TpLayout& layout, int tp) {
  return product(tp_slice_shape(whole, layout, tp));
}

void tp_extract(const std::vector<int64_t>& whole, const TpLayout& layout, int tp, int rank,
                const void* whole_data, void* slice, size_t element_bytes) {
  const auto* from = static_cast<const char*>(whole_data);
  auto* to = static_cast<char*>(slice);
  const auto e = static_cast<int64_t>(element_bytes);
  for_each_run(whole, layout, tp, rank, [&](int64_t s, int64_t w, int64_t n) {
    std::memcpy(to + s * e, from + w * e, static_cast<size_t>(n * e));
  });
}

void tp_insert(const std::vector<int64_t>& whole, const TpLayout& layout, int tp, int rank,
               const void* slice, void* whole_data, size_t element_bytes) {
  const auto* from = static_cast<const char*>(slice);
  auto* to = static_cast<char*>(whole_data);
  const auto e = static_cast<int64_t>(element_bytes);
  for_each_run(whole, layout, tp, rank, [&](int64_t s, int64_t w, int64_t n) {
    std::memcpy(to + w * e, from + s * e, static_cast<size_t>(n * e));
  });
}

std::string tp_layout_string(const TpLayout& layout) {
  switch (layout.split) {
    case TpSplit::kNone:
      return "none";
    case TpSplit::kCols:
      return "cols";
    case TpSplit::kRows: {
      std::string s = "rows ";
      for (size_t k = 0; k < layout.sections.size(); ++k)
        s += (k ? "," : "") + std::to_string(layout.sections[k]);
      return s;
    }
  }
  return "?";
}

TpLayout parse_tp_layout(const std::string& text) {
  TpLayout layout;
  if (text == "none") return layout;
  if (text == "cols") {
    layout.split = TpSplit::kCols;
    return layout;
  }
  REPLAY_REQUIRE(text.rfind("rows ", 0) == 0 && text.size() > 5,
                 "tensor parallel: '" + text + "' is not a layout (none, cols, rows N[,N...])");
  layout.split = TpSplit::kRows;
  size_t at = 5;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string n = text.substr(at, comma - at);
    REPLAY_REQUIRE(
        !n.empty() && n.size() < 19 && n.find_first_not_of("0123456789") == std::string::npos,
        "tensor parallel: '" + text + "' is not a layout (none, cols, rows N[,N...])");
    layout.sections.push_back(std::stoll(n));
    at = comma + 1;
  }
  return layout;
}

}  // namespace replay::train
