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

TEST(Init, RejectsUnsupportedDtype) {
  test::DeviceBuffer<int> i(16);
  EXPECT_THROW(init_normal(TensorView(i.get(), DType::kINT32, {16}), 1, 0, 0, 1, nullptr), Error);
}

}  // namespace
}  // namespace replay
