// replay_data.cpp: replay-data, the generator of synthetic token files. A seeded random order-k
// Markov chain over the vocabulary, cut into sequences of seq_len + 1 tokens; its entropy rate, the
// loss floor a model can reach on the data, is printed and written into the file
// (datasets/gpt3.md).
#include <CLI/CLI.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "common/data/generate.h"

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int) {
  g_interrupted = 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace replay::data;
  CLI::App app{
      "replay-data: writes a token file (datasets/gpt3.md) from a seeded order-k Markov chain"};
  MarkovDatasetParams params;
  std::string out;
  app.add_option("--out", out, "output file (default: the file workloads generate without --data)");
  app.add_option("--vocab", params.vocab_size, "vocabulary size")
      ->required()
      ->check(CLI::Range(int64_t{2}, int64_t{std::numeric_limits<int32_t>::max()}));
  app.add_option("--seq-len", params.seq_len,
                 "model sequence length (rows hold seq_len + 1 tokens)")
      ->required()
      ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
  app.add_option("--sequences", params.num_sequences, "number of sequences (rows)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
  app.add_option("--seed", params.seed, "seed of the chain and of its run")->capture_default_str();
  app.add_option("--order", params.order, "Markov order k: the next token depends on the last k")
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2}));
  app.add_option("--branching", params.branching, "candidate next tokens per context")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  CLI11_PARSE(app, argc, argv);
  if (out.empty()) out = default_dataset_path(params);

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::printf("replay-data: out %s\n", out.c_str());
  std::printf(
      "replay-data: vocab %lld, seq_len %lld, sequences %lld, seed %llu, order %d, "
      "branching %d\n",
      static_cast<long long>(params.vocab_size), static_cast<long long>(params.seq_len),
      static_cast<long long>(params.num_sequences), static_cast<unsigned long long>(params.seed),
      params.order, params.branching);
  std::fflush(stdout);

  const auto start = std::chrono::steady_clock::now();
  auto writing_start = start, last_print = start;
  const double row_mb = static_cast<double>(params.seq_len + 1) * 4 / 1e6;
  auto progress = [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_print >= std::chrono::seconds(1) || done == total) {
      const double s = std::chrono::duration<double>(now - writing_start).count();
      std::printf("  %lld / %lld sequences (%.0f%%), %.1f MB, %.1f MB/s\n",
                  static_cast<long long>(done), static_cast<long long>(total), 100.0 * done / total,
                  done * row_mb, s > 0 ? done * row_mb / s : 0.0);
      std::fflush(stdout);
      last_print = now;
    }
    return g_interrupted == 0;
  };
  auto print_rate = [&](const Provenance& p) {
    std::printf("replay-data: entropy rate (loss floor) %.6f nats/token; %s\n", p.entropy_rate,
                p.entropy_rate_method.c_str());
    std::fflush(stdout);
    writing_start = last_print = std::chrono::steady_clock::now();
  };
  try {
    const TokenFileInfo info = generate_markov_dataset(out, params, print_rate, progress);
    // Read the file back through the reader's validation, as a workload would.
    const TokenFile check(out, {1, params.seq_len, params.vocab_size});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("replay-data: wrote %s (%.1f MB) in %.1f s\n", out.c_str(),
                static_cast<double>(std::filesystem::file_size(out)) / 1e6, seconds);
    std::printf("replay-data: loss floor %.6f nats/token (this file's positions: %.6f)\n",
                info.provenance.entropy_rate, info.provenance.sample_entropy);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replay-data: %s\n", e.what());
    return g_interrupted ? 130 : 1;
  }
}
