// replay-moe on the CPU: its presets resolve to the documented shapes (671b-ep32: 64 heads, 8 of
// 256 experts, 4096 tokens, capacity 4096 rows per local expert at factor 1), and bad flags are
// refused with a message naming them before any GPU work; YaRN per preset and --rope-scaling.
#include <gtest/gtest.h>

#include <cmath>
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

// YaRN (DeepSeek-V3's released rope_scaling) is on for the DeepSeek-sized presets and off for the
// test presets; --rope-scaling turns it on or off; the printed configuration carries it and the
// softmax scale it implies (192^-0.5 x (1 + 0.1 ln 40)^2), which the PyTorch baseline reads.
TEST(MoeHost, YarnPerPresetAndFlag) {
  for (const char* preset : {"671b-ep32", "small"}) {
    MoeWorkload w;
    resolved(w, {"--preset", preset});
    const YarnScaling& y = w.shape().yarn;
    EXPECT_TRUE(y.enabled) << preset;
    EXPECT_EQ(y.factor, 40.0);
    EXPECT_EQ(y.original_max_position, 4096.0);
    EXPECT_EQ(y.beta_fast, 32.0);
    EXPECT_EQ(y.beta_slow, 1.0);
    EXPECT_EQ(y.mscale, 1.0);
    EXPECT_EQ(y.mscale_all_dim, 1.0);
    const nlohmann::ordered_json c = w.config();
    EXPECT_EQ(c["rope"]["yarn"]["factor"], 40.0);
    const double m = 1.0 + 0.1 * std::log(40.0);
    EXPECT_NEAR(c["softmax_scale"].get<double>(), m * m / std::sqrt(192.0), 1e-15);
  }
  for (const char* preset : {"tiny", "tiny-ep"}) {
    MoeWorkload w;
    resolved(w, {"--preset", preset});
    EXPECT_FALSE(w.shape().yarn.enabled) << preset;
    EXPECT_TRUE(w.config()["rope"]["yarn"].is_null());
    EXPECT_NEAR(w.config()["softmax_scale"].get<double>(), 1.0 / std::sqrt(192.0), 1e-15);
  }
  MoeWorkload on, off;
  resolved(on, {"--preset", "tiny", "--rope-scaling", "yarn"});
  EXPECT_TRUE(on.shape().yarn.enabled);
  resolved(off, {"--preset", "671b-ep32", "--rope-scaling", "none"});
  EXPECT_FALSE(off.shape().yarn.enabled);
  EXPECT_NE(usage_error({"--rope-scaling", "linear"}).find("--rope-scaling"), std::string::npos);
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

// --ep: the experts split over the ranks (tiny-ep's 32 experts: 16 a rank at EP2, each rank
// sending Cs = ceil(128 x 4 / 32) = 16 rows to each expert, so 2 x 16 rows per local expert);
// --ep 1 holds every expert (no fold): the one-GPU reference.
TEST(MoeHost, ExpertParallelShapes) {
  MoeWorkload w;
  resolved(w, {"--preset", "tiny-ep", "--ep", "2"});
  EXPECT_EQ(w.expert_parallel(), 2);
  EXPECT_EQ(w.shape().ep, 2);
  EXPECT_EQ(w.shape().local_experts, 16);
  EXPECT_EQ(w.shape().ep_capacity(), 16);
  EXPECT_EQ(w.shape().capacity(), 32);
  EXPECT_EQ(w.shape().dispatch_shape().experts, 32);
  EXPECT_EQ(w.shape().dispatch_shape().rows(), 32 * 16);
  MoeWorkload one;
  resolved(one, {"--preset", "tiny-ep", "--ep", "1", "--micro-batch", "4"});
  EXPECT_EQ(one.expert_parallel(), 1);
  EXPECT_EQ(one.shape().local_experts, 32);
  EXPECT_EQ(one.shape().tokens(), 256);
  EXPECT_EQ(one.shape().capacity(), 32);  // 256 x 4 / 32: the EP2 ranks' 2 x 16 together
  MoeWorkload plain;
  resolved(plain, {"--preset", "tiny-ep"});
  EXPECT_EQ(plain.expert_parallel(), 1);
  EXPECT_EQ(plain.shape().local_experts, 4);  // the one-process fold, unchanged
}

// Refused before any work: --ep not dividing the experts, with dropless, and (the driver, before
// the GPU is touched) with one process.
TEST(MoeHost, ExpertParallelRefusals) {
  EXPECT_NE(usage_error({"--preset", "tiny", "--ep", "3"}).find("does not divide the 8 experts"),
            std::string::npos);
  EXPECT_NE(usage_error({"--preset", "tiny-ep", "--ep", "2", "--dropless"}).find("--dropless"),
            std::string::npos);
  EXPECT_NE(usage_error({"--ep", "0"}), "");
  MoeWorkload w;
  const train::RunFlags f = resolved(w, {"--preset", "tiny-ep", "--ep", "2", "--steps", "1"});
  std::string message;
  try {
    train::run(w, f, stdout, train::RunOptions{false});
  } catch (const bench::UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("--ep 2: expert parallelism runs one process per rank"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace replay::moe
