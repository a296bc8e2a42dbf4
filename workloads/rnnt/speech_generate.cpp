// speech_generate.cpp: the synthetic speech source, the file generator, the default file.
#include "workloads/rnnt/speech_generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "common/data/splitmix.h"

namespace replay::rnnt {

namespace {

using data::kGolden;
using data::mix64;

// Stream keys: each draws from its own splitmix64 stream, so that lengths, embeddings and noise
// never shift one another.
constexpr uint64_t kEmbeddingKey = 0x3C6EF372FE94F82Bull;
constexpr uint64_t kLayoutKey = 0xA54FF53A5F1D36F1ull;
constexpr uint64_t kNoiseKey = 0x510E527FADE682D1ull;

// One generator stream with the draws the source needs. Normals come from Marsaglia's polar method
// in pairs (the second kept for the next call); gammas from Marsaglia and Tsang's method. The std::
// distributions differ between standard libraries, so none is used; log, sqrt, exp and pow still
// come from the C library, so on another one a feature may differ in its last bit, while lengths
// and labels, rounded to integers, practically never do.
class Stream {
 public:
  Stream(uint64_t seed, uint64_t key, uint64_t index)
      : state_(mix64(mix64(seed ^ key) + index * kGolden)) {}

  uint64_t next() { return data::splitmix(state_); }
  double unit() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1p-53; }  // in (0, 1)

  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u, v, s;
    do {
      u = 2 * unit() - 1;
      v = 2 * unit() - 1;
      s = u * u + v * v;
    } while (s >= 1 || s == 0);
    const double f = std::sqrt(-2 * std::log(s) / s);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

  double gamma(double shape) {
    if (shape < 1) return gamma(shape + 1) * std::pow(unit(), 1 / shape);  // Gamma(k+1) U^(1/k)
    const double d = shape - 1.0 / 3, c = 1 / std::sqrt(9 * d);
    for (;;) {
      double x, v;
      do {
        x = normal();
        v = 1 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = unit();
      if (u < 1 - 0.0331 * x * x * x * x) return d * v;
      if (std::log(u) < 0.5 * x * x + d * (1 - v + std::log(v))) return d * v;
    }
  }

  double beta(double a, double b) {
    const double x = gamma(a);
    const double y = gamma(b);
    return x / (x + y);
  }

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

std::string num(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

}  // namespace

SpeechSource::SpeechSource(const SpeechDatasetParams& p) : params_(p) {
  REPLAY_REQUIRE(p.num_utterances > 0 && p.num_eval >= 0 && p.num_eval < p.num_utterances,
                 "a speech dataset needs utterances, and num_eval must leave some to train on");
  REPLAY_REQUIRE(p.feature_dim > 0 && p.vocab_size > 0 && p.vocab_size < INT32_MAX,
                 "a speech dataset needs a positive feature size and vocabulary");
  REPLAY_REQUIRE(p.min_frames >= 2 && p.max_frames >= p.min_frames && p.max_frames <= INT32_MAX,
                 "frame lengths need 2 <= min_frames <= max_frames (a label takes 2 frames)");
  REPLAY_REQUIRE(p.max_labels >= 1, "max_labels must be at least 1");
  REPLAY_REQUIRE(p.length_alpha > 0 && p.length_beta > 0,
                 "the Beta shape of the lengths needs positive parameters");
  REPLAY_REQUIRE(p.token_rate > 0 && p.token_rate_sigma >= 0,
                 "the label rate must be positive and its spread non-negative");
  REPLAY_REQUIRE(p.noise >= 0 && std::isfinite(p.noise), "the noise must be finite and >= 0");
  REPLAY_REQUIRE(p.stored == FeatureType::kFP16 || p.stored == FeatureType::kFP32,
                 "a speech file stores fp16 or fp32 features");
  const int64_t symbols = p.vocab_size + 1, dim = p.feature_dim;
  embeddings_.resize(static_cast<size_t>(symbols * dim));
  norms_.resize(static_cast<size_t>(symbols));
  for (int64_t k = 0; k < symbols; ++k) {
    Stream s(p.seed, kEmbeddingKey, static_cast<uint64_t>(k));
    double norm = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const float e = static_cast<float>(s.normal());
      embeddings_[k * dim + d] = e;
      norm += static_cast<double>(e) * e;
    }
    norms_[k] = norm;
  }
}

const float* SpeechSource::embedding(int64_t symbol) const {
  REPLAY_REQUIRE(symbol >= 0 && symbol <= params_.vocab_size, "no such symbol");
  return embeddings_.data() + symbol * params_.feature_dim;
}

UtteranceLayout SpeechSource::layout(int64_t i) const {
  const SpeechDatasetParams& p = params_;
  Stream s(p.seed, kLayoutKey, static_cast<uint64_t>(i));
  UtteranceLayout l;
  const double x = s.beta(p.length_alpha, p.length_beta);
  const int64_t span = p.max_frames - p.min_frames + 1;
  const int64_t frames =
      std::min(p.max_frames, p.min_frames + static_cast<int64_t>(std::floor(x * span)));
  l.frames = static_cast<int32_t>(frames);

  const double rate = p.token_rate * std::exp(p.token_rate_sigma * s.normal());
  const int64_t most = std::min(p.max_labels, (frames + 1) / 3);
  const int64_t labels =
      std::clamp<int64_t>(static_cast<int64_t>(std::floor(frames * rate + 0.5)), 1, most);

  const uint64_t vocab = static_cast<uint64_t>(p.vocab_size);
  l.tokens.resize(static_cast<size_t>(labels));
  for (int32_t& t : l.tokens) t = static_cast<int32_t>(s.next() % vocab);

  // The minimum (segments of 2, inner gaps of 1, no outer gaps), then each remaining frame goes to
  // a token segment with probability 2/3 or to a gap with 1/3, uniformly within the class.
  l.token_frames.assign(static_cast<size_t>(labels), 2);
  l.gap_frames.assign(static_cast<size_t>(labels + 1), 1);
  l.gap_frames.front() = 0;
  l.gap_frames.back() = 0;
  const uint64_t segments = static_cast<uint64_t>(labels), gaps = segments + 1;
  for (int64_t extra = frames - (3 * labels - 1); extra > 0; --extra) {
    const uint64_t r = s.next();
    if (r % 3 < 2)
      ++l.token_frames[(r / 3) % segments];
    else
      ++l.gap_frames[(r / 3) % gaps];
  }
  return l;
}

std::vector<int32_t> SpeechSource::frame_symbols(const UtteranceLayout& layout) const {
  std::vector<int32_t> symbols;
  symbols.reserve(static_cast<size_t>(layout.frames));
  const size_t labels = layout.tokens.size();
  for (size_t j = 0; j <= labels; ++j) {
    symbols.insert(symbols.end(), static_cast<size_t>(layout.gap_frames[j]), gap_symbol());
    if (j < labels)
      symbols.insert(symbols.end(), static_cast<size_t>(layout.token_frames[j]), layout.tokens[j]);
  }
  REPLAY_REQUIRE(static_cast<int64_t>(symbols.size()) == layout.frames,
                 "an utterance layout whose segments do not add up to its frames");
  return symbols;
}

void SpeechSource::features(int64_t i, const UtteranceLayout& layout, float* out) const {
  const int64_t dim = params_.feature_dim;
  const double noise = params_.noise, scale = 1 / std::sqrt(1 + noise * noise);
  Stream s(params_.seed, kNoiseKey, static_cast<uint64_t>(i));
  const std::vector<int32_t> symbols = frame_symbols(layout);
  for (size_t t = 0; t < symbols.size(); ++t) {
    const float* e = embedding(symbols[t]);
    float* row = out + static_cast<int64_t>(t) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const double v = noise > 0 ? e[d] + noise * s.normal() : e[d];
      row[d] = static_cast<float>(v * scale);
    }
  }
}

std::vector<int32_t> SpeechSource::oracle_decode(const float* features, int64_t frames) const {
  const int64_t dim = params_.feature_dim, symbols = params_.vocab_size + 1;
  const double unscale = std::sqrt(1 + params_.noise * params_.noise);
  std::vector<double> y(static_cast<size_t>(dim));
  std::vector<int32_t> labels;
  int32_t previous = gap_symbol();
  for (int64_t t = 0; t < frames; ++t) {
    for (int64_t d = 0; d < dim; ++d) y[d] = features[t * dim + d] * unscale;
    // argmin |y - e_k|^2 = argmax 2 y.e_k - |e_k|^2; ties go to the lower symbol.
    int32_t best = 0;
    double best_score = -INFINITY;
    for (int64_t k = 0; k < symbols; ++k) {
      const float* e = embeddings_.data() + k * dim;
      double dot = 0;
      for (int64_t d = 0; d < dim; ++d) dot += y[d] * e[d];
      const double score = 2 * dot - norms_[k];
      if (score > best_score) {
        best_score = score;
        best = static_cast<int32_t>(k);
      }
    }
    if (best != previous && best != gap_symbol()) labels.push_back(best);
    previous = best;
  }
  return labels;
}

std::string SpeechSource::description() const {
  const SpeechDatasetParams& p = params_;
  return "frames " + std::to_string(p.min_frames) + " + floor(Beta(" + num(p.length_alpha) + ", " +
         num(p.length_beta) + ") x " + std::to_string(p.max_frames - p.min_frames + 1) +
         "); labels round(T x " + num(p.token_rate) + " x exp(" + num(p.token_rate_sigma) +
         " N(0,1))) in [1, min(" + std::to_string(p.max_labels) + ", (T+1)/3)], ids uniform over " +
         std::to_string(p.vocab_size) +
         "; segments of >= 2 frames, inner gaps >= 1; frames (N(0,1) embedding + " + num(p.noise) +
         " N(0,I)) / sqrt(1 + " + num(p.noise) + "^2)";
}

SpeechFileInfo generate_speech_dataset(const std::string& path, const SpeechDatasetParams& params,
                                       const SpeechProgress& progress) {
  const SpeechSource source(params);
  const int64_t n = params.num_utterances, dim = params.feature_dim;
  // Pass 1: the lengths, which size the datasets and their offsets.
  std::vector<int32_t> frame_lengths(static_cast<size_t>(n)), label_lengths(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const UtteranceLayout l = source.layout(i);
    frame_lengths[i] = l.frames;
    label_lengths[i] = static_cast<int32_t>(l.tokens.size());
  }
  SpeechFileInfo info;
  info.path = path;
  info.feature_dim = dim;
  info.vocab_size = params.vocab_size;
  info.num_utterances = n;
  info.num_eval = params.num_eval;
  info.stored = params.stored;
  for (int64_t i = 0; i < n; ++i) {
    info.total_frames += frame_lengths[i];
    info.total_labels += label_lengths[i];
  }
  info.min_frames = *std::min_element(frame_lengths.begin(), frame_lengths.end());
  info.max_frames = *std::max_element(frame_lengths.begin(), frame_lengths.end());
  info.min_labels = *std::min_element(label_lengths.begin(), label_lengths.end());
  info.max_labels = *std::max_element(label_lengths.begin(), label_lengths.end());
  SpeechProvenance& p = info.provenance;
  p.seed = params.seed;
  p.generator = "replay-rnnt-data: " + source.description();
  p.frame_ms = 30.0;
  p.noise = params.noise;

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  SpeechFileWriter writer(path, {dim, params.vocab_size, params.stored, params.num_eval},
                          frame_lengths, label_lengths);
  // Pass 2: the utterances, written in blocks of about 4 MiB of fp32 features.
  const int64_t block_frames = std::max<int64_t>(params.max_frames, (int64_t{4} << 20) / (4 * dim));
  std::vector<float> features;
  std::vector<int32_t> labels;
  for (int64_t first = 0; first < n;) {
    int64_t last = first, frames = 0;
    while (last < n && (last == first || frames + frame_lengths[last] <= block_frames))
      frames += frame_lengths[last++];
    features.resize(static_cast<size_t>(frames * dim));
    labels.clear();
    int64_t row = 0;
    for (int64_t i = first; i < last; ++i) {
      const UtteranceLayout l = source.layout(i);
      source.features(i, l, features.data() + row * dim);
      row += l.frames;
      labels.insert(labels.end(), l.tokens.begin(), l.tokens.end());
    }
    writer.write_utterances(first, last - first, features.data(), labels.data());
    if (progress && !progress(last, n))
      throw_error("replay", "cancelled", "generate_speech_dataset", __FILE__, __LINE__,
                  "'" + path + "' was not written");
    first = last;
  }
  writer.commit(p);
  return info;
}

std::string default_speech_dataset_path(const SpeechDatasetParams& p, const std::string& dir) {
  return dir + "/rnnt-v" + std::to_string(p.vocab_size) + "-d" + std::to_string(p.feature_dim) +
         "-n" + std::to_string(p.num_utterances) + "-e" + std::to_string(p.num_eval) + "-f" +
         std::to_string(p.min_frames) + "-" + std::to_string(p.max_frames) + "-len" +
         num(p.length_alpha) + "_" + num(p.length_beta) + "-u" + std::to_string(p.max_labels) +
         "-rate" + num(p.token_rate) + "_" + num(p.token_rate_sigma) + "-noise" + num(p.noise) +
         "-" + feature_type_name(p.stored) + "-seed" + std::to_string(p.seed) + ".h5";
}

std::string ensure_speech_dataset(const SpeechDatasetParams& params, const std::string& dir) {
  const std::string path = default_speech_dataset_path(params, dir);
  if (std::filesystem::exists(path)) return path;
  std::printf("replay: no --data given and no default speech dataset yet: generating %s\n",
              path.c_str());
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  const SpeechFileInfo info = generate_speech_dataset(path, params);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replay: wrote %s in %.1f s: %lld utterances (%lld held out), %lld frames\n",
              path.c_str(), seconds, static_cast<long long>(info.num_utterances),
              static_cast<long long>(info.num_eval), static_cast<long long>(info.total_frames));
  std::fflush(stdout);
  return path;
}

}  // namespace replay::rnnt
