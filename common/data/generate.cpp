// generate.cpp: Markov-chain token files and the default dataset cache.
#include "common/data/generate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "common/data/markov.h"

namespace replay::data {

TokenFileInfo generate_markov_dataset(const std::string& path, const MarkovDatasetParams& params,
                                      const std::function<void(const Provenance&)>& on_rate,
                                      const GenerateProgress& progress) {
  REPLAY_REQUIRE(params.seq_len > 0 && params.num_sequences > 0,
                 "sequence length and sequence count must be positive");
  const MarkovChain chain({params.vocab_size, params.order, params.branching, params.seed});
  TokenFileInfo info{path, params.vocab_size, params.seq_len, params.num_sequences, {}};
  Provenance& p = info.provenance;
  p.seed = params.seed;
  p.generator = "replay-data: " + chain.description();
  const MarkovChain::EntropyRate rate = chain.entropy_rate();
  p.entropy_rate = rate.nats_per_token;
  p.entropy_rate_method = rate.method;
  if (on_rate) on_rate(p);

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  TokenFileWriter writer(path, params.vocab_size, params.seq_len, params.num_sequences);
  const int64_t row = params.seq_len + 1;
  const int64_t block_rows = std::max<int64_t>(1, (int64_t{4} << 20) / (row * 4));  // ~4 MiB writes
  std::vector<int32_t> block(static_cast<size_t>(std::min(block_rows, params.num_sequences) * row));
  MarkovRun run(chain);
  // The file's own floor: conditional entropies at the positions a model predicts (1..seq_len).
  double entropy_sum = 0;
  for (int64_t first = 0; first < params.num_sequences; first += block_rows) {
    const int64_t count = std::min(block_rows, params.num_sequences - first);
    for (int64_t i = 0; i < count * row; ++i)
      block[i] = run.next(i % row == 0 ? nullptr : &entropy_sum);
    writer.write_rows(first, count, block.data());
    if (progress && !progress(first + count, params.num_sequences))
      throw_error("replay", "cancelled", "generate_markov_dataset", __FILE__, __LINE__,
                  "'" + path + "' was not written");
  }
  p.sample_entropy = entropy_sum / static_cast<double>(params.num_sequences * params.seq_len);
  writer.commit(p);
  return info;
}

std::string default_data_dir() {
  const char* env = std::getenv("REPLAY_DATA_DIR");
  return env && *env ? env : REPLAY_DEFAULT_DATA_DIR;
}

std::string default_dataset_path(const MarkovDatasetParams& params, const std::string& dir) {
  return dir + "/markov-v" + std::to_string(params.vocab_size) + "-s" +
         std::to_string(params.seq_len) + "-n" + std::to_string(params.num_sequences) + "-o" +
         std::to_string(params.order) + "-b" + std::to_string(params.branching) + "-seed" +
         std::to_string(params.seed) + ".h5";
}

std::string ensure_dataset(const MarkovDatasetParams& params, const std::string& dir) {
  const std::string path = default_dataset_path(params, dir);
  if (std::filesystem::exists(path)) return path;
  std::printf("replay: no --data given and no default dataset yet: generating %s\n", path.c_str());
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  const TokenFileInfo info = generate_markov_dataset(path, params);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replay: wrote %s in %.1f s; loss floor %.6f nats/token (%s)\n", path.c_str(),
              seconds, info.provenance.entropy_rate, info.provenance.entropy_rate_method.c_str());
  std::fflush(stdout);
  return path;
}

}  // namespace replay::data
