// latent_generate.h: synthetic latent files for the UNet (what replay-unet-data writes; the exact
// definition is in datasets/unet.md), and the default file a run generates on first use.
//
// The source has learnable structure tied to the text: each sample belongs to one of K classes,
// its caption names the class (one token is the class's word vector), and its latent mean is a
// fixed random linear function of the class (a smooth pattern of low-frequency cosines, different
// per class and channel) plus white Gaussian residual the text does not determine. After the
// 0.18215 scale the latent has mean square 1 (the class pattern class_share of it), so predicting v
// = 0 scores 1.0, while a denoiser that reads the class from the text can reach the file's loss
// floor, mean_t (1 - share) / (acp_t (1 - share) + 1 - acp_t): 0.645 at share 0.5.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "workloads/unet/latent_file.h"

namespace replay::unet {

struct LatentDatasetParams {
  int64_t num_samples = 1024;
  int64_t latent_channels = 4, latent_height = 64, latent_width = 64;
  int64_t context_len = 77, context_dim = 1024;
  int64_t num_classes = 16;
  double class_share = 0.5;  // of the scaled latent's mean square, in [0, 0.99]
  uint64_t seed = 1234;
  int64_t held_out_samples = -1;  // -1: default_held_out_samples(num_samples)
};

// Throws Error naming the parameter that is out of range.
void check_latent_dataset_params(const LatentDatasetParams& p);

// The synthetic source: its fixed parts (class patterns, word vectors) drawn from the seed at
// construction; every sample is then a pure function of (params, index), so samples can be made
// in any order, and a test can remake any sample of a file.
class LatentSource {
 public:
  explicit LatentSource(const LatentDatasetParams& params);

  const LatentDatasetParams& params() const { return params_; }
  // Sample i as the file stores it, IEEE fp16 bits: moments [2C, H, W], text [L, D]. Returns its
  // class.
  int64_t sample(int64_t i, uint16_t* moments, uint16_t* text) const;
  // The class pattern P_k [C, H, W] (mean square 1): the scaled latent's mean given class k is
  // sqrt(class_share) * P_k.
  const double* pattern(int64_t k) const;
  // The loss floor (the v-MSE of the best denoiser, see above) and one line saying what it is.
  double loss_floor() const;
  static const char* loss_floor_method();
  std::string description() const;

 private:
  LatentDatasetParams params_;
  double residual_scale_ = 0.0;       // sqrt of the residual's share of the mean square
  std::vector<double> patterns_;      // [K, C, H, W]
  std::vector<double> start_, end_;   // [D]: the start and end/padding tokens
  std::vector<double> class_words_;   // [K, D]
  std::vector<double> filler_words_;  // [kFillerWords, D]
};

// Called after each block of samples; returning false cancels the generation.
using LatentProgress = std::function<bool(int64_t done, int64_t total)>;

// Writes `path` (atomically: LatentFileWriter) and returns what it wrote, loss floor included. A
// cancel throws Error and leaves nothing behind.
LatentFileInfo generate_latent_dataset(const std::string& path, const LatentDatasetParams& params,
                                       const LatentProgress& progress = {});

// <dir>/latents-c<C>-h<H>-w<W>-l<L>-d<D>-n<N>-k<K>-s<share * 1000>-seed<S>.h5 in the data folder
// ($REPLAY_DATA_DIR, else <build>/data): every parameter in the name, so a file is never reused
// for other parameters.
std::string default_latent_dataset_path(const LatentDatasetParams& params, const std::string& dir);
std::string default_latent_dataset_path(const LatentDatasetParams& params);
// Returns default_latent_dataset_path(params, dir), generating the file first when it does not
// exist (a line on stdout before and after). Concurrent callers (ranks of a node) each write their
// own temporary file and rename it; the files are identical, so the last rename wins harmlessly.
std::string ensure_latent_dataset(const LatentDatasetParams& params, const std::string& dir);
std::string ensure_latent_dataset(const LatentDatasetParams& params);

}  // namespace replay::unet
