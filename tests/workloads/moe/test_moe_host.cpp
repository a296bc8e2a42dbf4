// replay-moe on the CPU: its presets resolve to the documented shapes (671b-ep32: 64 heads, 8 of
// 256 experts, 4096 tokens, capacity 4096 rows per local expert at factor 1), and bad flags are
// refused with a message naming them before any GPU work.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "train/driver.h"
#include "workloads/moe/moe_workload.h"

namespace replay::moe {
namespace {

train::RunFlags resolved(MoeWorkload& w, const std::vector<std::string>& args) {
  const std::optional<train::RunFlags> f = train::parse(w, args);
  EXPECT_TRUE(f.has_value());
  return train::resolve(w, *f);
}

std::string usage_error(const std::vector<std::string>& args) {
  MoeWorkload w;
  try {
    resolved(w, args);
  } catch (const bench::UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(MoeHost, PresetsResolveToTheirShapes) {
  MoeWorkload w;
  resolved(w, {"--preset", "671b-ep32"});
  const MoeShape& s = w.shape();
  EXPECT_EQ(s.tokens(), 4096);
  EXPECT_EQ(s.hidden, 7168);
  EXPECT_EQ(s.heads, 64);
  EXPECT_EQ(s.qk_dim(), 192);
  EXPECT_EQ(s.v_dim, 128);
  EXPECT_EQ(s.experts, 256);
  EXPECT_EQ(s.local_experts, 8);
  EXPECT_EQ(s.topk, 8);
  EXPECT_EQ(s.moe_layers, 8);
  EXPECT_EQ(s.dense_layers, 0);
  EXPECT_EQ(s.head, HeadKind::kPipelineStage);
  EXPECT_EQ(s.capacity(), 4096);                 // 4096 tokens x 8 / 8 local experts
  EXPECT_EQ(s.max_per_expert(), 32768);          // 8 of a token's experts can fold onto one
  EXPECT_GT(w.block_bytes(), int64_t{8} << 30);  // ~477M parameters x 18 bytes, and activations
  MoeWorkload t;
  resolved(t, {"--preset", "tiny", "--capacity-factor", "0.5"});
  EXPECT_EQ(t.shape().capacity(), 16);
  MoeWorkload d;
  resolved(d, {"--preset", "tiny", "--dropless"});
  EXPECT_TRUE(d.shape().dropless());
  EXPECT_EQ(d.shape().capacity(), 128);
  MoeWorkload e;
  resolved(e, {"--preset", "tiny-ep"});
  EXPECT_EQ(e.shape().capacity(), 128);  // 128 tokens x 4 / 4 local experts
  EXPECT_EQ(e.shape().max_per_expert(), 512);
  MoeWorkload g;
  resolved(g, {"--preset", "tiny", "--graphs", "layer", "--graph-scope", "attn,moe_router"});
  EXPECT_EQ(g.scopes(), (std::vector<std::string>{"attn", "moe_router"}));
}

TEST(MoeHost, BadFlagsAreRefusedWithTheirNames) {
  EXPECT_NE(usage_error({"--graph-scope", "attn"}).find("--graphs layer"), std::string::npos);
  EXPECT_NE(usage_error({"--graphs", "layer", "--graph-scope", "attn,router"}).find("'router'"),
            std::string::npos);
  EXPECT_NE(usage_error({"--graphs", "layer", "--graph-scope", ","}).find("no scope"),
            std::string::npos);
  EXPECT_NE(usage_error({"--dropless", "--capacity-factor", "2"}).find("choose one"),
            std::string::npos);
}

}  // namespace
}  // namespace replay::moe
