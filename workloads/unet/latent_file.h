// latent_file.h: the UNet's training data in HDF5 (the layout is datasets/unet.md): per sample the
// VAE's latent moments and the text encoder's output. A reader that validates a file against the
// model before any GPU work and reads batches into host (pinned or plain) buffers as fp16, and a
// writer that never leaves a half-written file under the final name.
//
// Layout (format "replay-latents", version 1), in short:
//   /moments          [N, 2C, H, W]  fp16 (or fp32)  channels 0 .. C-1 the mean, C .. 2C-1 the
//                                                   log-variance, NCHW as the VAE emits them
//   /text_embeddings  [N, L, D]      fp16 (or fp32)  the text encoder's output, token-major
//   root attributes   format, format_version, num_samples, latent_channels, latent_height,
//                     latent_width, context_len, context_dim; optional held_out_samples,
//                     scale_factor, seed, generator, vae, text_encoder, num_classes, class_share,
//                     loss_floor, loss_floor_method
// The held-out split is the file's last held_out_samples samples (min(64, N / 16) when the
// attribute is absent); training never reads them.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "common/data/h5.h"

namespace replay::unet {

inline constexpr const char* kLatentFormatName = "replay-latents";
inline constexpr int64_t kLatentFormatVersion = 1;
inline constexpr const char* kMomentsDataset = "moments";
inline constexpr const char* kTextDataset = "text_embeddings";

// What the model takes from its data. SD2: 4 x 64 x 64 latents (512 x 512 images), a 77 x 1024
// context (OpenCLIP ViT-H/14's width).
struct LatentDataShape {
  int64_t micro_batch = 1;
  int64_t latent_channels = 4;  // C
  int64_t latent_height = 64;   // H
  int64_t latent_width = 64;    // W
  int64_t context_len = 77;     // L
  int64_t context_dim = 1024;   // D

  int64_t moment_elements() const { return 2 * latent_channels * latent_height * latent_width; }
  int64_t text_elements() const { return context_len * context_dim; }
};

// The optional attributes: where the data came from, and for synthetic data its loss floor.
struct LatentProvenance {
  std::optional<uint64_t> seed;
  std::string generator;     // e.g. "replay-unet-data: 16 classes, class share 0.5, ..."
  std::string vae;           // e.g. "SD 2 VAE (kl-f8), MLPerf's precomputed moments"
  std::string text_encoder;  // e.g. "OpenCLIP ViT-H/14 laion2b_s32b_b79k, penultimate + ln_final"
  int64_t num_classes = 0;   // synthetic data: the classes the captions name
  double class_share = std::numeric_limits<double>::quiet_NaN();
  double loss_floor = std::numeric_limits<double>::quiet_NaN();  // the v-MSE no model can beat
  std::string loss_floor_method;
};

struct LatentFileInfo {
  std::string path;
  int64_t num_samples = 0;
  int64_t held_out_samples = 0;  // the last ones
  int64_t latent_channels = 0, latent_height = 0, latent_width = 0;
  int64_t context_len = 0, context_dim = 0;
  bool moments_fp32 = false;  // stored fp32 (read as fp16, rounded to nearest even)
  bool text_fp32 = false;
  double scale_factor = 0.18215;  // the VAE's; the file's attribute when it has one
  LatentProvenance provenance;

  int64_t training_samples() const { return num_samples - held_out_samples; }
};

// The held-out split of a file of n samples without a held_out_samples attribute: min(64, n / 16).
int64_t default_held_out_samples(int64_t n);

class LatentFile {
 public:
  // Opens `path` and validates it against `shape` (the checks, in order, are datasets/unet.md's):
  // missing file, not HDF5, not this format or version, a missing dataset, wrong rank or element
  // type, attributes missing or disagreeing with the datasets' shapes, a held-out split that leaves
  // nothing to train on, a scale factor other than SD's, latent or context dimensions other than
  // the model's, fewer training samples than one micro-batch. Each is an Error naming the file and
  // the problem. Needs no GPU.
  LatentFile(const std::string& path, const LatentDataShape& shape);

  const LatentFileInfo& info() const { return info_; }
  const LatentDataShape& shape() const { return shape_; }

  // Reads samples [first, first + count) into host memory (plain or pinned), as IEEE fp16 bits:
  // moments [count, 2C, H, W], text [count, L, D] (either may be null to skip it). fp32 files are
  // rounded to nearest even. Every value is checked: a NaN, an infinity or a value beyond fp16's
  // range is an Error naming the file, the dataset, the sample and the element.
  void read_samples(int64_t first, int64_t count, uint16_t* moments, uint16_t* text) const;
  // The samples listed (a shuffled batch): sample samples[i] into slot i; runs of consecutive
  // indices are read together.
  void read_batch(const int64_t* samples, int64_t count, uint16_t* moments, uint16_t* text) const;

 private:
  void read_dataset(hid_t dataset, bool fp32, int64_t per_sample, const char* name, int64_t first,
                    int64_t count, uint16_t* dst) const;

  LatentFileInfo info_;
  LatentDataShape shape_;
  data::H5Id file_;
  data::H5Id moments_;
  data::H5Id text_;
};

// The dimensions of a file to write.
struct LatentFileDims {
  int64_t num_samples = 0;
  int64_t latent_channels = 4, latent_height = 64, latent_width = 64;
  int64_t context_len = 77, context_dim = 1024;
  int64_t held_out_samples = -1;  // -1: default_held_out_samples(num_samples)
};

// Writes an fp16 latent file under a temporary name beside `path` (<path>.tmp.<pid>) and renames it
// to `path` in commit(); destroyed without commit() (an error, a cancel), it removes the temporary
// file. Each sample is its own chunk (64 KiB of moments, 154 KiB of text at SD's sizes; small
// samples share chunks of about 64 KiB), with a Fletcher32 checksum verified on every read.
class LatentFileWriter {
 public:
  LatentFileWriter(std::string path, const LatentFileDims& dims);
  ~LatentFileWriter();
  LatentFileWriter(const LatentFileWriter&) = delete;
  LatentFileWriter& operator=(const LatentFileWriter&) = delete;

  // Samples [first, first + count): moments [count, 2C, H, W], text [count, L, D], fp16 bits.
  void write_samples(int64_t first, int64_t count, const uint16_t* moments, const uint16_t* text);
  // Writes the attributes, closes the file and renames it to its final path.
  void commit(const LatentProvenance& provenance);

  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  LatentFileDims dims_;
  data::H5Id file_;
  data::H5Id moments_;
  data::H5Id text_;
  bool committed_ = false;
};

// The HDF5 type of IEEE fp16, little-endian (what numpy's float16 is in h5py). Owned by the caller.
data::H5Id make_fp16_type();

}  // namespace replay::unet
