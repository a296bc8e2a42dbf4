// latent_generate.cpp: the synthetic latent source and its files (the definition is
// datasets/unet.md's "The synthetic source"; change one only with the other).
#include "workloads/unet/latent_generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "common/data/generate.h"
#include "common/data/splitmix.h"
#include "workloads/unet/diffusion.h"
#include "workloads/unet/diffusion_reference.h"
#include "workloads/unet/fp16_bits.h"

namespace replay::unet {

namespace {

using data::mix64;
using data::splitmix;

constexpr int64_t kFillerWords = 512;
constexpr int64_t kCaptionMin = 4, kCaptionMax = 16;  // caption words, class word included
constexpr double kTokenNoise = 0.1;                   // per-token noise before the LayerNorm
constexpr double kLayerNormEps = 1e-5;
constexpr double kLogvarMean = -5.8;  // unscaled: a posterior std of about 0.055, 0.01 scaled
constexpr double kLogvarStd = 0.25;
constexpr int kModes = 3;  // cosine frequencies 0, 1, 2 along each axis: 9 modes per channel
constexpr double kPi = 3.14159265358979323846;

// Stream salts (arbitrary odd constants: SHA-512's initial values).
constexpr uint64_t kFixedSalt = 0x510E527FADE682D1ull;
constexpr uint64_t kSampleSalt = 0x9B05688C2B3E6C1Full;

// Standard normals from splitmix64: Box-Muller of two draws, the pair handed out in turn.
class Normals {
 public:
  explicit Normals(uint64_t state) : state_(state) {}
  uint64_t bits() { return splitmix(state_); }
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = unit(bits()), u2 = unit(bits());
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * kPi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * kPi * u2);
  }

 private:
  static double unit(uint64_t r) { return (static_cast<double>(r >> 11) + 0.5) * 0x1.0p-53; }
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

uint64_t fixed_stream(uint64_t seed, uint64_t id) {
  return mix64(mix64(seed ^ kFixedSalt) + id * data::kGolden);
}
uint64_t sample_stream(uint64_t seed, uint64_t i) {
  return mix64(mix64(seed ^ kSampleSalt) + i * data::kGolden);
}

std::vector<double> normal_vector(uint64_t state, int64_t n) {
  Normals g(state);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = g.next();
  return v;
}

// The mean square of the scaled posterior noise, s^2 E[exp(logvar)] for logvar ~ N(m, sd^2).
double posterior_share() {
  const double s = static_cast<double>(kLatentScale);
  return s * s * std::exp(kLogvarMean + 0.5 * kLogvarStd * kLogvarStd);
}

uint16_t to_half(double v) {
  return float_to_half_bits(static_cast<float>(v));
}

}  // namespace

void check_latent_dataset_params(const LatentDatasetParams& p) {
  REPLAY_REQUIRE(p.num_samples >= 1, "--samples must be positive");
  REPLAY_REQUIRE(p.latent_channels >= 1 && p.latent_height >= 1 && p.latent_width >= 1,
                 "the latent's dimensions must be positive");
  REPLAY_REQUIRE(p.context_len >= 3, "the context needs at least 3 tokens (start, word, end)");
  REPLAY_REQUIRE(p.context_dim >= 2, "the context dimension must be at least 2");
  REPLAY_REQUIRE(p.num_classes >= 1 && p.num_classes <= 65536, "--classes must be in [1, 65536]");
  REPLAY_REQUIRE(p.class_share >= 0.0 && p.class_share <= 0.99,
                 "--class-share must be in [0, 0.99]");
  REPLAY_REQUIRE(p.held_out_samples < p.num_samples,
                 "the held-out split must leave training samples");
}

LatentSource::LatentSource(const LatentDatasetParams& params) : params_(params) {
  check_latent_dataset_params(params);
  const int64_t C = params.latent_channels, H = params.latent_height, W = params.latent_width;
  const int64_t D = params.context_dim, K = params.num_classes;
  residual_scale_ = std::sqrt(1.0 - params.class_share - posterior_share());

  // Class patterns: P_k[c, y, x] = sum over modes (fy, fx) of A[k, c, mode] * phi(y) * phi(x),
  // phi(y) = cos(pi fy (y + 0.5) / H) (times sqrt(2) unless fy = 0), then scaled to mean square 1.
  const std::vector<double> coeffs =
      normal_vector(fixed_stream(params.seed, 0), K * C * kModes * kModes);
  auto mode = [](int f, int64_t y, int64_t n) {
    const double v = std::cos(kPi * f * (static_cast<double>(y) + 0.5) / static_cast<double>(n));
    return f == 0 ? v : std::sqrt(2.0) * v;
  };
  patterns_.assign(static_cast<size_t>(K * C * H * W), 0.0);
  for (int64_t k = 0; k < K; ++k) {
    double* p = patterns_.data() + k * C * H * W;
    for (int64_t c = 0; c < C; ++c)
      for (int fy = 0; fy < kModes; ++fy)
        for (int fx = 0; fx < kModes; ++fx) {
          const double a = coeffs[static_cast<size_t>(((k * C + c) * kModes + fy) * kModes + fx)];
          for (int64_t y = 0; y < H; ++y)
            for (int64_t x = 0; x < W; ++x)
              p[(c * H + y) * W + x] += a * mode(fy, y, H) * mode(fx, x, W);
        }
    double ms = 0.0;
    for (int64_t e = 0; e < C * H * W; ++e) ms += p[e] * p[e];
    const double norm = 1.0 / std::sqrt(ms / static_cast<double>(C * H * W));
    for (int64_t e = 0; e < C * H * W; ++e) p[e] *= norm;
  }

  start_ = normal_vector(fixed_stream(params.seed, 1), D);
  end_ = normal_vector(fixed_stream(params.seed, 2), D);
  class_words_.reserve(static_cast<size_t>(K * D));
  for (int64_t k = 0; k < K; ++k) {
    const std::vector<double> v = normal_vector(fixed_stream(params.seed, 3 + k), D);
    class_words_.insert(class_words_.end(), v.begin(), v.end());
  }
  filler_words_.reserve(static_cast<size_t>(kFillerWords * D));
  for (int64_t j = 0; j < kFillerWords; ++j) {
    const std::vector<double> v = normal_vector(fixed_stream(params.seed, 3 + K + j), D);
    filler_words_.insert(filler_words_.end(), v.begin(), v.end());
  }
}

const double* LatentSource::pattern(int64_t k) const {
  REPLAY_REQUIRE(k >= 0 && k < params_.num_classes, "LatentSource::pattern: no such class");
  return patterns_.data() +
         k * params_.latent_channels * params_.latent_height * params_.latent_width;
}

int64_t LatentSource::sample(int64_t i, uint16_t* moments, uint16_t* text) const {
  REPLAY_REQUIRE(i >= 0, "LatentSource::sample: negative index");
  const LatentDatasetParams& p = params_;
  const int64_t CHW = p.latent_channels * p.latent_height * p.latent_width;
  const int64_t L = p.context_len, D = p.context_dim;
  Normals g(sample_stream(p.seed, static_cast<uint64_t>(i)));

  // The caption: its length, where the class word is, the filler words elsewhere.
  const auto K = static_cast<uint64_t>(p.num_classes);
  const int64_t k = static_cast<int64_t>(g.bits() % K);
  const int64_t longest = std::min<int64_t>(kCaptionMax, L - 2);
  const int64_t shortest = std::min<int64_t>(kCaptionMin, longest);
  const int64_t length =
      shortest + static_cast<int64_t>(g.bits() % static_cast<uint64_t>(longest - shortest + 1));
  const int64_t class_at = static_cast<int64_t>(g.bits() % static_cast<uint64_t>(length));
  std::vector<const double*> words(static_cast<size_t>(L));
  words[0] = start_.data();
  for (int64_t j = 0; j < length; ++j) {
    words[static_cast<size_t>(1 + j)] =
        j == class_at ? class_words_.data() + k * D
                      : filler_words_.data() + static_cast<int64_t>(g.bits() % kFillerWords) * D;
  }
  for (int64_t j = 1 + length; j < L; ++j) words[static_cast<size_t>(j)] = end_.data();

  // Tokens: word + noise, layer-normed over the D channels (no affine).
  std::vector<double> v(static_cast<size_t>(D));
  for (int64_t j = 0; j < L; ++j) {
    double mean = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      v[static_cast<size_t>(d)] = words[static_cast<size_t>(j)][d] + kTokenNoise * g.next();
      mean += v[static_cast<size_t>(d)];
    }
    mean /= static_cast<double>(D);
    double var = 0.0;
    for (double x : v) var += (x - mean) * (x - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(D) + kLayerNormEps);
    for (int64_t d = 0; d < D; ++d)
      text[j * D + d] = to_half((v[static_cast<size_t>(d)] - mean) * rstd);
  }

  // Moments: mean = (sqrt(share) P_k + residual) / scale, then the log-variance, NCHW.
  const double scale = static_cast<double>(kLatentScale);
  const double class_scale = std::sqrt(p.class_share);
  const double* pk = pattern(k);
  for (int64_t e = 0; e < CHW; ++e)
    moments[e] = to_half((class_scale * pk[e] + residual_scale_ * g.next()) / scale);
  for (int64_t e = 0; e < CHW; ++e) moments[CHW + e] = to_half(kLogvarMean + kLogvarStd * g.next());
  return k;
}

double LatentSource::loss_floor() const {
  return ref::gaussian_v_loss_floor(1.0 - params_.class_share);
}

const char* LatentSource::loss_floor_method() {
  return "exact: the mean over t of Var(v | z_t, class) = tau2 / (acp_t tau2 + 1 - acp_t), the "
         "scaled latent Gaussian given the class with variance tau2 = 1 - class_share "
         "(datasets/unet.md)";
}

std::string LatentSource::description() const {
  std::ostringstream s;
  s << "replay-unet-data: " << params_.num_classes << " classes named in the caption, class share "
    << params_.class_share << " of the scaled latent's mean square (smooth patterns of "
    << kModes * kModes << " cosine modes per channel), white residual, log-variance N("
    << kLogvarMean << ", " << kLogvarStd << "^2); layer-normed token vectors";
  return s.str();
}

LatentFileInfo generate_latent_dataset(const std::string& path, const LatentDatasetParams& params,
                                       const LatentProgress& progress) {
  const LatentSource source(params);
  LatentFileDims dims;
  dims.num_samples = params.num_samples;
  dims.latent_channels = params.latent_channels;
  dims.latent_height = params.latent_height;
  dims.latent_width = params.latent_width;
  dims.context_len = params.context_len;
  dims.context_dim = params.context_dim;
  dims.held_out_samples = params.held_out_samples;

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  LatentFileWriter writer(path, dims);
  const int64_t per_m = 2 * params.latent_channels * params.latent_height * params.latent_width;
  const int64_t per_t = params.context_len * params.context_dim;
  // About 4 MiB of samples per write.
  const int64_t block =
      std::clamp<int64_t>((int64_t{4} << 20) / (2 * (per_m + per_t)), 1, params.num_samples);
  std::vector<uint16_t> moments(static_cast<size_t>(block * per_m));
  std::vector<uint16_t> text(static_cast<size_t>(block * per_t));
  for (int64_t first = 0; first < params.num_samples; first += block) {
    const int64_t count = std::min(block, params.num_samples - first);
    for (int64_t i = 0; i < count; ++i)
      source.sample(first + i, moments.data() + i * per_m, text.data() + i * per_t);
    writer.write_samples(first, count, moments.data(), text.data());
    if (progress && !progress(first + count, params.num_samples))
      throw_error("replay", "cancelled", "generate_latent_dataset", __FILE__, __LINE__,
                  "'" + path + "' was not written");
  }
  LatentProvenance p;
  p.seed = params.seed;
  p.generator = source.description();
  p.vae = "none: synthetic moments";
  p.text_encoder = "none: synthetic layer-normed token vectors";
  p.num_classes = params.num_classes;
  p.class_share = params.class_share;
  p.loss_floor = source.loss_floor();
  p.loss_floor_method = LatentSource::loss_floor_method();
  writer.commit(p);

  LatentFileInfo info;
  info.path = path;
  info.num_samples = params.num_samples;
  info.held_out_samples = params.held_out_samples < 0 ? default_held_out_samples(params.num_samples)
                                                      : params.held_out_samples;
  info.latent_channels = params.latent_channels;
  info.latent_height = params.latent_height;
  info.latent_width = params.latent_width;
  info.context_len = params.context_len;
  info.context_dim = params.context_dim;
  info.provenance = p;
  return info;
}

std::string default_latent_dataset_path(const LatentDatasetParams& p, const std::string& dir) {
  const long share = std::lround(p.class_share * 1000.0);
  std::string name = "latents-c" + std::to_string(p.latent_channels) + "-h" +
                     std::to_string(p.latent_height) + "-w" + std::to_string(p.latent_width) +
                     "-l" + std::to_string(p.context_len) + "-d" + std::to_string(p.context_dim) +
                     "-n" + std::to_string(p.num_samples) + "-k" + std::to_string(p.num_classes) +
                     "-s" + std::to_string(share) + "-seed" + std::to_string(p.seed);
  if (p.held_out_samples >= 0) name += "-ho" + std::to_string(p.held_out_samples);
  return dir + "/" + name + ".h5";
}

std::string default_latent_dataset_path(const LatentDatasetParams& params) {
  return default_latent_dataset_path(params, data::default_data_dir());
}

std::string ensure_latent_dataset(const LatentDatasetParams& params, const std::string& dir) {
  const std::string path = default_latent_dataset_path(params, dir);
  if (std::filesystem::exists(path)) return path;
  std::printf("replay: no --data given and no default latent dataset yet: generating %s\n",
              path.c_str());
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  const LatentFileInfo info = generate_latent_dataset(path, params);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replay: wrote %s in %.1f s; loss floor %.6f (v-MSE)\n", path.c_str(), seconds,
              info.provenance.loss_floor);
  std::fflush(stdout);
  return path;
}

std::string ensure_latent_dataset(const LatentDatasetParams& params) {
  return ensure_latent_dataset(params, data::default_data_dir());
}

}  // namespace replay::unet
