// replay-comm-probe's host side (workloads/comm/probe.h) on the CPU: message sizes, the default
// sweep, the collectives and types, nccl-tests' size rounding and bandwidth formulas against the
// measurements they are compared with.
#include <gtest/gtest.h>

#include <string>

#include "common/bench/harness.h"
#include "workloads/comm/probe.h"

namespace replay::probe {
namespace {

using comm::Kind;

std::string usage_error(const std::string& sizes) {
  try {
    parse_sizes(sizes);
  } catch (const bench::UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(CommProbeSizes, ParsesUnits) {
  EXPECT_EQ(parse_size("8192"), 8192u);
  EXPECT_EQ(parse_size("8K"), 8192u);
  EXPECT_EQ(parse_size("8kib"), 8192u);
  EXPECT_EQ(parse_size(" 48M "), 48u << 20);
  EXPECT_EQ(parse_size("48MB"), 48u << 20);
  EXPECT_EQ(parse_size("1G"), 1u << 30);
  EXPECT_EQ(parse_size("1GiB"), 1u << 30);
  EXPECT_EQ(parse_size("50331648"), 50331648u);  // GPT-3 TP: 2048 x 12288 bf16
  EXPECT_EQ(parse_size("64G"), uint64_t{64} << 30);
}

TEST(CommProbeSizes, DefaultSweepIs8KiBTo1GiBDoubling) {
  const std::vector<uint64_t> s = default_sizes();
  ASSERT_EQ(s.size(), 18u);
  EXPECT_EQ(s.front(), 8192u);
  EXPECT_EQ(s.back(), uint64_t{1} << 30);
  for (size_t i = 1; i < s.size(); ++i) EXPECT_EQ(s[i], 2 * s[i - 1]);
}

TEST(CommProbeSizes, ListsAndRanges) {
  EXPECT_EQ(parse_sizes("48M"), (std::vector<uint64_t>{48u << 20}));
  EXPECT_EQ(parse_sizes("1M,8K,1M"), (std::vector<uint64_t>{8192, 1u << 20}));  // sorted, unique
  EXPECT_EQ(parse_sizes("1K:8K"), (std::vector<uint64_t>{1024, 2048, 4096, 8192}));
  EXPECT_EQ(parse_sizes("1K:64K:4"), (std::vector<uint64_t>{1024, 4096, 16384, 65536}));
  EXPECT_EQ(parse_sizes("1K:10K:4"), (std::vector<uint64_t>{1024, 4096}));  // stops below the end
  EXPECT_EQ(parse_sizes("8K,16K:32K,48M"), (std::vector<uint64_t>{8192, 16384, 32768, 48u << 20}));
  EXPECT_EQ(parse_sizes("5:5"), (std::vector<uint64_t>{5}));
}

TEST(CommProbeSizes, BadSizesNameTheText) {
  EXPECT_NE(usage_error("").find("is empty"), std::string::npos);
  EXPECT_NE(usage_error("0").find("'0' is zero"), std::string::npos);
  EXPECT_NE(usage_error("8X").find("unknown unit 'X'"), std::string::npos);
  EXPECT_NE(usage_error("M").find("'M' is not a size"), std::string::npos);
  EXPECT_NE(usage_error("-8K").find("is not a size"), std::string::npos);
  EXPECT_NE(usage_error("65G").find("more than 64 GiB"), std::string::npos);
  EXPECT_NE(usage_error("99999999999999999999").find("more than 64 GiB"), std::string::npos);
  EXPECT_NE(usage_error("8K,,16K").find("empty item"), std::string::npos);
  EXPECT_NE(usage_error("1G:8K").find("runs backwards"), std::string::npos);
  EXPECT_NE(usage_error("8K:1G:1").find("integer factor of 2 or more"), std::string::npos);
  EXPECT_NE(usage_error("8K:1G:x").find("integer factor"), std::string::npos);
  EXPECT_NE(usage_error("8K:16K:2:2").find("more than two ':'"), std::string::npos);
  // Every message says what a size may be.
  EXPECT_NE(usage_error("8X").find("A:B doubles from A to B"), std::string::npos);
}

TEST(CommProbeSizes, Format) {
  EXPECT_EQ(format_size(8192), "8 KiB");
  EXPECT_EQ(format_size(48u << 20), "48 MiB");
  EXPECT_EQ(format_size(uint64_t{1} << 30), "1 GiB");
  EXPECT_EQ(format_size(1000), "1000 B");
  EXPECT_EQ(format_size(1536), "1536 B");
}

TEST(CommProbeChoices, CollectivesAndTypes) {
  EXPECT_EQ(parse_collectives("all_reduce,rs,AllGather,ar"),
            (std::vector<Kind>{Kind::kAllReduce, Kind::kReduceScatter, Kind::kAllGather}));
  EXPECT_EQ(parse_dtypes("fp32,bf16,float32"), (std::vector<DType>{DType::kFP32, DType::kBF16}));
  EXPECT_THROW(parse_collectives("broadcast"), bench::UsageError);
  EXPECT_THROW(parse_collectives(""), bench::UsageError);
  EXPECT_THROW(parse_dtypes("fp16"), bench::UsageError);
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(dtype_bytes(DType::kFP32), 4);
}

TEST(CommProbeMessage, CountsAndRoundingAsNcclTests) {
  // All-reduce: the buffer reduced, whole elements.
  Message m = message(Kind::kAllReduce, 48u << 20, DType::kBF16, 2);
  EXPECT_EQ(m.count, 2048u * 12288u);
  EXPECT_EQ(m.bytes, 48u << 20);
  m = message(Kind::kAllReduce, 1001, DType::kFP32, 4);
  EXPECT_EQ(m.count, 250u);
  EXPECT_EQ(m.bytes, 1000u);
  // All-gather and reduce-scatter: the whole buffer, count per rank, a multiple of the ranks.
  m = message(Kind::kAllGather, 1u << 20, DType::kBF16, 2);
  EXPECT_EQ(m.count, (1u << 20) / 2 / 2);
  EXPECT_EQ(m.bytes, 1u << 20);
  m = message(Kind::kReduceScatter, 8192, DType::kFP32, 3);
  EXPECT_EQ(m.count, 682u);  // 2048 elements over 3 ranks
  EXPECT_EQ(m.bytes, 682u * 3 * 4);
  // Too small for one element a rank.
  EXPECT_EQ(message(Kind::kAllGather, 4, DType::kFP32, 2).count, 0u);
  // The same bytes as the Communicator's traffic counter (common/comm.h collective_bytes).
  for (Kind k : {Kind::kAllReduce, Kind::kReduceScatter, Kind::kAllGather}) {
    const Message x = message(k, 48u << 20, DType::kBF16, 4);
    EXPECT_EQ(x.bytes, comm::collective_bytes(k, x.count, ncclBfloat16, 4)) << comm::kind_name(k);
  }
}

TEST(CommProbeBandwidth, NcclTestsFormulas) {
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kAllReduce, 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kAllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kReduceScatter, 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kAllGather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor(Kind::kAllGather, 8), 0.875);
  // The anchor (2 H100s, PyTorch's all-reduce, bf16): 1 GiB in 3.21 ms is 334 GB/s, 8 MiB in
  // 0.050 ms about 168 GB/s (169 from the unrounded time).
  EXPECT_NEAR(algbw_gbps(uint64_t{1} << 30, 3210.0), 334.5, 0.1);
  EXPECT_NEAR(busbw_gbps(Kind::kAllReduce, 2, uint64_t{1} << 30, 3210.0), 334.5, 0.1);
  EXPECT_NEAR(busbw_gbps(Kind::kAllReduce, 2, 8u << 20, 50.0), 167.8, 0.1);
  // Four ranks: the same time is 1.5x the bus bandwidth for an all-reduce, 0.75x for an all-gather.
  EXPECT_NEAR(busbw_gbps(Kind::kAllReduce, 4, 1000000, 10.0), 150.0, 1e-9);
  EXPECT_NEAR(busbw_gbps(Kind::kAllGather, 4, 1000000, 10.0), 75.0, 1e-9);
  EXPECT_EQ(algbw_gbps(1000, 0.0), 0.0);
}

}  // namespace
}  // namespace replay::probe
