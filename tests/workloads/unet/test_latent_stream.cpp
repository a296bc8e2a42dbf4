// LatentStream on the CPU (host_only: the ring, the order and the reads without a GPU): every batch
// it hands out is the file's samples of that batch of common/data's BatchOrder, bit for bit, across
// epochs and after wrapping the ring many times; seek starts the order elsewhere (a resumed run);
// bf16 text is the fp16 text rounded to bf16; a split too small for one batch and a seek after the
// first batch are errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/data/batch_stream.h"
#include "workloads/unet/fp16_bits.h"
#include "workloads/unet/latent_file.h"
#include "workloads/unet/latent_generate.h"
#include "workloads/unet/latent_stream.h"

namespace replay::unet {
namespace {

namespace fs = std::filesystem;

class LatentStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("replay-latent-stream-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    params_.num_samples = 45;  // the default held-out split keeps 43 for training
    params_.latent_channels = 4;
    params_.latent_height = 4;
    params_.latent_width = 4;
    params_.context_len = 3;
    params_.context_dim = 8;
    params_.num_classes = 3;
    params_.seed = 7;
    path_ = (dir_ / "latents.h5").string();
    generate_latent_dataset(path_, params_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  LatentDataShape shape(int64_t batch) const {
    LatentDataShape s;
    s.micro_batch = batch;
    s.latent_channels = params_.latent_channels;
    s.latent_height = params_.latent_height;
    s.latent_width = params_.latent_width;
    s.context_len = params_.context_len;
    s.context_dim = params_.context_dim;
    return s;
  }

  fs::path dir_;
  std::string path_;
  LatentDatasetParams params_;
};

LatentStreamOptions host_options(uint64_t seed) {
  LatentStreamOptions o;
  o.seed = seed;
  o.ring_slots = 3;
  o.host_only = true;
  return o;
}

// Batch `index` as the file holds it: BatchOrder's rows, read one by one.
void expected_batch(const LatentFile& file, int64_t samples, const LatentDataShape& s,
                    uint64_t seed, int64_t index, std::vector<uint16_t>& moments,
                    std::vector<uint16_t>& text) {
  data::BatchOrder order(samples, s.micro_batch, true, seed);
  std::vector<int64_t> rows(static_cast<size_t>(s.micro_batch));
  order.rows(index, rows.data());
  moments.assign(static_cast<size_t>(s.micro_batch * s.moment_elements()), 0);
  text.assign(static_cast<size_t>(s.micro_batch * s.text_elements()), 0);
  for (int64_t i = 0; i < s.micro_batch; ++i)
    file.read_samples(rows[static_cast<size_t>(i)], 1, moments.data() + i * s.moment_elements(),
                      text.data() + i * s.text_elements());
}

TEST_F(LatentStreamTest, BatchesAreTheOrdersSamplesAcrossEpochsAndRingWraps) {
  const LatentDataShape s = shape(4);
  const LatentFile file(path_, s);
  const int64_t samples = file.info().training_samples();
  ASSERT_GT(samples, 8);
  LatentStream stream(path_, s, host_options(11));
  EXPECT_EQ(stream.num_samples(), samples);
  const int64_t per_epoch = samples / 4;
  std::vector<uint16_t> m(static_cast<size_t>(4 * s.moment_elements()));
  std::vector<uint16_t> t(static_cast<size_t>(4 * s.text_elements()));
  std::vector<uint16_t> em, et;
  for (int64_t b = 0; b < 3 * per_epoch + 2; ++b) {  // three epochs and more, the ring many times
    SCOPED_TRACE(b);
    EXPECT_EQ(stream.position(), b);
    stream.next(nullptr, m.data(), t.data());
    expected_batch(file, samples, s, 11, b, em, et);
    ASSERT_EQ(m, em);
    ASSERT_EQ(t, et);
  }
  EXPECT_EQ(stream.delivered(), 3 * per_epoch + 2);
  // A different seed is a different order.
  LatentStream other(path_, s, host_options(12));
  std::vector<uint16_t> m0 = m;
  LatentStream again(path_, s, host_options(11));
  other.next(nullptr, m.data(), t.data());
  again.next(nullptr, m0.data(), t.data());
  EXPECT_NE(m, m0);
}

TEST_F(LatentStreamTest, SeekStartsTheOrderAtThatBatchOnlyBeforeTheFirst) {
  const LatentDataShape s = shape(4);
  const LatentFile file(path_, s);
  const int64_t samples = file.info().training_samples();
  LatentStream stream(path_, s, host_options(5));
  stream.seek(7);
  EXPECT_EQ(stream.position(), 7);
  std::vector<uint16_t> m(static_cast<size_t>(4 * s.moment_elements()));
  std::vector<uint16_t> t(static_cast<size_t>(4 * s.text_elements()));
  std::vector<uint16_t> em, et;
  stream.next(nullptr, m.data(), t.data());
  expected_batch(file, samples, s, 5, 7, em, et);
  EXPECT_EQ(m, em);
  EXPECT_EQ(t, et);
  EXPECT_EQ(stream.position(), 8);
  EXPECT_THROW(stream.seek(0), Error);
}

TEST_F(LatentStreamTest, Bf16TextIsTheFp16TextRounded) {
  const LatentDataShape s = shape(2);
  const LatentFile file(path_, s);
  LatentStreamOptions o = host_options(3);
  o.text_bf16 = true;
  LatentStream stream(path_, s, o);
  std::vector<uint16_t> m(static_cast<size_t>(2 * s.moment_elements()));
  std::vector<uint16_t> t(static_cast<size_t>(2 * s.text_elements()));
  stream.next(nullptr, m.data(), t.data());
  std::vector<uint16_t> em, et;
  expected_batch(file, file.info().training_samples(), s, 3, 0, em, et);
  EXPECT_EQ(m, em);  // moments stay fp16
  int changed = 0;
  for (size_t i = 0; i < et.size(); ++i) {
    EXPECT_EQ(t[i], float_to_bf16_bits(half_bits_to_float(et[i]))) << i;
    changed += t[i] != et[i] ? 1 : 0;
  }
  EXPECT_GT(changed, 0);
}

TEST_F(LatentStreamTest, TooFewSamplesForABatchIsAnError) {
  LatentStreamOptions o = host_options(1);
  o.num_samples = 3;
  EXPECT_THROW(LatentStream(path_, shape(4), o), Error);
  o.num_samples = 1000;  // more than the training split
  EXPECT_THROW(LatentStream(path_, shape(4), o), Error);
}

}  // namespace
}  // namespace replay::unet
