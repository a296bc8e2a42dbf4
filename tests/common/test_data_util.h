// test_data_util.h: helpers shared by the data tests: a scratch folder, a file whose every token
// names its row and position, and the batch a stream must deliver.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/data/batch_stream.h"
#include "common/data/token_file.h"

namespace replay::test {

// A fresh folder under the system temp directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("replay_data_test_" + std::to_string(getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::filesystem::path path() const { return path_; }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

// Token (row r, position p) = r * (seq_len + 1) + p: any delivered batch shows which rows it holds.
inline int64_t indexed_vocab(int64_t rows, int64_t seq_len) {
  return rows * (seq_len + 1);
}
inline void write_indexed_file(const std::string& path, int64_t rows, int64_t seq_len) {
  std::vector<int32_t> tokens(static_cast<size_t>(rows * (seq_len + 1)));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i);
  data::TokenFileWriter writer(path, indexed_vocab(rows, seq_len), seq_len, rows);
  writer.write_rows(0, rows, tokens.data());
  writer.commit({});
}

// What next() must deliver for global batch `index`: inputs and targets, [micro_batch, seq_len]
// each, read through a second reader of the same file.
struct ExpectedBatch {
  std::vector<int32_t> tokens, targets;
};
inline ExpectedBatch expected_batch(const data::TokenFile& file, data::BatchOrder& order,
                                    int64_t index) {
  const int64_t mb = file.shape().micro_batch, t = file.info().seq_len;
  std::vector<int64_t> rows(static_cast<size_t>(mb));
  order.rows(index, rows.data());
  ExpectedBatch e{std::vector<int32_t>(mb * t), std::vector<int32_t>(mb * t)};
  std::vector<int32_t> row(static_cast<size_t>(t + 1));
  for (int64_t r = 0; r < mb; ++r) {
    file.read_rows(rows[r], 1, row.data());
    for (int64_t p = 0; p < t; ++p) {
      e.tokens[r * t + p] = row[p];
      e.targets[r * t + p] = row[p + 1];
    }
  }
  return e;
}

}  // namespace replay::test
