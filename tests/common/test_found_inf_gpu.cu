// Found-inf over bf16, fp16 and fp32 tensors (aligned and not, chunk tails) sees every Inf and NaN
// and nothing else.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/optim/found_inf.h"
#include "graphs/graph.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using graphs::CaptureStream;
using test::DeviceBuffer;

// One tensor of each type, with a planted value (raw bits) at a chosen element.
struct FoundInfCase {
  const char* what;
  int tensor;
  size_t index;
  uint32_t bits;
  int expected;
};

TEST(FoundInf, SeesEveryInfAndNanAcrossTypesAlignmentsAndTails) {
  CaptureStream work;
  const size_t n32 = 100003, n16 = 33333, nh = 20000;  // several 16384-element chunks, ragged tails
  std::vector<float> f32 = test::random_uniform(n32, 11, -100.0f, 100.0f);
  std::vector<__nv_bfloat16> bf = test::to_bf16(test::random_uniform(n16, 12, -100.0f, 100.0f));
  std::vector<__half> hf(nh);
  const std::vector<float> hsrc = test::random_uniform(nh, 13, -100.0f, 100.0f);
  for (size_t i = 0; i < nh; ++i) hf[i] = __float2half_rn(hsrc[i]);

  DeviceBuffer<float> d32(f32);
  DeviceBuffer<char> dbf(n16 * 2 + 2);  // the bf16 tensor starts 2 bytes in: not 16-byte aligned
  ASSERT_EQ(cudaMemcpy(dbf.get() + 2, bf.data(), n16 * 2, cudaMemcpyHostToDevice), cudaSuccess);
  DeviceBuffer<__half> dhf(nh);
  ASSERT_EQ(cudaMemcpy(dhf.get(), hf.data(), nh * 2, cudaMemcpyHostToDevice), cudaSuccess);

  FoundInfTableBuilder builder;
  builder.add(TensorView(d32.get(), DType::kFP32, {static_cast<int64_t>(n32)}));
  builder.add(TensorView(dbf.get() + 2, DType::kBF16, {static_cast<int64_t>(n16)}));
  builder.add(TensorView(dhf.get(), DType::kFP16, {static_cast<int64_t>(nh)}));
  DeviceBuffer<char> table_memory(builder.device_bytes());
  const FoundInfTable table = builder.build(table_memory.get(), builder.device_bytes(), work.get());
  DeviceBuffer<int32_t> flag(1);

  char* bases[3] = {reinterpret_cast<char*>(d32.get()), dbf.get() + 2,
                    reinterpret_cast<char*>(dhf.get())};
  const size_t esize[3] = {4, 2, 2};
  const FoundInfCase cases[] = {
      {"all finite", 0, 0, 0, 0},
      {"fp32 +Inf in the last element", 0, n32 - 1, 0x7f800000u, 1},
      {"fp32 NaN in a chunk middle", 0, 16384 * 3 + 77, 0x7fc00001u, 1},
      {"fp32 largest finite", 0, 5, 0x7f7fffffu, 0},
      {"bf16 NaN", 1, 20000, 0x7fc1u, 1},
      {"bf16 -Inf in the first element", 1, 0, 0xff80u, 1},
      {"bf16 -Inf in the last element", 1, n16 - 1, 0xff80u, 1},
      {"bf16 largest finite", 1, 9, 0x7f7fu, 0},
      {"fp16 +Inf", 2, 16384, 0x7c00u, 1},
      {"fp16 NaN in the last element", 2, nh - 1, 0x7e00u, 1},
      {"fp16 largest finite", 2, 3, 0x7bffu, 0},
  };
  for (const FoundInfCase& c : cases) {
    char* at = bases[c.tensor] + c.index * esize[c.tensor];
    char saved[4];
    ASSERT_EQ(cudaMemcpy(saved, at, esize[c.tensor], cudaMemcpyDeviceToHost), cudaSuccess);
    if (c.expected || c.bits)
      ASSERT_EQ(cudaMemcpy(at, &c.bits, esize[c.tensor], cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(flag.get(), 0, 4), cudaSuccess);
    check_found_inf(table, flag.get(), work.get());
    EXPECT_EQ(flag.download()[0], c.expected) << c.what;
    ASSERT_EQ(cudaMemcpy(at, saved, esize[c.tensor], cudaMemcpyHostToDevice), cudaSuccess);
  }
  // The flag is only ever raised: a clean check leaves an earlier overflow standing.
  ASSERT_EQ(cudaMemset(flag.get(), 0xff, 4), cudaSuccess);
  check_found_inf(table, flag.get(), work.get());
  EXPECT_EQ(flag.download()[0], -1);
}

}  // namespace
}  // namespace replay
