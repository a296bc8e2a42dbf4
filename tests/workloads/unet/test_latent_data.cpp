// The UNet's data files on the CPU: the synthetic source's round trip through the writer and the
// reader (every sample bit for bit, shuffled batches, the held-out split, the attributes), its
// determinism and statistics (unit mean square latents, layer-normed tokens, the class tied to the
// latent), atomic writes and cancels, fp32 files, and every validation error the reader raises,
// each naming the file and the problem.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/data/h5.h"
#include "workloads/unet/diffusion_reference.h"
#include "workloads/unet/fp16_bits.h"
#include "workloads/unet/latent_file.h"
#include "workloads/unet/latent_generate.h"

namespace replay::unet {
namespace {

namespace fs = std::filesystem;
using data::H5Guard;
using data::H5Id;

class LatentData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("replay-latents-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

LatentDatasetParams small_params() {
  LatentDatasetParams p;
  p.num_samples = 40;
  p.latent_channels = 4;
  p.latent_height = 8;
  p.latent_width = 8;
  p.context_len = 8;
  p.context_dim = 32;
  p.num_classes = 4;
  p.seed = 99;
  return p;
}

LatentDataShape shape_of(const LatentDatasetParams& p, int64_t micro_batch = 4) {
  LatentDataShape s;
  s.micro_batch = micro_batch;
  s.latent_channels = p.latent_channels;
  s.latent_height = p.latent_height;
  s.latent_width = p.latent_width;
  s.context_len = p.context_len;
  s.context_dim = p.context_dim;
  return s;
}

// Runs `f`, which must throw an Error whose message contains `needle` and the file's path.
::testing::AssertionResult fails_with(const std::function<void()>& f, const std::string& needle,
                                      const std::string& file) {
  try {
    f();
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message lacks '" << needle << "': " << what;
    if (!file.empty() && what.find(file) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not name the file: " << what;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no error (expected '" << needle << "')";
}

// ---------------------------------------------------------------------------------------------------
// Round trip and the source

TEST_F(LatentData, GeneratorAndReaderRoundTripEverySample) {
  const LatentDatasetParams p = small_params();
  const std::string file = path("small.h5");
  const LatentFileInfo written = generate_latent_dataset(file, p);
  ASSERT_TRUE(fs::exists(file));
  const LatentFile f(file, shape_of(p));
  const LatentFileInfo& info = f.info();
  EXPECT_EQ(info.num_samples, 40);
  EXPECT_EQ(info.held_out_samples, 2);  // min(64, 40 / 16)
  EXPECT_EQ(info.training_samples(), 38);
  EXPECT_FALSE(info.moments_fp32);
  EXPECT_FALSE(info.text_fp32);
  EXPECT_EQ(info.provenance.seed, std::optional<uint64_t>(99));
  EXPECT_EQ(info.provenance.num_classes, 4);
  EXPECT_DOUBLE_EQ(info.provenance.class_share, 0.5);
  EXPECT_DOUBLE_EQ(info.provenance.loss_floor, ref::gaussian_v_loss_floor(0.5));
  EXPECT_DOUBLE_EQ(written.provenance.loss_floor, info.provenance.loss_floor);
  EXPECT_NE(info.provenance.loss_floor_method.find("exact"), std::string::npos);
  EXPECT_NE(info.provenance.generator.find("4 classes"), std::string::npos);

  const LatentDataShape s = shape_of(p);
  const auto pm = static_cast<size_t>(s.moment_elements());
  const auto pt = static_cast<size_t>(s.text_elements());
  std::vector<uint16_t> m(40 * pm), t(40 * pt);
  f.read_samples(0, 40, m.data(), t.data());
  const LatentSource source(p);
  std::vector<uint16_t> em(pm), et(pt);
  for (int64_t i = 0; i < 40; ++i) {
    source.sample(i, em.data(), et.data());
    ASSERT_TRUE(std::equal(em.begin(), em.end(), m.begin() + static_cast<int64_t>(i * pm))) << i;
    ASSERT_TRUE(std::equal(et.begin(), et.end(), t.begin() + static_cast<int64_t>(i * pt))) << i;
  }

  // A shuffled batch with a run of consecutive samples, and one dataset skipped.
  const std::vector<int64_t> batch = {7, 8, 9, 0, 39, 12};
  std::vector<uint16_t> bm(batch.size() * pm), bt(batch.size() * pt);
  f.read_batch(batch.data(), static_cast<int64_t>(batch.size()), bm.data(), bt.data());
  std::vector<uint16_t> only_text(batch.size() * pt);
  f.read_batch(batch.data(), static_cast<int64_t>(batch.size()), nullptr, only_text.data());
  EXPECT_EQ(only_text, bt);
  for (size_t k = 0; k < batch.size(); ++k) {
    const auto i = static_cast<size_t>(batch[k]);
    ASSERT_TRUE(std::equal(bm.begin() + k * pm, bm.begin() + (k + 1) * pm, m.begin() + i * pm));
    ASSERT_TRUE(std::equal(bt.begin() + k * pt, bt.begin() + (k + 1) * pt, t.begin() + i * pt));
  }
}

TEST_F(LatentData, SameSeedSameBitsOtherSeedOtherBits) {
  LatentDatasetParams p = small_params();
  const LatentDataShape s = shape_of(p);
  auto read_all = [&](const std::string& file) {
    const LatentFile f(file, s);
    std::vector<uint16_t> m(static_cast<size_t>(40 * s.moment_elements()));
    std::vector<uint16_t> t(static_cast<size_t>(40 * s.text_elements()));
    f.read_samples(0, 40, m.data(), t.data());
    m.insert(m.end(), t.begin(), t.end());
    return m;
  };
  generate_latent_dataset(path("a.h5"), p);
  generate_latent_dataset(path("b.h5"), p);
  p.seed = 100;
  generate_latent_dataset(path("c.h5"), p);
  const std::vector<uint16_t> a = read_all(path("a.h5")), b = read_all(path("b.h5"));
  const std::vector<uint16_t> c = read_all(path("c.h5"));
  EXPECT_EQ(a, b);
  size_t same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i] == c[i];
  EXPECT_LT(same, a.size() / 20);
}

TEST_F(LatentData, SourceHasPlausibleStatisticsAndAClassTiedToTheText) {
  LatentDatasetParams p = small_params();
  p.num_samples = 96;
  p.latent_height = 16;
  p.latent_width = 16;
  p.context_len = 12;
  p.context_dim = 64;
  p.num_classes = 6;
  const LatentSource source(p);
  const int64_t C = 4, HW = 256, CHW = C * HW, L = 12, D = 64;
  std::vector<uint16_t> m(static_cast<size_t>(2 * CHW)), t(static_cast<size_t>(L * D));
  double mean_square = 0.0, logvar_sum = 0.0;
  std::vector<std::vector<float>> starts;
  std::vector<std::vector<std::vector<float>>> tokens_of_class(6);
  int own_best = 0;
  const double scale = 0.18215;
  for (int64_t i = 0; i < p.num_samples; ++i) {
    const int64_t k = source.sample(i, m.data(), t.data());
    ASSERT_GE(k, 0);
    ASSERT_LT(k, 6);
    // The scaled latent mean: mean square about 1 over the file, sqrt(share) of it the class.
    std::vector<double> x(static_cast<size_t>(CHW));
    for (int64_t e = 0; e < CHW; ++e) {
      x[static_cast<size_t>(e)] = scale * half_bits_to_float(m[static_cast<size_t>(e)]);
      mean_square += x[static_cast<size_t>(e)] * x[static_cast<size_t>(e)];
      logvar_sum += half_bits_to_float(m[static_cast<size_t>(CHW + e)]);
    }
    // The sample correlates best with its own class's pattern.
    int64_t best = -1;
    double best_corr = -2.0;
    for (int64_t j = 0; j < 6; ++j) {
      const double* pj = source.pattern(j);
      double xy = 0.0, xx = 0.0, yy = 0.0;
      for (int64_t e = 0; e < CHW; ++e) {
        xy += x[static_cast<size_t>(e)] * pj[e];
        xx += x[static_cast<size_t>(e)] * x[static_cast<size_t>(e)];
        yy += pj[e] * pj[e];
      }
      const double corr = xy / std::sqrt(xx * yy);
      if (corr > best_corr) {
        best_corr = corr;
        best = j;
      }
    }
    own_best += best == k;
    // Every token layer-normed over D: mean 0, variance 1 (to fp16's rounding).
    for (int64_t j = 0; j < L; ++j) {
      double s1 = 0.0, s2 = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double v = half_bits_to_float(t[static_cast<size_t>(j * D + d)]);
        s1 += v;
        s2 += v * v;
      }
      EXPECT_NEAR(s1 / D, 0.0, 2e-3);
      EXPECT_NEAR(s2 / D - (s1 / D) * (s1 / D), 1.0, 2e-3);
    }
    std::vector<std::vector<float>> tokens(static_cast<size_t>(L), std::vector<float>(D));
    for (int64_t j = 0; j < L; ++j)
      for (int64_t d = 0; d < D; ++d)
        tokens[static_cast<size_t>(j)][static_cast<size_t>(d)] =
            half_bits_to_float(t[static_cast<size_t>(j * D + d)]);
    starts.push_back(tokens[0]);
    if (tokens_of_class[static_cast<size_t>(k)].empty())
      tokens_of_class[static_cast<size_t>(k)] = tokens;
    else {
      // Two captions of one class share the class word: some pair of their tokens nearly equal.
      const auto& other = tokens_of_class[static_cast<size_t>(k)];
      double best_cos = -1.0;
      for (const auto& a : tokens)
        for (const auto& b : other) {
          double ab = 0.0;
          for (int64_t d = 0; d < D; ++d)
            ab += a[static_cast<size_t>(d)] * b[static_cast<size_t>(d)];
          best_cos = std::max(best_cos, ab / D);  // unit variance, zero mean: ab / D is the cosine
        }
      EXPECT_GT(best_cos, 0.95) << "sample " << i;
    }
  }
  const double n = static_cast<double>(p.num_samples * CHW);
  EXPECT_NEAR(mean_square / n, 1.0, 0.06);
  EXPECT_NEAR(logvar_sum / n, -5.8, 0.01);
  EXPECT_EQ(own_best, p.num_samples);
  // The start token is the same word in every caption.
  for (const auto& s : starts) {
    double ab = 0.0;
    for (int64_t d = 0; d < D; ++d)
      ab += s[static_cast<size_t>(d)] * starts[0][static_cast<size_t>(d)];
    EXPECT_GT(ab / D, 0.97);
  }
}

TEST_F(LatentData, DefaultPathNamesEveryParameter) {
  LatentDatasetParams p;
  EXPECT_EQ(default_latent_dataset_path(p, "/d"),
            "/d/latents-c4-h64-w64-l77-d1024-n1024-k16-s500-seed1234.h5");
  p.held_out_samples = 8;
  p.class_share = 0.25;
  EXPECT_EQ(default_latent_dataset_path(p, "/d"),
            "/d/latents-c4-h64-w64-l77-d1024-n1024-k16-s250-seed1234-ho8.h5");
  const std::string made = ensure_latent_dataset(small_params(), dir_.string());
  EXPECT_EQ(made, default_latent_dataset_path(small_params(), dir_.string()));
  EXPECT_TRUE(fs::exists(made));
  const auto stamp = fs::last_write_time(made);
  EXPECT_EQ(ensure_latent_dataset(small_params(), dir_.string()), made);  // reused, not rewritten
  EXPECT_EQ(fs::last_write_time(made), stamp);
}

// ---------------------------------------------------------------------------------------------------
// Atomic writes

TEST_F(LatentData, NothingUnderTheFinalNameWithoutCommitOrOnCancel) {
  const std::string file = path("never.h5");
  std::string temp;
  {
    LatentFileDims dims;
    dims.num_samples = 4;
    dims.latent_height = dims.latent_width = 4;
    dims.context_len = 4;
    dims.context_dim = 8;
    LatentFileWriter w(file, dims);
    temp = w.temp_path();
    EXPECT_TRUE(fs::exists(temp));
    EXPECT_FALSE(fs::exists(file));
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_FALSE(fs::exists(file));

  LatentDatasetParams p = small_params();
  int calls = 0;
  EXPECT_TRUE(fails_with(
      [&] { generate_latent_dataset(file, p, [&](int64_t, int64_t) { return ++calls < 1; }); },
      "was not written", file));
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(fs::is_empty(dir_)) << "the cancelled generation left files behind";
}

// ---------------------------------------------------------------------------------------------------
// Files made by hand: validation

enum class Elem { kFP16, kFP32, kInt32, kBF16 };

H5Id file_type(Elem e) {
  switch (e) {
    case Elem::kFP16:
      return make_fp16_type();
    case Elem::kFP32:
      return H5Id(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    case Elem::kInt32:
      return H5Id(H5Tcopy(H5T_STD_I32LE), H5Tclose);
    case Elem::kBF16: {
      H5Id t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
      H5Tset_fields(t.get(), 15, 7, 8, 0, 7);
      H5Tset_size(t.get(), 2);
      H5Tset_ebias(t.get(), 127);
      return t;
    }
  }
  return H5Id();
}

// A latent file written with raw HDF5 calls, every part adjustable.
struct RawFile {
  int64_t N = 20, C = 4, H = 4, W = 4, L = 4, D = 8;
  std::vector<hsize_t> moments_dims, text_dims;  // empty: the right ones
  Elem moments_elem = Elem::kFP16, text_elem = Elem::kFP16;
  bool has_moments = true, has_text = true;
  std::string format = kLatentFormatName;
  int64_t version = kLatentFormatVersion;
  std::vector<std::string> skip_attrs;
  int64_t held_out = -1;      // -1: no attribute
  double scale_factor = 0.0;  // 0: no attribute
  std::function<float(int64_t)> value = [](int64_t i) {
    return 0.01f * static_cast<float>(i % 97);
  };

  void write(const std::string& path) const {
    H5Guard guard;
    H5Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    ASSERT_GE(file.get(), 0);
    auto dataset = [&](const char* name, std::vector<hsize_t> dims, Elem e) {
      H5Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
      H5Id type = file_type(e);
      H5Id d(H5Dcreate2(file.get(), name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT,
                        H5P_DEFAULT),
             H5Dclose);
      hsize_t n = 1;
      for (hsize_t x : dims) n *= x;
      if (e == Elem::kInt32) {
        std::vector<int32_t> v(n, 1);
        H5Dwrite(d.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
      } else {
        std::vector<float> v(n);
        for (hsize_t i = 0; i < n; ++i) v[i] = value(static_cast<int64_t>(i));
        if (e == Elem::kFP16) {
          std::vector<uint16_t> h(n);
          for (hsize_t i = 0; i < n; ++i) h[i] = float_to_half_bits(v[i]);
          H5Dwrite(d.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, h.data());
        } else if (e == Elem::kFP32) {
          H5Dwrite(d.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
        }
      }
    };
    const auto n = static_cast<hsize_t>(N);
    if (has_moments)
      dataset(kMomentsDataset,
              moments_dims.empty()
                  ? std::vector<hsize_t>{n, static_cast<hsize_t>(2 * C), static_cast<hsize_t>(H),
                                         static_cast<hsize_t>(W)}
                  : moments_dims,
              moments_elem);
    if (has_text)
      dataset(kTextDataset,
              text_dims.empty()
                  ? std::vector<hsize_t>{n, static_cast<hsize_t>(L), static_cast<hsize_t>(D)}
                  : text_dims,
              text_elem);
    H5Id root(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);
    auto skip = [&](const std::string& name) {
      return std::find(skip_attrs.begin(), skip_attrs.end(), name) != skip_attrs.end();
    };
    if (!skip("format")) data::write_attr(root.get(), "format", format);
    if (!skip("format_version")) data::write_attr(root.get(), "format_version", version);
    const std::pair<const char*, int64_t> ints[] = {{"num_samples", N},   {"latent_channels", C},
                                                    {"latent_height", H}, {"latent_width", W},
                                                    {"context_len", L},   {"context_dim", D}};
    for (const auto& [name, v] : ints)
      if (!skip(name)) data::write_attr(root.get(), name, v);
    if (held_out >= 0) data::write_attr(root.get(), "held_out_samples", held_out);
    if (scale_factor != 0.0) data::write_attr(root.get(), "scale_factor", scale_factor);
  }

  LatentDataShape shape(int64_t micro_batch = 2) const {
    LatentDataShape s;
    s.micro_batch = micro_batch;
    s.latent_channels = C;
    s.latent_height = H;
    s.latent_width = W;
    s.context_len = L;
    s.context_dim = D;
    return s;
  }
};

TEST_F(LatentData, AHandMadeFileOpensAndReads) {
  RawFile raw;
  const std::string file = path("raw.h5");
  raw.write(file);
  const LatentFile f(file, raw.shape());
  EXPECT_EQ(f.info().num_samples, 20);
  EXPECT_EQ(f.info().held_out_samples, 1);  // min(64, 20 / 16)
  EXPECT_DOUBLE_EQ(f.info().scale_factor, 0.18215);
  std::vector<uint16_t> m(static_cast<size_t>(2 * f.shape().moment_elements()));
  f.read_samples(3, 2, m.data(), nullptr);
  const int64_t base = 3 * f.shape().moment_elements();
  for (size_t i = 0; i < m.size(); ++i)
    ASSERT_EQ(m[i], float_to_half_bits(raw.value(base + static_cast<int64_t>(i)))) << i;
}

TEST_F(LatentData, Fp32FilesAreRoundedToFp16AndOutOfRangeValuesRefused) {
  RawFile raw;
  raw.moments_elem = Elem::kFP32;
  raw.text_elem = Elem::kFP32;
  raw.value = [](int64_t i) { return 1.0f + static_cast<float>(i) * 1.2345e-4f; };
  const std::string file = path("fp32.h5");
  raw.write(file);
  const LatentFile f(file, raw.shape());
  EXPECT_TRUE(f.info().moments_fp32);
  EXPECT_TRUE(f.info().text_fp32);
  std::vector<uint16_t> t(static_cast<size_t>(f.shape().text_elements()));
  f.read_samples(5, 1, nullptr, t.data());
  const int64_t base = 5 * f.shape().text_elements();
  for (size_t i = 0; i < t.size(); ++i)
    ASSERT_EQ(t[i], float_to_half_bits(raw.value(base + static_cast<int64_t>(i)))) << i;

  raw.value = [](int64_t i) { return i == 200 ? 70000.0f : 1.0f; };
  const std::string big = path("fp32-big.h5");  // f still holds the first file open
  raw.write(big);
  const LatentFile g(big, raw.shape());
  std::vector<uint16_t> m(static_cast<size_t>(4 * g.shape().moment_elements()));
  // Element 200 of the file is element 72 of sample 1 (128 moments a sample): channel 4 (the
  // log-variance's channel 0), row 2, column 0.
  EXPECT_TRUE(fails_with([&] { g.read_samples(0, 4, m.data(), nullptr); },
                         "sample 1 of '/moments', log-variance channel 0 at (2, 0) holds 70000",
                         big));
}

TEST_F(LatentData, NonFiniteValuesAreNamedAtTheRead) {
  RawFile raw;
  // Sample 3's text, token 2, channel 5: element 3 * 32 + 2 * 8 + 5.
  raw.value = [](int64_t i) { return i == 3 * 32 + 2 * 8 + 5 ? NAN : 0.5f; };
  const std::string file = path("nan.h5");
  raw.write(file);
  const LatentFile f(file, raw.shape());
  std::vector<uint16_t> t(static_cast<size_t>(4 * f.shape().text_elements()));
  EXPECT_NO_THROW(f.read_samples(0, 3, nullptr, t.data()));
  EXPECT_TRUE(fails_with([&] { f.read_samples(2, 2, nullptr, t.data()); },
                         "sample 3 of '/text_embeddings', token 2, channel 5 holds a NaN", file));
  // Moments: sample 0, mean channel 1 at (2, 3) is element 1 * 16 + 2 * 4 + 3 = 27.
  raw.value = [](int64_t i) { return i == 27 ? INFINITY : 0.5f; };
  const std::string inf = path("inf.h5");
  raw.write(inf);
  const LatentFile g(inf, raw.shape());
  std::vector<uint16_t> m(static_cast<size_t>(g.shape().moment_elements()));
  EXPECT_TRUE(fails_with([&] { g.read_samples(0, 1, m.data(), nullptr); },
                         "sample 0 of '/moments', mean channel 1 at (2, 3) holds a NaN or an "
                         "infinity",
                         inf));
}

struct BadCase {
  std::string name;
  std::function<void(RawFile&)> change;
  std::string message;
  int64_t micro_batch = 2;
  std::function<void(LatentDataShape&)> model = [](LatentDataShape&) {};
};

TEST_F(LatentData, EveryValidationErrorNamesTheFileAndTheProblem) {
  const std::string missing = path("missing.h5");
  EXPECT_TRUE(
      fails_with([&] { (void)LatentFile(missing, RawFile().shape()); }, "no such file", missing));
  EXPECT_TRUE(fails_with([&] { (void)LatentFile(dir_.string(), RawFile().shape()); },
                         "not a regular file", dir_.string()));
  const std::string text = path("text.h5");
  std::ofstream(text) << "not hdf5\n";
  EXPECT_TRUE(
      fails_with([&] { (void)LatentFile(text, RawFile().shape()); }, "not an HDF5 file", text));

  const std::vector<BadCase> cases = {
      {"no_format", [](RawFile& r) { r.skip_attrs = {"format"}; },
       "the root attribute 'format' is missing, not 'replay-latents'"},
      {"other_format", [](RawFile& r) { r.format = "replay-tokens"; },
       "the root attribute 'format' is 'replay-tokens'"},
      {"version", [](RawFile& r) { r.version = 2; },
       "format_version is 2; this build reads version 1"},
      {"no_text", [](RawFile& r) { r.has_text = false; }, "no dataset '/text_embeddings'"},
      {"no_moments", [](RawFile& r) { r.has_moments = false; }, "no dataset '/moments'"},
      {"moments_rank",
       [](RawFile& r) {
         r.moments_dims = {20, 8, 16};
       },
       "'/moments' has rank 3, expected 4"},
      {"text_rank",
       [](RawFile& r) {
         r.text_dims = {20, 32};
       },
       "'/text_embeddings' has rank 2, expected 3"},
      {"moments_int", [](RawFile& r) { r.moments_elem = Elem::kInt32; },
       "'/moments' must hold IEEE fp16 or fp32 floats"},
      {"text_bf16", [](RawFile& r) { r.text_elem = Elem::kBF16; },
       "'/text_embeddings' must hold IEEE fp16 or fp32 floats"},
      {"no_context_dim", [](RawFile& r) { r.skip_attrs = {"context_dim"}; },
       "the root attribute 'context_dim' is missing or not a positive integer"},
      {"nhwc_moments",
       [](RawFile& r) {
         r.moments_dims = {20, 4, 4, 8};
       },
       "'/moments' has shape [20, 4, 4, 8] but the attributes say [20, 8, 4, 4]"},
      {"short_text",
       [](RawFile& r) {
         r.text_dims = {19, 4, 8};
       },
       "'/text_embeddings' has shape [19, 4, 8] but the attributes say [20, 4, 8]"},
      {"held_out_all", [](RawFile& r) { r.held_out = 20; },
       "held_out_samples must be an integer in [0, num_samples = 20)"},
      {"other_vae", [](RawFile& r) { r.scale_factor = 0.13025; },
       "the latents were made for another VAE"},
      {"context_dim", [](RawFile&) {}, "context_dim is 8 but the model's is 1024", 2,
       [](LatentDataShape& s) { s.context_dim = 1024; }},
      {"latent_size", [](RawFile&) {}, "latent_height is 4 but the model's is 64", 2,
       [](LatentDataShape& s) { s.latent_height = 64; }},
      {"micro_batch", [](RawFile& r) { r.held_out = 4; },
       "holds 16 training samples (20 less 4 held out), fewer than one micro-batch of 17", 17},
  };
  for (const BadCase& c : cases) {
    RawFile raw;
    c.change(raw);
    const std::string file = path(c.name + ".h5");
    raw.write(file);
    LatentDataShape shape = raw.shape(c.micro_batch);
    c.model(shape);
    EXPECT_TRUE(fails_with([&] { (void)LatentFile(file, shape); }, c.message, file)) << c.name;
  }
}

}  // namespace
}  // namespace replay::unet
