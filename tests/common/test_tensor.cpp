// TensorView: shapes, strides, sizes, typed access.
#include "common/tensor.h"

#include <gtest/gtest.h>

namespace replay {
namespace {

TEST(Tensor, ContiguousStridesAndBytes) {
  float dummy = 0;
  TensorView t(&dummy, DType::kBF16, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.bytes(), 48u);
  EXPECT_EQ(t.stride[0], 12);
  EXPECT_EQ(t.stride[1], 4);
  EXPECT_EQ(t.stride[2], 1);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "bf16[2x3x4]");
  t.stride[1] = 8;
  EXPECT_FALSE(t.is_contiguous());
}

TEST(Tensor, TypedAccessChecksDtype) {
  float x = 1.0f;
  TensorView t(&x, DType::kFP32, {1});
  EXPECT_EQ(t.as<float>(DType::kFP32), &x);
  EXPECT_THROW(t.as<float>(DType::kBF16), Error);
}

TEST(Tensor, DtypeSizes) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kINT64), 8u);
  EXPECT_STREQ(dtype_name(DType::kFP8E5M2), "fp8e5m2");
}

}  // namespace
}  // namespace replay
