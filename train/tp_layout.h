// tp_layout.h: where one tensor-parallel rank's slice of a parameter sits in the whole tensor, as
// host functions (no GPU, no MPI): the whole shape and layout of a rank's ParamSpec, whether a
// degree divides a whole tensor, and the copies between a whole tensor and a rank's slice. A
// checkpoint holds whole tensors (train/checkpoint.h): a save puts the ranks' slices together with
// tp_insert, a load at any degree that divides the shapes cuts each rank's slice out with
// tp_extract (train/host_group.h moves them between the ranks).
//
// Layouts (train/params.h TpSplit), for a whole tensor of R rows of K elements each:
//   kNone  every rank holds the whole tensor (replicated: norms, row-parallel biases, positions);
//   kRows  the rows come in sections (one; q, k, v of a fused QKV weight; gate and up of SwiGLU's
//          fc1): rank r holds rows [r x S/T, (r + 1) x S/T) of every section of S rows, the slices
//          of the sections one after the other;
//   kCols  rank r holds columns [r x C/T, (r + 1) x C/T) of every row, C the last dimension.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "train/params.h"

namespace replay::train {

// How the ranks of a tensor-parallel group split one whole tensor.
struct TpLayout {
  TpSplit split = TpSplit::kNone;
  std::vector<int64_t> sections;  // kRows: the whole tensor's rows per section (their sum: dim 0)
  bool operator==(const TpLayout& o) const { return split == o.split && sections == o.sections; }
  bool operator!=(const TpLayout& o) const { return !(*this == o); }
};

// A rank's ParamSpec (its slice's shape, its tp_split and tp_sections) at degree `tp`: the whole
// tensor's shape and layout. A spec without a tp_split is whole already (kNone). Throws Error when
// the sections do not add up to the spec's rows.
std::vector<int64_t> tp_whole_shape(const ParamSpec& spec, int tp);
TpLayout tp_layout(const ParamSpec& spec, int tp);

// "" when degree `tp` cuts a whole tensor of `whole` shape and `layout` into equal slices;
// otherwise why not ("its rows' section 2 (24 rows) is not a multiple of 5"), for a message.
std::string tp_divides(const std::vector<int64_t>& whole, const TpLayout& layout, int tp);
// Each rank's slice shape (throws Error when tp_divides says no).
std::vector<int64_t> tp_slice_shape(const std::vector<int64_t>& whole, const TpLayout& layout,
                                    int tp);
int64_t tp_slice_numel(const std::vector<int64_t>& whole, const TpLayout& layout, int tp);

// Rank `rank`'s slice (tp_slice_numel elements of `element_bytes` each) out of the whole tensor,
// and back into it. kNone copies the whole tensor.
void tp_extract(const std::vector<int64_t>& whole, const TpLayout& layout, int tp, int rank,
                const void* whole_data, void* slice, size_t element_bytes);
void tp_insert(const std::vector<int64_t>& whole, const TpLayout& layout, int tp, int rank,
               const void* slice, void* whole_data, size_t element_bytes);

// The layout as text for a checkpoint's metadata: "none", "cols", "rows 512" or "rows 64,32,32"
// (the whole tensor's sections); parse_tp_layout reads it back (throws Error on anything else).
std::string tp_layout_string(const TpLayout& layout);
TpLayout parse_tp_layout(const std::string& text);

}  // namespace replay::train
