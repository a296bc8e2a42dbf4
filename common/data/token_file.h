// token_file.h: replay's HDF5 file of tokenized sequences (the layout is datasets/gpt3.md): a
// reader that validates a file against the model before any GPU work, and a writer that never
// leaves a half-written file under the final name.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "common/data/h5.h"

namespace replay::data {

inline constexpr const char* kFormatName = "replay-tokens";
inline constexpr int64_t kFormatVersion = 1;
inline constexpr const char* kTokensDataset =
    "tokens";  // /tokens: [num_sequences, seq_len + 1] int32

// What the model takes from its data.
struct BatchShape {
  int64_t micro_batch = 1;  // sequences per batch
  int64_t seq_len = 0;      // the model's sequence length; a row holds seq_len + 1 tokens
  int64_t vocab_size = 0;   // the model's (possibly padded) vocabulary: every id must be below it
};

// The optional attributes: where the tokens came from, and the loss floor when it is known.
struct Provenance {
  std::optional<uint64_t> seed;
  std::string generator;  // e.g. "markov order-2, branching 4, Dirichlet(1) weights"
  double entropy_rate = std::numeric_limits<double>::quiet_NaN();  // nats/token, NaN if unknown
  std::string entropy_rate_method;
  double sample_entropy = std::numeric_limits<double>::quiet_NaN();  // this file's own floor
};

struct TokenFileInfo {
  std::string path;
  int64_t vocab_size = 0;  // the data's vocabulary (the tokenizer's), at most the model's
  int64_t seq_len = 0;
  int64_t num_sequences = 0;
  Provenance provenance;
};

class TokenFile {
 public:
  // Opens `path` and validates it against `shape`: missing file, not HDF5, not this format, no
  // /tokens dataset, wrong rank or type, attributes that disagree with the dataset, a sequence
  // length other than the model's, a vocabulary larger than the model's, fewer sequences than one
  // batch. Each is an Error naming the file and the problem. Needs no GPU.
  TokenFile(const std::string& path, const BatchShape& shape);

  const TokenFileInfo& info() const { return info_; }
  const BatchShape& shape() const { return shape_; }
  int64_t row_tokens() const { return info_.seq_len + 1; }

  // Reads rows [first, first + count) into dst (count x (seq_len + 1) int32, row-major) and checks
  // every id against the model's vocabulary: an id outside it is an Error naming the file and row.
  void read_rows(int64_t first, int64_t count, int32_t* dst) const;

 private:
  TokenFileInfo info_;
  BatchShape shape_;
  H5Id file_;
  H5Id tokens_;
};

// Writes a token file under a temporary name beside `path` (unique per process) and renames it to
// `path` in commit(); destroyed without commit() (an error, a cancel), it removes the temporary
// file.
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, int64_t vocab_size, int64_t seq_len, int64_t num_sequences);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // Rows [first, first + count), count x (seq_len + 1) tokens.
  void write_rows(int64_t first, int64_t count, const int32_t* tokens);
  // Writes the attributes, closes the file and renames it to its final path.
  void commit(const Provenance& provenance);

  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  int64_t vocab_size_, seq_len_, num_sequences_;
  H5Id file_;
  H5Id tokens_;
  bool committed_ = false;
};

}  // namespace replay::data
