// replay_unet_data.cpp: replay-unet-data, the generator of synthetic latent files for the UNet
// (datasets/unet.md): per sample the VAE moments and a caption's text embedding, with the latent's
// mean a fixed random function of a class the caption names. The loss floor a denoiser can reach on
// the data is printed and written into the file.
#include <CLI/CLI.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "workloads/unet/latent_generate.h"

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int) {
  g_interrupted = 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace replay::unet;
  CLI::App app{
      "replay-unet-data: writes a latent file (datasets/unet.md) of synthetic VAE moments and text "
      "embeddings"};
  LatentDatasetParams params;
  std::string out;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  app.add_option("--out", out, "output file (default: the file a run generates without --data)");
  app.add_option("--samples", params.num_samples, "number of samples")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--seed", params.seed, "seed of the source")->capture_default_str();
  app.add_option("--classes", params.num_classes, "classes the captions name")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  app.add_option("--class-share", params.class_share,
                 "share of the scaled latent's mean square the class explains")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--latent-channels", params.latent_channels, "latent channels C")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  app.add_option("--latent-height", params.latent_height, "latent height H")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--latent-width", params.latent_width, "latent width W")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--context-len", params.context_len, "text tokens L")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{3}, int64_t{4096}));
  app.add_option("--context-dim", params.context_dim, "text embedding width D")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{65536}));
  app.add_option("--held-out", params.held_out_samples,
                 "held-out samples at the end of the file (-1: min(64, samples / 16))")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{-1}, kMax));
  CLI11_PARSE(app, argc, argv);

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  try {
    check_latent_dataset_params(params);
    if (out.empty()) out = default_latent_dataset_path(params);
    std::printf("replay-unet-data: out %s\n", out.c_str());
    std::printf(
        "replay-unet-data: samples %lld, latents %lld x %lld x %lld, context %lld x %lld, "
        "classes %lld, class share %g, seed %llu\n",
        static_cast<long long>(params.num_samples), static_cast<long long>(params.latent_channels),
        static_cast<long long>(params.latent_height), static_cast<long long>(params.latent_width),
        static_cast<long long>(params.context_len), static_cast<long long>(params.context_dim),
        static_cast<long long>(params.num_classes), params.class_share,
        static_cast<unsigned long long>(params.seed));
    std::printf("replay-unet-data: loss floor %.6f (v-MSE; predicting v = 0 scores 1.0)\n",
                LatentSource(params).loss_floor());
    std::fflush(stdout);

    const auto start = std::chrono::steady_clock::now();
    auto last_print = start;
    const double sample_mb = 2.0 *
                             static_cast<double>(2 * params.latent_channels * params.latent_height *
                                                     params.latent_width +
                                                 params.context_len * params.context_dim) /
                             1e6;
    auto progress = [&](int64_t done, int64_t total) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_print >= std::chrono::seconds(1) || done == total) {
        const double s = std::chrono::duration<double>(now - start).count();
        std::printf("  %lld / %lld samples (%.0f%%), %.1f MB, %.1f MB/s\n",
                    static_cast<long long>(done), static_cast<long long>(total),
                    100.0 * static_cast<double>(done) / static_cast<double>(total),
                    static_cast<double>(done) * sample_mb,
                    s > 0 ? static_cast<double>(done) * sample_mb / s : 0.0);
        std::fflush(stdout);
        last_print = now;
      }
      return g_interrupted == 0;
    };
    const LatentFileInfo info = generate_latent_dataset(out, params, progress);
    // Read the file back through the reader's validation, as a run would.
    LatentDataShape shape;
    shape.latent_channels = params.latent_channels;
    shape.latent_height = params.latent_height;
    shape.latent_width = params.latent_width;
    shape.context_len = params.context_len;
    shape.context_dim = params.context_dim;
    const LatentFile check(out, shape);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf(
        "replay-unet-data: wrote %s (%.1f MB) in %.1f s: %lld training and %lld held-out "
        "samples\n",
        out.c_str(), static_cast<double>(std::filesystem::file_size(out)) / 1e6, seconds,
        static_cast<long long>(check.info().training_samples()),
        static_cast<long long>(check.info().held_out_samples));
    std::printf("replay-unet-data: loss floor %.6f (%s)\n", info.provenance.loss_floor,
                info.provenance.loss_floor_method.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replay-unet-data: %s\n", e.what());
    return g_interrupted ? 130 : 1;
  }
}
