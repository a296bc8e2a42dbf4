// RNN-T speech files on the CPU: fp16/bf16 conversions, generator -> file -> reader round trips,
// padded batches, the atomic writer, and every validation error on small files written by hand
// with the HDF5 C API. Nothing here touches a GPU: validation runs before any GPU work.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "common/data/splitmix.h"
#include "tests/common/test_data_util.h"
#include "workloads/rnnt/speech_batches.h"
#include "workloads/rnnt/speech_file.h"
#include "workloads/rnnt/speech_generate.h"

namespace replay::rnnt {
namespace {

using data::H5Guard;
using data::H5Id;
using test::TempDir;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// A small dataset: 40 utterances of 16 features, lengths 20..90 frames, 50 labels.
SpeechDatasetParams small_params(FeatureType stored) {
  SpeechDatasetParams p;
  p.num_utterances = 40;
  p.num_eval = 8;
  p.feature_dim = 16;
  p.vocab_size = 50;
  p.min_frames = 20;
  p.max_frames = 90;
  p.max_labels = 20;
  p.stored = stored;
  p.seed = 77;
  return p;
}

SpeechShape shape_of(const SpeechDatasetParams& p) {
  return {p.feature_dim, p.vocab_size, 0, 0};
}

// ---- Conversions --------------------------------------------------------------------------------

// Every fp16 bit pattern decodes exactly and encodes back to itself (NaNs stay NaN).
TEST(HalfFloat, EveryFp16PatternRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = float_from_fp16(static_cast<uint16_t>(h));
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {
      EXPECT_TRUE(std::isnan(x)) << h;
      EXPECT_TRUE(std::isnan(float_from_fp16(fp16_from_float(x)))) << h;
      continue;
    }
    EXPECT_EQ(fp16_from_float(x), h) << "pattern " << h << " decodes to " << x;
  }
  EXPECT_EQ(float_from_fp16(0x3C00), 1.0f);
  EXPECT_EQ(float_from_fp16(0x7BFF), 65504.0f);
  EXPECT_EQ(float_from_fp16(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(float_from_fp16(0x8400), -std::ldexp(1.0f, -14));
}

// Rounding to nearest, ties to even, overflow to infinity, underflow through the subnormals.
TEST(HalfFloat, Fp16RoundsToNearestEven) {
  EXPECT_EQ(fp16_from_float(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie: to even (down)
  EXPECT_EQ(fp16_from_float(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie: to even (up)
  EXPECT_EQ(fp16_from_float(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3C01);
  EXPECT_EQ(fp16_from_float(65519.0f), 0x7BFF);
  EXPECT_EQ(fp16_from_float(65520.0f), 0x7C00);  // the tie above the largest finite: infinity
  EXPECT_EQ(fp16_from_float(-1e10f), 0xFC00);
  EXPECT_EQ(fp16_from_float(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24: 0
  EXPECT_EQ(fp16_from_float(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(fp16_from_float(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 x 2^-24: tie to even
  EXPECT_EQ(fp16_from_float(-0.0f), 0x8000);
  EXPECT_EQ(fp16_from_float(std::ldexp(1.0f, -130)), 0x0000);    // a float subnormal
  EXPECT_EQ(fp16_from_float(std::ldexp(1023.5f, -24)), 0x0400);  // rounds up to the smallest normal
#ifdef __FLT16_MAX__
  // Against the compiler's own conversion on a spread of floats.
  uint64_t state = 12345;
  for (int k = 0; k < 200000; ++k) {
    // Sign and mantissa at random, exponents from 2^-30 (below fp16's subnormals) to 2^17
    // (beyond its range).
    const uint32_t u = static_cast<uint32_t>(data::splitmix(state));
    const uint32_t exponent = 97 + (u >> 23) % 48;
    const float x = from_bits((u & 0x807FFFFFu) | (exponent << 23));
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(fp16_from_float(x), want) << x;
  }
#endif
}

// bf16: the nearer of the two neighbours, ties to even, decoding exact.
TEST(HalfFloat, Bf16RoundsToNearestEven) {
  uint64_t state = 99;
  for (int k = 0; k < 200000; ++k) {
    const float x = from_bits(static_cast<uint32_t>(data::splitmix(state)));
    if (!std::isfinite(x) || std::fabs(x) > 3e38f) continue;
    const uint32_t lo = bits(x) & 0xFFFF0000u;
    const double down = from_bits(lo), up = from_bits(lo + 0x10000u);
    const double dd = std::fabs(x - down), du = std::fabs(up - x);
    const uint16_t want = static_cast<uint16_t>(
        (dd < du || (dd == du && ((lo >> 16) & 1u) == 0)) ? lo >> 16 : (lo >> 16) + 1);
    ASSERT_EQ(bf16_from_float(x), want) << x;
    EXPECT_EQ(bits(float_from_bf16(want)), static_cast<uint32_t>(want) << 16);
  }
  EXPECT_TRUE(std::isnan(float_from_bf16(bf16_from_float(NAN))));
}

// ---- Round trips --------------------------------------------------------------------------------

// Generator -> file -> reader gives back the source's lengths, labels and features exactly (fp32)
// or rounded to nearest (fp16), and the attributes that describe them.
TEST(SpeechFile, GeneratedFileRoundTrips) {
  for (FeatureType stored : {FeatureType::kFP32, FeatureType::kFP16}) {
    TempDir dir;
    const SpeechDatasetParams p = small_params(stored);
    const std::string path = dir.file("speech.h5");
    const SpeechFileInfo written = generate_speech_dataset(path, p);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(getpid())));
    const SpeechFile file(path, shape_of(p));
    const SpeechFileInfo& info = file.info();
    EXPECT_EQ(info.stored, stored);
    EXPECT_EQ(info.num_utterances, 40);
    EXPECT_EQ(info.num_eval, 8);
    EXPECT_EQ(info.num_train(), 32);
    EXPECT_EQ(info.feature_dim, 16);
    EXPECT_EQ(info.vocab_size, 50);
    EXPECT_EQ(info.total_frames, written.total_frames);
    EXPECT_EQ(info.total_labels, written.total_labels);
    EXPECT_EQ(info.max_frames, written.max_frames);
    EXPECT_EQ(info.min_labels, written.min_labels);
    EXPECT_EQ(info.provenance.seed, std::optional<uint64_t>(77));
    EXPECT_EQ(info.provenance.frame_ms, 30.0);
    EXPECT_EQ(info.provenance.noise, 1.0);
    EXPECT_NE(info.provenance.generator.find("replay-rnnt-data: frames 20 + floor(Beta(3.25"),
              std::string::npos)
        << info.provenance.generator;

    const SpeechSource source(p);
    std::vector<float> want, got;
    for (int64_t i = 0; i < p.num_utterances; ++i) {
      const UtteranceLayout l = source.layout(i);
      ASSERT_EQ(file.frame_length(i), l.frames);
      ASSERT_EQ(file.label_length(i), static_cast<int32_t>(l.tokens.size()));
      EXPECT_EQ(std::vector<int32_t>(file.labels(i), file.labels(i) + l.tokens.size()), l.tokens);
      want.resize(static_cast<size_t>(l.frames * p.feature_dim));
      got.resize(want.size());
      source.features(i, l, want.data());
      file.read_features(i, FeatureType::kFP32, got.data());
      for (size_t k = 0; k < want.size(); ++k) {
        const float expect =
            stored == FeatureType::kFP32 ? want[k] : float_from_fp16(fp16_from_float(want[k]));
        ASSERT_EQ(bits(got[k]), bits(expect)) << "utterance " << i << " element " << k;
      }
      // The same values delivered as fp16 and bf16 bits.
      std::vector<uint16_t> half(want.size()), brain(want.size());
      file.read_features(i, FeatureType::kFP16, half.data());
      file.read_features(i, FeatureType::kBF16, brain.data());
      for (size_t k = 0; k < want.size(); ++k) {
        ASSERT_EQ(half[k], fp16_from_float(got[k]));
        ASSERT_EQ(brain[k], bf16_from_float(got[k]));
      }
    }
  }
}

// A batch: utterances at their slots, zeros past their lengths, empty slots all zero, and an
// utterance longer than the batch's shape refused by name.
TEST(SpeechFile, ReadBatchPadsEverySlot) {
  TempDir dir;
  const SpeechDatasetParams p = small_params(FeatureType::kFP16);
  const std::string path = dir.file("speech.h5");
  generate_speech_dataset(path, p);
  const SpeechFile file(path, shape_of(p));
  const int64_t slots = 4, t_max = 96, u_max = 24, d = p.feature_dim;
  const int64_t indices[slots] = {5, -1, 0, 39};
  std::vector<uint16_t> features(static_cast<size_t>(slots * t_max * d), 0xFFFF);
  std::vector<int32_t> frames(slots, -7), labels(static_cast<size_t>(slots * u_max), -7),
      label_lengths(slots, -7);
  file.read_batch(indices, slots, t_max, u_max, FeatureType::kFP16,
                  {features.data(), frames.data(), labels.data(), label_lengths.data()});
  for (int64_t b = 0; b < slots; ++b) {
    const int64_t i = indices[b];
    const int64_t t = i < 0 ? 0 : file.frame_length(i), u = i < 0 ? 0 : file.label_length(i);
    EXPECT_EQ(frames[b], t);
    EXPECT_EQ(label_lengths[b], u);
    std::vector<uint16_t> own(static_cast<size_t>(t * d));
    if (t > 0) file.read_features(i, FeatureType::kFP16, own.data());
    for (int64_t k = 0; k < t_max * d; ++k)
      ASSERT_EQ(features[b * t_max * d + k], k < t * d ? own[k] : 0) << "slot " << b << " " << k;
    for (int64_t k = 0; k < u_max; ++k)
      ASSERT_EQ(labels[b * u_max + k], k < u ? file.labels(i)[k] : 0) << "slot " << b << " " << k;
  }

  const int64_t longest =
      std::max_element(file.frame_lengths().begin(), file.frame_lengths().end()) -
      file.frame_lengths().begin();
  const int64_t one[1] = {longest};
  try {
    file.read_batch(one, 1, 10, u_max, FeatureType::kFP16,
                    {features.data(), frames.data(), labels.data(), label_lengths.data()});
    ADD_FAILURE() << "expected an error for an utterance longer than the batch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("utterance " + std::to_string(longest) + " (" +
                                         std::to_string(file.frame_length(longest)) + " frames"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("does not fit the batch's shape of 10 frames"),
              std::string::npos)
        << e.what();
  }
}

// assemble_batch: the smallest fitting rung of a ladder, or the batch's own longest utterance.
TEST(SpeechFile, AssembleBatchPadsToTheRung) {
  TempDir dir;
  const SpeechDatasetParams p = small_params(FeatureType::kFP32);
  const std::string path = dir.file("speech.h5");
  generate_speech_dataset(path, p);
  const SpeechFile file(path, shape_of(p));
  const Ladder ladder({{40, 8}, {64, 16}, {96, 24}});
  // Two utterances: the batch's longest frames and labels decide the rung.
  std::vector<int64_t> pick;
  for (int64_t i = 0; i < file.size() && pick.size() < 2; ++i)
    if (file.frame_length(i) > 40 && file.frame_length(i) <= 64 && file.label_length(i) <= 16)
      pick.push_back(i);
  ASSERT_EQ(pick.size(), 2u);
  const int64_t indices[3] = {pick[0], -1, pick[1]};
  HostSpeechBatch batch;
  assemble_batch(file, &ladder, indices, 3, FeatureType::kFP32, batch);
  EXPECT_EQ(batch.rung, 1);
  EXPECT_EQ(batch.max_frames, 64);
  EXPECT_EQ(batch.max_labels, 16);
  EXPECT_EQ(batch.features.size(), 3u * 64 * 16 * 4);
  EXPECT_EQ(batch.frame_lengths[1], 0);
  EXPECT_EQ(batch.frame_lengths[2], file.frame_length(pick[1]));
  std::vector<float> own(static_cast<size_t>(file.frame_length(pick[1]) * 16));
  file.read_features(pick[1], FeatureType::kFP32, own.data());
  EXPECT_EQ(std::memcmp(batch.features_fp32() + 2 * 64 * 16, own.data(), own.size() * 4), 0);
  EXPECT_THROW(batch.features_16bit(), Error);

  assemble_batch(file, nullptr, indices, 3, FeatureType::kFP16, batch);
  EXPECT_EQ(batch.rung, -1);
  EXPECT_EQ(batch.max_frames, std::max(file.frame_length(pick[0]), file.frame_length(pick[1])));
  EXPECT_EQ(batch.max_labels, std::max(file.label_length(pick[0]), file.label_length(pick[1])));
  EXPECT_EQ(batch.features.size(), static_cast<size_t>(3 * batch.max_frames * 16 * 2));

  const int64_t all_empty[2] = {-1, -1};
  EXPECT_THROW(assemble_batch(file, &ladder, all_empty, 2, FeatureType::kFP16, batch), Error);
}

// The writer renames only on commit, refuses to commit a file with an utterance missing, removes
// its temporary file when dropped, and refuses values the file cannot hold.
TEST(SpeechFileWriter, RenamesOnlyACompleteFile) {
  TempDir dir;
  const std::string path = dir.file("w.h5");
  const std::vector<int32_t> frames = {3, 2}, labels = {2, 0};
  const std::vector<float> features(5 * 4, 0.5f);
  const std::vector<int32_t> ids = {1, 2};
  {
    SpeechFileWriter writer(path, {4, 10, FeatureType::kFP16, 1}, frames, labels);
    EXPECT_TRUE(std::filesystem::exists(writer.temp_path()));
    EXPECT_EQ(writer.total_frames(), 5);
    writer.write_utterances(0, 1, features.data(), ids.data());
    EXPECT_THROW(writer.commit({}), Error);  // utterance 1 was never written
    EXPECT_FALSE(std::filesystem::exists(path));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the temporary file must be removed";
  {
    SpeechFileWriter writer(path, {4, 10, FeatureType::kFP16, 1}, frames, labels);
    std::vector<float> bad = features;
    bad[13] = 1e6f;  // beyond fp16
    EXPECT_THROW(writer.write_utterances(0, 2, bad.data(), ids.data()), Error);
    bad[13] = NAN;
    EXPECT_THROW(writer.write_utterances(0, 2, bad.data(), ids.data()), Error);
    const std::vector<int32_t> bad_ids = {1, 10};
    EXPECT_THROW(writer.write_utterances(0, 2, features.data(), bad_ids.data()), Error);
    writer.write_utterances(1, 1, features.data(), nullptr);
    writer.write_utterances(0, 1, features.data(), ids.data());
    writer.commit({});
  }
  const SpeechFile file(path, {4, 10, 0, 0});
  EXPECT_EQ(file.info().num_eval, 1);
  EXPECT_EQ(file.label_length(1), 0);
  EXPECT_EQ(file.info().provenance.generator, "");
  EXPECT_FALSE(file.info().provenance.seed.has_value());
  EXPECT_THROW(SpeechFileWriter(dir.file("x.h5"), {4, 10, FeatureType::kFP16, 2}, frames, labels),
               Error);  // nothing left to train on
  EXPECT_THROW(SpeechFileWriter(dir.file("x.h5"), {4, 10, FeatureType::kFP16, 0}, {3, 0}, labels),
               Error);  // an utterance without frames
}

// A cancelled generation leaves nothing behind; the default path names every parameter, and
// ensure_speech_dataset generates once.
TEST(SpeechGenerate, CancelLeavesNothingAndTheDefaultFileIsReused) {
  TempDir dir;
  SpeechDatasetParams p = small_params(FeatureType::kFP16);
  EXPECT_THROW(generate_speech_dataset(dir.file("c.h5"), p, [](int64_t, int64_t) { return false; }),
               Error);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));

  const std::string path = default_speech_dataset_path(p, dir.path().string());
  EXPECT_EQ(std::filesystem::path(path).filename().string(),
            "rnnt-v50-d16-n40-e8-f20-90-len3.25_1.25-u20-rate0.105_0.18-noise1-fp16-seed77.h5");
  EXPECT_EQ(ensure_speech_dataset(p, dir.path().string()), path);
  const auto written = std::filesystem::last_write_time(path);
  EXPECT_EQ(ensure_speech_dataset(p, dir.path().string()), path);
  EXPECT_EQ(std::filesystem::last_write_time(path), written);
  p.noise = 0.5;
  EXPECT_NE(default_speech_dataset_path(p, dir.path().string()), path);
}

// ---- Validation errors
// ----------------------------------------------------------------------------

// A hand-made file: which parts it has and what they hold. The default is valid: 3 utterances
// of 3, 4 and 5 frames of 4 features, transcripts of 2, 0 and 3 labels below 10, one held out.
struct Hand {
  bool format = true;
  int64_t version = 1;
  std::set<std::string> skip;  // datasets and attributes left out
  std::vector<hsize_t> feature_dims = {12, 4};
  hid_t feature_type = H5T_IEEE_F32LE;
  bool feature_bf16 = false;  // store features as a 2-byte float with 8 exponent bits
  bool feature_fp16 = false;
  std::vector<float> feature_values;  // default: 0.01 * element index
  hid_t offsets_type = H5T_STD_I64LE, labels_type = H5T_STD_I32LE;
  std::vector<int64_t> frame_offsets = {0, 3, 7, 12};
  std::vector<int64_t> label_offsets = {0, 2, 2, 5};
  std::vector<int32_t> labels = {1, 2, 3, 4, 9};
  std::map<std::string, int64_t> attrs = {{"feature_dim", 4},    {"vocab_size", 10},
                                          {"num_utterances", 3}, {"num_eval", 1},
                                          {"total_frames", 12},  {"total_labels", 5}};
};

H5Id custom_float(int esize, int msize) {
  H5Id t = REPLAY_H5_OWN(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  REPLAY_HDF5_CHECK(H5Tset_fields(t.get(), 15, static_cast<size_t>(msize),
                                  static_cast<size_t>(esize), 0, static_cast<size_t>(msize)));
  REPLAY_HDF5_CHECK(H5Tset_size(t.get(), 2));
  REPLAY_HDF5_CHECK(H5Tset_ebias(t.get(), (1u << (esize - 1)) - 1));
  return t;
}

void write_hand(const std::string& path, const Hand& h) {
  H5Guard guard;
  H5Id file =
      REPLAY_H5_OWN(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  H5Id root = REPLAY_H5_OWN(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);
  if (h.format) {
    data::write_attr(root.get(), "format", std::string(kSpeechFormatName));
    data::write_attr(root.get(), "format_version", h.version);
  }
  for (const auto& [name, value] : h.attrs)
    if (!h.skip.count(name)) data::write_attr(root.get(), name.c_str(), value);
  auto dataset = [&](const char* name, hid_t type, const std::vector<hsize_t>& dims, hid_t mem_type,
                     const void* values) {
    if (h.skip.count(name)) return;
    H5Id space = REPLAY_H5_OWN(
        H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    H5Id d = REPLAY_H5_OWN(
        H5Dcreate2(file.get(), name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
        H5Dclose);
    hsize_t n = 1;
    for (hsize_t x : dims) n *= x;
    if (n > 0)
      REPLAY_HDF5_CHECK(H5Dwrite(d.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values));
  };
  hsize_t n = 1;
  for (hsize_t x : h.feature_dims) n *= x;
  std::vector<float> values = h.feature_values;
  for (size_t k = values.size(); k < n; ++k) values.push_back(0.01f * static_cast<float>(k));
  H5Id type = h.feature_bf16   ? custom_float(8, 7)
              : h.feature_fp16 ? custom_float(5, 10)
                               : REPLAY_H5_OWN(H5Tcopy(h.feature_type), H5Tclose);
  dataset("features", type.get(), h.feature_dims, H5T_NATIVE_FLOAT, values.data());
  dataset("frame_offsets", h.offsets_type, {h.frame_offsets.size()}, H5T_NATIVE_INT64,
          h.frame_offsets.data());
  dataset("labels", h.labels_type, {h.labels.size()}, H5T_NATIVE_INT32, h.labels.data());
  dataset("label_offsets", h.offsets_type, {h.label_offsets.size()}, H5T_NATIVE_INT64,
          h.label_offsets.data());
}

const SpeechShape kModel{4, 16, 0, 0};

// Opening must fail with an Error naming the file and containing `problem`.
void expect_bad(const std::string& path, const SpeechShape& shape, const std::string& problem) {
  try {
    SpeechFile file(path, shape);
    ADD_FAILURE() << "opened " << path << " but expected: " << problem;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("speech data file '" + path + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(problem), std::string::npos) << "expected '" << problem << "' in: " << what;
  }
}

// Writes `h` and expects `problem` when opening it.
void expect_bad_hand(const TempDir& dir, const std::string& name, const Hand& h,
                     const std::string& problem, const SpeechShape& shape = kModel) {
  write_hand(dir.file(name), h);
  expect_bad(dir.file(name), shape, problem);
}

TEST(SpeechFileErrors, TheHandMadeBaselineIsValid) {
  TempDir dir;
  write_hand(dir.file("good.h5"), Hand{});
  const SpeechFile file(dir.file("good.h5"), kModel);
  EXPECT_EQ(file.frame_lengths(), (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(file.label_lengths(), (std::vector<int32_t>{2, 0, 3}));
  EXPECT_EQ(file.info().stored, FeatureType::kFP32);
  EXPECT_EQ(file.info().num_train(), 2);
  std::vector<float> f(5 * 4);
  file.read_features(2, FeatureType::kFP32, f.data());
  EXPECT_EQ(f[0], 0.01f * 28);  // row 7 of the flat features
  Hand h;
  h.feature_fp16 = true;
  write_hand(dir.file("half.h5"), h);
  EXPECT_EQ(SpeechFile(dir.file("half.h5"), kModel).info().stored, FeatureType::kFP16);
  h = Hand{};
  h.feature_type = H5T_IEEE_F32BE;  // any byte order
  write_hand(dir.file("be.h5"), h);
  const SpeechFile be(dir.file("be.h5"), kModel);
  be.read_features(2, FeatureType::kFP32, f.data());
  EXPECT_EQ(f[0], 0.01f * 28);
}

TEST(SpeechFileErrors, FileLevelProblems) {
  TempDir dir;
  expect_bad(dir.file("missing.h5"), kModel, "no such file");
  std::filesystem::create_directories(dir.file("folder.h5"));
  expect_bad(dir.file("folder.h5"), kModel, "not a regular file");
  std::ofstream(dir.file("text.h5")) << "not hdf5 at all\n";
  expect_bad(dir.file("text.h5"), kModel, "not an HDF5 file");

  // A generated file cut short, as an interrupted copy leaves it.
  SpeechDatasetParams p = small_params(FeatureType::kFP16);
  generate_speech_dataset(dir.file("cut.h5"), p);
  std::filesystem::resize_file(dir.file("cut.h5"),
                               std::filesystem::file_size(dir.file("cut.h5")) / 2);
  expect_bad(dir.file("cut.h5"), shape_of(p),
             "HDF5 cannot open it: the file is truncated or damaged");

  Hand h;
  h.format = false;
  expect_bad_hand(dir, "noformat.h5", h, "'format' is missing or not 'replay-rnnt-speech'");
  h = Hand{};
  h.version = 2;
  expect_bad_hand(dir, "v2.h5", h, "format_version is 2; this build reads version 1");
}

TEST(SpeechFileErrors, MissingDatasetsWrongRanksAndTypes) {
  TempDir dir;
  for (const char* name : {"features", "frame_offsets", "labels", "label_offsets"}) {
    Hand h;
    h.skip.insert(name);
    expect_bad_hand(dir, std::string("no_") + name + ".h5", h,
                    std::string("no dataset '/") + name + "'");
  }
  Hand h;
  h.feature_dims = {48};
  expect_bad_hand(dir, "rank1.h5", h, "'/features' has rank 1, expected 2");
  h = Hand{};
  h.feature_type = H5T_STD_I32LE;
  expect_bad_hand(dir, "intfeatures.h5", h,
                  "'/features' holds int32; it must hold IEEE fp16 or fp32");
  h = Hand{};
  h.feature_type = H5T_IEEE_F64LE;
  expect_bad_hand(dir, "f64.h5", h, "holds a float of 8 bytes (11 exponent, 52 mantissa bits)");
  h = Hand{};
  h.feature_bf16 = true;
  expect_bad_hand(
      dir, "bf16.h5", h,
      "holds a float of 2 bytes (8 exponent, 7 mantissa bits); it must hold IEEE fp16 or fp32");
  h = Hand{};
  h.offsets_type = H5T_STD_I32LE;
  expect_bad_hand(dir, "int32offsets.h5", h,
                  "'/frame_offsets' holds int32; it must hold 64-bit signed integers (int64)");
  h = Hand{};
  h.offsets_type = H5T_STD_U64LE;
  expect_bad_hand(dir, "uint64offsets.h5", h, "holds uint64; it must hold 64-bit signed");
  h = Hand{};
  h.labels_type = H5T_STD_I64LE;
  expect_bad_hand(dir, "int64labels.h5", h,
                  "'/labels' holds int64; it must hold 32-bit signed integers (int32)");
}

TEST(SpeechFileErrors, AttributesAndShapesThatDisagree) {
  TempDir dir;
  for (const char* name : {"feature_dim", "vocab_size", "num_utterances", "num_eval",
                           "total_frames", "total_labels"}) {
    Hand h;
    h.skip.insert(name);
    expect_bad_hand(dir, std::string("no_") + name + ".h5", h,
                    std::string("the root attribute '") + name + "' is missing");
  }
  Hand h;
  h.attrs["num_utterances"] = 0;
  expect_bad_hand(dir, "zero.h5", h, "'num_utterances' is missing or not an integer >= 1");
  h = Hand{};
  h.attrs["num_eval"] = 4;
  expect_bad_hand(dir, "eval4.h5", h, "num_eval 4 is more than the 3 utterances");
  h = Hand{};
  h.attrs["num_eval"] = 3;
  expect_bad_hand(dir, "eval3.h5", h, "holds out all 3 utterances: none is left to train on");

  // Fewer rows than the attributes promise: a write that stopped early.
  h = Hand{};
  h.feature_dims = {10, 4};
  expect_bad_hand(dir, "short_features.h5", h,
                  "'/features' holds 10 frames but total_frames is 12: the file is truncated");
  h = Hand{};
  h.labels = {1, 2, 3, 4};
  expect_bad_hand(dir, "short_labels.h5", h,
                  "'/labels' holds 4 labels but total_labels is 5: the file is truncated");
  h = Hand{};
  h.feature_dims = {13, 4};
  expect_bad_hand(dir, "long_features.h5", h,
                  "'/features' has shape [13, 4] but the attributes say [total_frames 12");
  h = Hand{};
  h.feature_dims = {12, 5};
  expect_bad_hand(dir, "wide_features.h5", h, "feature_dim 4]");
  h = Hand{};
  h.labels.push_back(0);
  expect_bad_hand(dir, "long_labels.h5", h, "'/labels' has shape [6] but total_labels is 5");
  h = Hand{};
  h.frame_offsets = {0, 3, 12};
  expect_bad_hand(dir, "few_offsets.h5", h,
                  "'/frame_offsets' has shape [3] but num_utterances + 1 is 4");
  h = Hand{};
  h.label_offsets = {0, 2, 2, 5, 5};
  expect_bad_hand(dir, "many_offsets.h5", h,
                  "'/label_offsets' has shape [5] but num_utterances + 1 is 4");
}

TEST(SpeechFileErrors, TheModelsShapeAndLimits) {
  TempDir dir;
  write_hand(dir.file("good.h5"), Hand{});
  const std::string good = dir.file("good.h5");
  expect_bad(good, {8, 16, 0, 0}, "feature_dim 4 does not match the model's 8");
  expect_bad(good, {4, 9, 0, 0}, "vocabulary of 10 labels does not fit the model's 9");
  EXPECT_NO_THROW(SpeechFile(good, {4, 10, 5, 3}));  // limits equal to the longest are fine
  expect_bad(good, {4, 16, 4, 0}, "utterance 2 has 5 frames, more than the model's limit of 4");
  expect_bad(good, {4, 16, 0, 2}, "utterance 2 has 3 labels, more than the model's limit of 2");
}

TEST(SpeechFileErrors, OffsetsAndLengths) {
  TempDir dir;
  Hand h;
  h.frame_offsets = {1, 3, 7, 12};
  expect_bad_hand(dir, "start.h5", h, "'/frame_offsets' must start at 0 but starts at 1");
  h = Hand{};
  h.frame_offsets = {0, 8, 7, 12};
  expect_bad_hand(dir, "decreasing.h5", h,
                  "'/frame_offsets' is not monotonic: utterance 1 runs from 8 to 7");
  h = Hand{};
  h.label_offsets = {0, 3, 2, 5};
  expect_bad_hand(dir, "label_decreasing.h5", h,
                  "'/label_offsets' is not monotonic: utterance 1 runs from 3 to 2");
  h = Hand{};
  h.frame_offsets = {0, 3, 7, 11};
  expect_bad_hand(dir, "end.h5", h, "'/frame_offsets' ends at 11 but total_frames is 12");
  h = Hand{};
  h.label_offsets = {0, 2, 2, 4};
  expect_bad_hand(dir, "label_end.h5", h, "'/label_offsets' ends at 4 but total_labels is 5");
  h = Hand{};
  h.frame_offsets = {0, 3, 3, 12};
  expect_bad_hand(dir, "empty.h5", h, "utterance 1 has no frames");
}

TEST(SpeechFileErrors, LabelIdsOutsideTheVocabulary) {
  TempDir dir;
  Hand h;
  h.labels = {1, 2, 3, 10, 4};
  expect_bad_hand(dir, "high.h5", h,
                  "utterance 2, label 1 ('/labels' element 3) is id 10, outside the vocabulary "
                  "[0, 10)");
  h = Hand{};
  h.labels = {1, -1, 3, 4, 5};
  expect_bad_hand(dir, "negative.h5", h, "utterance 0, label 1 ('/labels' element 1) is id -1");
}

// Feature values are checked as they are read: the error names the utterance, frame and feature.
TEST(SpeechFileErrors, FeatureValuesFailOnRead) {
  TempDir dir;
  Hand h;
  h.feature_values.assign(48, 0.5f);
  h.feature_values[4 * 5 + 2] = NAN;   // row 5: utterance 1, frame 2
  h.feature_values[4 * 9 + 1] = 1e6f;  // row 9: utterance 2, frame 2
  write_hand(dir.file("values.h5"), h);
  const SpeechFile file(dir.file("values.h5"), kModel);
  std::vector<float> f(5 * 4);
  EXPECT_NO_THROW(file.read_features(0, FeatureType::kFP32, f.data()));
  auto expect_read_error = [&](int64_t i, FeatureType type, const std::string& problem) {
    try {
      file.read_features(i, type, f.data());
      ADD_FAILURE() << "expected: " << problem;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
    }
  };
  expect_read_error(1, FeatureType::kFP32, "utterance 1, frame 2, feature 2 is nan");
  expect_read_error(1, FeatureType::kFP16, "utterance 1, frame 2, feature 2 is nan");
  EXPECT_NO_THROW(file.read_features(2, FeatureType::kFP32, f.data()));  // 1e6 is a fine fp32
  expect_read_error(2, FeatureType::kFP16,
                    "utterance 2, frame 2, feature 1 is 1000000.000000, beyond fp16's range "
                    "('/features' row 9)");
}

// A damaged chunk: HDF5's Fletcher32 check fails the read, and the error names the utterance.
TEST(SpeechFileErrors, ChecksumMismatchFailsTheRead) {
  TempDir dir;
  const SpeechDatasetParams p = small_params(FeatureType::kFP16);
  const std::string path = dir.file("damaged.h5");
  generate_speech_dataset(path, p);
  haddr_t address = 0;
  hsize_t size = 0;
  {
    H5Guard guard;
    H5Id file = REPLAY_H5_OWN(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    H5Id features = REPLAY_H5_OWN(H5Dopen2(file.get(), "features", H5P_DEFAULT), H5Dclose);
    const hsize_t origin[2] = {0, 0};
    unsigned mask = 0;
    REPLAY_HDF5_CHECK(H5Dget_chunk_info_by_coord(features.get(), origin, &mask, &address, &size));
  }
  ASSERT_GT(size, 16u);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(address + 8));
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x55);
    f.seekp(static_cast<std::streamoff>(address + 8));
    f.write(&byte, 1);
  }
  const SpeechFile file(path, shape_of(p));  // the offsets and labels are intact
  std::vector<uint16_t> f(static_cast<size_t>(file.frame_length(0) * p.feature_dim));
  try {
    file.read_features(0, FeatureType::kFP16, f.data());
    ADD_FAILURE() << "a damaged chunk must fail the read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reading '/features' of utterance 0 failed"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace replay::rnnt
