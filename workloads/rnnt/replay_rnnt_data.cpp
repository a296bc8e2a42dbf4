// replay_rnnt_data.cpp: replay-rnnt-data, the generator of synthetic RNN-T speech files
// (datasets/rnnt.md). Utterance lengths follow LibriSpeech's spread, transcripts are a learnable
// function of the features; it writes the file atomically, reads it back through the reader, and
// prints the length statistics, the nearest-embedding decoder's error rate on held-out utterances
// (the data's floor), and, with --ladder, the rungs and their padding for one epoch of batches.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/speech_batches.h"
#include "workloads/rnnt/speech_generate.h"
#include "workloads/rnnt/wer.h"

namespace {

using namespace replay::rnnt;

volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int) {
  g_interrupted = 1;
}

void print_lengths(const char* what, const std::vector<int32_t>& lengths, double frame_ms) {
  const LengthStats s = length_stats(lengths.data(), static_cast<int64_t>(lengths.size()));
  std::printf(
      "  %-7s min %4lld  p10 %4lld  median %4lld  mean %7.2f  p90 %4lld  p99 %4lld  max %4lld",
      what, static_cast<long long>(s.min), static_cast<long long>(s.p10),
      static_cast<long long>(s.p50), s.mean, static_cast<long long>(s.p90),
      static_cast<long long>(s.p99), static_cast<long long>(s.max));
  if (frame_ms > 0)
    std::printf("  (%.2f to %.2f s, mean %.2f s)", s.min * frame_ms / 1e3, s.max * frame_ms / 1e3,
                s.mean * frame_ms / 1e3);
  std::printf("\n");
}

// The rungs of the three schemes over the training split, and what one epoch of batches pays on
// each.
void print_ladder(const std::vector<int32_t>& frames, const std::vector<int32_t>& labels,
                  int64_t num_train, int rungs, int64_t batch, int buckets, uint64_t seed) {
  const int64_t n = static_cast<int64_t>(frames.size());
  int32_t cover_t = 0, cover_u = 0;  // the held-out split must fit the top rung too
  for (int64_t i = num_train; i < n; ++i) {
    cover_t = std::max(cover_t, frames[i]);
    cover_u = std::max(cover_u, labels[i]);
  }
  SamplerOptions so;
  so.batch_size = batch;
  so.num_buckets = buckets;
  so.seed = seed;
  SpeechSampler sampler(frames, 0, num_train, so);
  const std::vector<BatchLengths> epoch = epoch_batches(sampler, 0, frames, labels);
  std::printf(
      "replay-rnnt-data: one epoch of the training split in batches of %lld "
      "(%d length buckets): %lld batches\n",
      static_cast<long long>(batch), buckets, static_cast<long long>(sampler.batches_per_epoch()));
  std::printf("  exact shapes:  %s\n", exact_padding(epoch).describe().c_str());
  LadderOptions lo;
  lo.rungs = rungs;
  lo.cover_frames = cover_t;
  lo.cover_labels = cover_u;
  const Ladder fitted = Ladder::fit_to_batches(epoch, lo);
  std::printf("  fitted to the epoch's batches, %s\n    %s\n", fitted.describe().c_str(),
              ladder_padding(fitted, epoch).describe().c_str());
  for (LadderScheme scheme : {LadderScheme::kQuantile, LadderScheme::kEqualWidth}) {
    lo.scheme = scheme;
    const Ladder ladder = Ladder::from_lengths(frames.data(), labels.data(), num_train, lo);
    std::printf("  %s, %s\n    %s\n",
                scheme == LadderScheme::kQuantile ? "quantiles of the lengths" : "equal widths",
                ladder.describe().c_str(), ladder_padding(ladder, epoch).describe().c_str());
  }
}

// --check: validates an existing file as the workload would (the MLPerf model's feature size and
// vocabulary unless given), reads every utterance's features (values and checksums), and prints
// the same statistics.
int check_file(const std::string& path, int64_t feature_dim, int64_t vocab, int ladder,
               int64_t batch, int buckets, uint64_t seed) {
  const SpeechFile file(path, {feature_dim, vocab, 0, 0});
  const SpeechFileInfo& info = file.info();
  std::printf(
      "replay-rnnt-data: %s: %lld utterances (%lld held out), %lld frames of %lld %s "
      "features, %lld labels below %lld\n",
      path.c_str(), static_cast<long long>(info.num_utterances),
      static_cast<long long>(info.num_eval), static_cast<long long>(info.total_frames),
      static_cast<long long>(info.feature_dim), feature_type_name(info.stored),
      static_cast<long long>(info.total_labels), static_cast<long long>(info.vocab_size));
  if (!info.provenance.generator.empty())
    std::printf("replay-rnnt-data: generator: %s\n", info.provenance.generator.c_str());
  std::fflush(stdout);
  std::vector<float> features;
  auto last_print = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < file.size() && g_interrupted == 0; ++i) {
    features.resize(static_cast<size_t>(file.frame_length(i) * info.feature_dim));
    file.read_features(i, FeatureType::kFP32, features.data());
    const auto now = std::chrono::steady_clock::now();
    if (now - last_print >= std::chrono::seconds(1)) {
      std::printf("  %lld / %lld utterances read\n", static_cast<long long>(i + 1),
                  static_cast<long long>(file.size()));
      std::fflush(stdout);
      last_print = now;
    }
  }
  if (g_interrupted) return 130;
  std::printf("replay-rnnt-data: every utterance reads back finite\n");
  const double frame_ms = std::isnan(info.provenance.frame_ms) ? 30.0 : info.provenance.frame_ms;
  print_lengths("frames", file.frame_lengths(), frame_ms);
  print_lengths("labels", file.label_lengths(), 0.0);
  if (ladder > 0)
    print_ladder(file.frame_lengths(), file.label_lengths(), info.num_train(), ladder, batch,
                 buckets, seed);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"replay-rnnt-data: writes a synthetic RNN-T speech file (datasets/rnnt.md)"};
  SpeechDatasetParams p;
  std::string out, dtype = "fp16", check;
  std::pair<double, double> shape{p.length_alpha, p.length_beta};
  bool lengths_only = false;
  int ladder = 0, buckets = 6;
  int64_t batch = 192, oracle = 16;
  app.add_option("--out", out,
                 "output file (default: the file the workload generates without --data)");
  app.add_option("--utterances", p.num_utterances, "utterances in the file, both splits")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{std::numeric_limits<int32_t>::max()}));
  app.add_option("--eval", p.num_eval, "held-out utterances (the last ones)")
      ->capture_default_str();
  app.add_option("--vocab", p.vocab_size, "label ids, blank excluded")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{std::numeric_limits<int32_t>::max() - 1}));
  app.add_option("--feature-dim", p.feature_dim, "features per frame")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--min-frames", p.min_frames, "shortest utterance, frames of 30 ms")
      ->capture_default_str();
  app.add_option("--max-frames", p.max_frames, "longest utterance, frames of 30 ms")
      ->capture_default_str();
  app.add_option("--length-shape", shape, "Beta(a, b) of the lengths between min and max")
      ->capture_default_str();
  app.add_option("--max-labels", p.max_labels, "longest transcript")->capture_default_str();
  app.add_option("--label-rate", p.token_rate, "median labels per frame")->capture_default_str();
  app.add_option("--label-rate-sigma", p.token_rate_sigma,
                 "log-normal spread of an utterance's label rate")
      ->capture_default_str();
  app.add_option("--noise", p.noise, "feature noise (embeddings are N(0, 1))")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "stored feature type")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp16", "fp32"}));
  app.add_option("--seed", p.seed, "seed of the embeddings, lengths, transcripts and noise")
      ->capture_default_str();
  app.add_flag("--lengths-only", lengths_only,
               "draw the lengths and print their statistics (and --ladder's), write nothing");
  app.add_option("--ladder", ladder, "also print N rungs and their padding over one epoch")
      ->check(CLI::Range(0, 64));
  app.add_option("--batch", batch, "batch size for --ladder")->capture_default_str();
  app.add_option("--buckets", buckets, "length buckets of the sampler for --ladder")
      ->capture_default_str();
  app.add_option("--oracle", oracle, "held-out utterances the nearest-embedding decoder scores")
      ->capture_default_str();
  app.add_option("--check", check,
                 "validate FILE instead of writing one: every check of the reader against "
                 "--feature-dim and --vocab, every feature value; then the statistics");
  CLI11_PARSE(app, argc, argv);
  p.length_alpha = shape.first;
  p.length_beta = shape.second;
  p.stored = dtype == "fp32" ? FeatureType::kFP32 : FeatureType::kFP16;

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  try {
    if (!check.empty())
      return check_file(check, p.feature_dim, p.vocab_size, ladder, batch, buckets, p.seed);
    const SpeechSource source(p);
    if (out.empty()) out = default_speech_dataset_path(p);
    std::printf("replay-rnnt-data: %s\n", source.description().c_str());
    std::printf(
        "replay-rnnt-data: %lld utterances (%lld held out), feature_dim %lld, vocab %lld, "
        "%s, seed %llu\n",
        static_cast<long long>(p.num_utterances), static_cast<long long>(p.num_eval),
        static_cast<long long>(p.feature_dim), static_cast<long long>(p.vocab_size), dtype.c_str(),
        static_cast<unsigned long long>(p.seed));
    std::fflush(stdout);

    std::vector<int32_t> frames, labels;
    if (lengths_only) {
      for (int64_t i = 0; i < p.num_utterances; ++i) {
        const UtteranceLayout l = source.layout(i);
        frames.push_back(l.frames);
        labels.push_back(static_cast<int32_t>(l.tokens.size()));
      }
    } else {
      const auto start = std::chrono::steady_clock::now();
      auto last_print = start;
      auto progress = [&](int64_t done, int64_t total) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last_print >= std::chrono::seconds(1) || done == total) {
          std::printf("  %lld / %lld utterances (%.0f%%)\n", static_cast<long long>(done),
                      static_cast<long long>(total), 100.0 * done / total);
          std::fflush(stdout);
          last_print = now;
        }
        return g_interrupted == 0;
      };
      std::printf("replay-rnnt-data: out %s\n", out.c_str());
      generate_speech_dataset(out, p, progress);
      // Read the file back through the reader's validation, as the workload would.
      const SpeechFile file(out, {p.feature_dim, p.vocab_size, 0, 0});
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("replay-rnnt-data: wrote %s (%.1f MB, %lld frames, %lld labels) in %.1f s\n",
                  out.c_str(), static_cast<double>(std::filesystem::file_size(out)) / 1e6,
                  static_cast<long long>(file.info().total_frames),
                  static_cast<long long>(file.info().total_labels), seconds);
      frames = file.frame_lengths();
      labels = file.label_lengths();
      // The data's floor: what the decoder that knows the embeddings scores on held-out data.
      const int64_t scored = std::min(oracle, file.info().num_eval);
      if (scored > 0) {
        ErrorRate er;
        std::vector<float> features;
        for (int64_t i = file.info().num_train(); i < file.info().num_train() + scored; ++i) {
          features.resize(static_cast<size_t>(file.frame_length(i) * p.feature_dim));
          file.read_features(i, FeatureType::kFP32, features.data());
          const std::vector<int32_t> hyp =
              source.oracle_decode(features.data(), file.frame_length(i));
          er.add(hyp.data(), static_cast<int64_t>(hyp.size()), file.labels(i),
                 file.label_length(i));
        }
        std::printf(
            "replay-rnnt-data: nearest-embedding decoder on %lld held-out utterances: "
            "error rate %.5f (%lld of %lld labels)\n",
            static_cast<long long>(scored), er.rate(), static_cast<long long>(er.errors),
            static_cast<long long>(er.reference));
      }
    }
    std::printf("replay-rnnt-data: lengths over both splits\n");
    print_lengths("frames", frames, 30.0);
    print_lengths("labels", labels, 0.0);
    if (ladder > 0)
      print_ladder(frames, labels, p.num_utterances - p.num_eval, ladder, batch, buckets, p.seed);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replay-rnnt-data: %s\n", e.what());
    return g_interrupted ? 130 : 1;
  }
}
