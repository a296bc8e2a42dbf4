// generate.h: synthetic token files from a seeded Markov chain (what replay-data writes), and the
// default file a workload generates on first use when it is run without --data.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/data/token_file.h"

namespace replay::data {

struct MarkovDatasetParams {
  int64_t vocab_size = 0;
  int64_t seq_len = 0;
  int64_t num_sequences = 1024;
  uint64_t seed = 1234;
  int order = 2;
  int branching = 4;
};

// Called after each block of rows; returning false cancels the generation.
using GenerateProgress = std::function<bool(int64_t rows_done, int64_t rows_total)>;

// Writes `path` (atomically: see TokenFileWriter) with the chain's run cut into consecutive
// sequences of seq_len + 1 tokens, and returns what it wrote, entropy rate included. Computing the
// entropy rate comes first, so `on_rate` can print the loss floor before the long part starts.
// A cancel throws Error and leaves nothing behind.
TokenFileInfo generate_markov_dataset(const std::string& path, const MarkovDatasetParams& params,
                                      const std::function<void(const Provenance&)>& on_rate = {},
                                      const GenerateProgress& progress = {});

// The folder for generated files: $REPLAY_DATA_DIR when set, else <build>/data.
std::string default_data_dir();
// <dir>/markov-v<vocab>-s<seq_len>-n<sequences>-o<order>-b<branching>-seed<seed>.h5: every
// parameter is in the name, so a file is never reused for other parameters.
std::string default_dataset_path(const MarkovDatasetParams& params,
                                 const std::string& dir = default_data_dir());
// Returns default_dataset_path(params, dir), generating the file first when it does not exist (with
// a line on stdout before and after). Concurrent callers (ranks of one node) each write their own
// temporary file and rename it; the files are identical, so the last rename wins harmlessly.
std::string ensure_dataset(const MarkovDatasetParams& params,
                           const std::string& dir = default_data_dir());

}  // namespace replay::data
