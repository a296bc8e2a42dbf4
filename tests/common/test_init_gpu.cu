// Device initialisation against a host computation of the same Philox draws.
#include "common/kernels/init.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/philox.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

std::vector<double> host_normal(int64_t n, uint64_t seed, uint64_t stream_id, double mean,
                                double sd) {
  std::vector<double> out(n);
  for (int64_t blk = 0; blk < (n + 3) / 4; ++blk) {
    const Philox4 r = philox_block(seed, stream_id, blk);
    const uint32_t bits[4] = {r.x, r.y, r.z, r.w};
    for (int p = 0; p < 2; ++p) {
      const double u1 = philox_uniform(bits[2 * p]), u2 = philox_uniform(bits[2 * p + 1]);
      const double rad = std::sqrt(-2.0 * std::log(u1));
      const double vals[2] = {mean + sd * rad * std::cos(2 * M_PI * u2),
                              mean + sd * rad * std::sin(2 * M_PI * u2)};
      for (int j = 0; j < 2; ++j)
        if (4 * blk + 2 * p + j < n) out[4 * blk + 2 * p + j] = vals[j];
    }
  }
  return out;
}

TEST(Init, NormalMatchesHostDrawsFp32AndBf16) {
  const int64_t n = 100003;  // not a multiple of 4
  test::DeviceBuffer<float> f(n);
  test::DeviceBuffer<__nv_bfloat16> h(n);
  init_normal(TensorView(f.get(), DType::kFP32, {n}), 1234, 7, 0.5f, 2.0f, nullptr);
  init_normal(TensorView(h.get(), DType::kBF16, {n}), 1234, 7, 0.5f, 2.0f, nullptr);
  const std::vector<double> ref = host_normal(n, 1234, 7, 0.5, 2.0);
  EXPECT_TRUE(test::all_close("init_normal fp32", f.download(), ref, {1e-4, 1e-4}));
  EXPECT_TRUE(
      test::all_close("init_normal bf16", test::from_bf16(h.download()), ref, {1e-2, 8e-3}));
  double mean = 0;
  for (double v : ref) mean += v / n;
  EXPECT_NEAR(mean, 0.5, 0.05);
}

TEST(Init, UniformAndConstantFillEverything) {
  const int64_t n = 4097;
  test::DeviceBuffer<float> u(n), c(n);
  init_uniform(TensorView(u.get(), DType::kFP32, {n}), 9, 0, -3.0f, 5.0f, nullptr);
  init_constant(TensorView(c.get(), DType::kFP32, {n}), 0.25f, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float v : u.download()) {
    ASSERT_GE(v, -3.0f);
    ASSERT_LT(v, 5.0f);
  }
  for (float v : c.download()) ASSERT_EQ(v, 0.25f);
}

// Tensor-parallel shards: a fused [q; k; v] weight split by rows in three sections (GQA: q twice as
// tall as k and v) and a row-parallel weight split by columns, over 3 ranks. Every rank's shard,
// drawn alone, is bitwise the matching slice of the whole tensor drawn by init_normal (fp32 and
// bf16), so the shards of a tensor-parallel run hold what one process draws.
TEST(Init, SliceShardsAreBitwiseSlicesOfTheFullTensor) {
  const int ranks = 3;
  const int64_t q = 4, kv = 2, cols = 10;  // per rank: rows of q, of k and of v
  const int64_t full_rows = (q + 2 * kv) * ranks;
  test::DeviceBuffer<float> full(full_rows * cols);
  test::DeviceBuffer<__nv_bfloat16> full_h(full_rows * cols);
  init_normal(TensorView(full.get(), DType::kFP32, {full_rows, cols}), 77, 5, 0.0f, 0.02f, nullptr);
  init_normal(TensorView(full_h.get(), DType::kBF16, {full_rows, cols}), 77, 5, 0.0f, 0.02f,
              nullptr);
  const std::vector<float> whole = full.download();
  const std::vector<__nv_bfloat16> whole_h = full_h.download();
  const int64_t local[3] = {q, kv, kv};
  for (int r = 0; r < ranks; ++r) {
    InitSlice s;
    s.sections = 3;
    int64_t at = 0;
    for (int k = 0; k < 3; ++k) {
      s.rows[k] = local[k];
      s.full_row[k] = at + r * local[k];
      at += local[k] * ranks;
    }
    s.cols = s.full_cols = cols;
    const int64_t n = (q + 2 * kv) * cols;
    test::DeviceBuffer<float> shard(n);
    test::DeviceBuffer<__nv_bfloat16> shard_h(n);
    init_normal_slice(TensorView(shard.get(), DType::kFP32, {q + 2 * kv, cols}), s, 77, 5, 0.0f,
                      0.02f, nullptr);
    init_normal_slice(TensorView(shard_h.get(), DType::kBF16, {q + 2 * kv, cols}), s, 77, 5, 0.0f,
                      0.02f, nullptr);
    const std::vector<float> got = shard.download();
    const std::vector<__nv_bfloat16> got_h = shard_h.download();
    int64_t row = 0;
    for (int k = 0; k < 3; ++k)
      for (int64_t j = 0; j < local[k]; ++j, ++row)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t g = (s.full_row[k] + j) * cols + c;
          ASSERT_EQ(got[row * cols + c], whole[g])
              << "rank " << r << " row " << row << " col " << c;
          ASSERT_EQ(__bfloat162float(got_h[row * cols + c]), __bfloat162float(whole_h[g]));
        }
  }
  // Columns: a [rows, 12] weight split into 3 shards of 4 columns.
  const int64_t rows = 5, full_cols = 12, part = 4;
  test::DeviceBuffer<float> wide(rows * full_cols);
  init_normal(TensorView(wide.get(), DType::kFP32, {rows, full_cols}), 78, 6, 0.0f, 1.0f, nullptr);
  const std::vector<float> wide_h = wide.download();
  for (int r = 0; r < ranks; ++r) {
    InitSlice s;
    s.rows[0] = rows;
    s.cols = part;
    s.full_cols = full_cols;
    s.col_offset = r * part;
    test::DeviceBuffer<float> shard(rows * part);
    init_normal_slice(TensorView(shard.get(), DType::kFP32, {rows, part}), s, 78, 6, 0.0f, 1.0f,
                      nullptr);
    const std::vector<float> got = shard.download();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < part; ++c)
        ASSERT_EQ(got[i * part + c], wide_h[i * full_cols + r * part + c]) << "rank " << r;
  }
  // A slice whose size does not match the tensor is refused.
  InitSlice bad;
  bad.rows[0] = 3;
  bad.cols = bad.full_cols = 4;
  test::DeviceBuffer<float> small(8);
  EXPECT_THROW(
      init_normal_slice(TensorView(small.get(), DType::kFP32, {8}), bad, 1, 1, 0, 1, nullptr),
      Error);
}

TEST(Init, RejectsUnsupportedDtype) {
  test::DeviceBuffer<int> i(16);
  EXPECT_THROW(init_normal(TensorView(i.get(), DType::kINT32, {16}), 1, 0, 0, 1, nullptr), Error);
}

}  // namespace
}  // namespace replay
