// wer.cpp: edit distance by the usual dynamic programme, one row at a time.
#include "workloads/rnnt/wer.h"

#include <algorithm>
#include <numeric>

namespace replay::rnnt {

int64_t edit_distance(const int32_t* hyp, int64_t n, const int32_t* ref, int64_t m) {
  // row[j]: the distance between hyp[0, i) and ref[0, j), for the current i.
  std::vector<int64_t> row(static_cast<size_t>(m + 1));
  std::iota(row.begin(), row.end(), int64_t{0});
  for (int64_t i = 1; i <= n; ++i) {
    int64_t diagonal = row[0];  // distance(hyp[0, i-1), ref[0, j-1))
    row[0] = i;
    for (int64_t j = 1; j <= m; ++j) {
      const int64_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (hyp[i - 1] != ref[j - 1])});
      diagonal = above;
    }
  }
  return row[m];
}

void ErrorRate::add(const int32_t* hyp, int64_t n, const int32_t* ref, int64_t m) {
  errors += edit_distance(hyp, n, ref, m);
  reference += m;
}

}  // namespace replay::rnnt
