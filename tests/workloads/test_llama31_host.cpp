// replay-llama31 on the CPU: the command line (bad flags exit 2 before any GPU work, --help exits
// 0), preset resolution, MLPerf's Llama 3.1 hyperparameters and schedule, and the per-GPU shard
// shapes the 405B presets derive (NVIDIA's layout at TP8: QKV 16384 x 2304, output 2048 x 16384,
// gate+up 16384 x 13312, FC2 6656 x 16384, vocabulary 4000 per GPU).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/workloads/workload_test_util.h"
#include "train/driver.h"
#include "workloads/llama31/llama31.h"

namespace replay::llama31 {
namespace {

using transformer::TransformerShape;

using test::has;
using test::Outcome;

Outcome run_binary(const std::string& args) {
  return test::shell(std::string("'") + REPLAY_LLAMA31_BINARY + "' " + args);
}

TransformerShape preset(const std::string& name) {
  for (const transformer::Preset& p : recipe().presets)
    if (p.info.name == name) return p.shape;
  throw Error("test", "no preset", name);
}

TEST(Llama31Cli, BadFlagsExitTwoAndHelpExitsZero) {
  Outcome o = run_binary("--preset 70b");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "replay-llama31: ") && has(o.output, "70b")) << o.output;
  o = run_binary("--layers 127 --preset 405b-tp8");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "126")) << o.output;
  o = run_binary("--help");
  EXPECT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(has(o.output, "405b-tp8") && has(o.output, "405b-tp4")) << o.output;
}

TEST(Llama31Presets, The405bShardsHaveNvidiasPerGpuShapes) {
  TransformerShape s = preset("405b-tp8");
  EXPECT_EQ(s.layers, 0) << "the 405B presets take their layer count from the memory budget";
  s.layers = 1;
  EXPECT_NO_THROW(s.validate());
  EXPECT_EQ(s.heads_shard(), 16);
  EXPECT_EQ(s.kv_heads_shard(), 1);
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.qkv_width(), 2304);  // 16 q + 1 k + 1 v heads of 128
  EXPECT_EQ(s.attn_width(), 2048);
  EXPECT_EQ(s.ffn_shard(), 6656);
  EXPECT_EQ(s.fc1_width(), 13312);  // gate and up fused
  EXPECT_EQ(s.padded_vocab(), 32000);
  EXPECT_EQ(s.vocab_shard(), 4000);
  EXPECT_EQ(s.seq, 8192);
  EXPECT_EQ(s.micro_batch, 1);
  EXPECT_EQ(s.norm, transformer::NormKind::kRMSNorm);
  EXPECT_EQ(s.position, transformer::PositionKind::kRope);
  EXPECT_EQ(s.mlp, transformer::MlpKind::kSwiGLU);
  EXPECT_DOUBLE_EQ(s.rope_theta, 500000.0);
  EXPECT_TRUE(s.rope_llama31_scaling);
  EXPECT_FALSE(s.bias);
  EXPECT_FALSE(s.tied_embedding);
  EXPECT_EQ(s.dropout, 0.0f);
  // About 398M parameters per layer per GPU: QKV, output, gate+up, FC2 and two norms.
  const int64_t per_layer = s.qkv_width() * s.hidden + s.hidden * s.attn_width() +
                            s.fc1_width() * s.hidden + s.hidden * s.ffn_shard() + 2 * s.hidden;
  EXPECT_NEAR(static_cast<double>(per_layer) / 1e6, 398.0, 1.0);
  EXPECT_TRUE(has(s.describe(), "kv heads 8 (1 per GPU)")) << s.describe();

  TransformerShape t4 = preset("405b-tp4");
  t4.layers = 1;
  EXPECT_NO_THROW(t4.validate());
  EXPECT_EQ(t4.heads_shard(), 32);
  EXPECT_EQ(t4.kv_heads_shard(), 2);
  EXPECT_EQ(t4.qkv_width(), 36 * 128);
  EXPECT_EQ(t4.fc1_width(), 2 * 13312);
  EXPECT_EQ(t4.vocab_shard(), 8000);

  const TransformerShape tiny = preset("tiny");
  EXPECT_NO_THROW(tiny.validate());
  EXPECT_EQ(tiny.heads_shard(), 4);
  EXPECT_EQ(tiny.kv_heads_shard(), 2);
  EXPECT_EQ(tiny.head_dim, 64);  // a head dim the attention tests cover
  EXPECT_EQ(tiny.qkv_width(), 8 * 64);
  TransformerShape tp2 = tiny;  // the tensor-parallel tests' split
  tp2.tp = 2;
  EXPECT_NO_THROW(tp2.validate());
  EXPECT_EQ(tp2.kv_heads_shard(), 1);
}

TEST(Llama31Presets, GqaNeedsKvHeadsThatDivideTheQueryHeadsAndTp) {
  TransformerShape s = preset("405b-tp8");
  s.layers = 1;
  s.heads_kv = 3;
  EXPECT_THROW(s.validate(), Error);
  s.heads_kv = 4;  // divides 128 but not TP 8
  EXPECT_THROW(s.validate(), Error);
  s.heads_kv = 8;
  EXPECT_NO_THROW(s.validate());
}

TEST(Llama31Settings, MlperfOptimizerAndSchedule) {
  const train::TrainingConfig o = mlperf_training(1152);
  EXPECT_FLOAT_EQ(o.adam.beta1, 0.9f);
  EXPECT_FLOAT_EQ(o.adam.beta2, 0.95f);
  EXPECT_FLOAT_EQ(o.adam.eps, 1e-5f);
  EXPECT_FLOAT_EQ(o.adam.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(o.clip_norm, 1.0f);
  EXPECT_FLOAT_EQ(o.schedule.base_lr, 8e-5f);
  EXPECT_FLOAT_EQ(o.schedule.min_lr, 8e-7f);
  EXPECT_EQ(o.schedule.kind, train::LrKind::kWarmupCosine);
  EXPECT_EQ(o.schedule.warmup_steps, 8000);
  EXPECT_EQ(o.schedule.total_steps, 1200000);
  // The learning rate scales with the global batch; the step counts shrink with it (rounded up).
  const train::TrainingConfig small = mlperf_training(4);
  EXPECT_FLOAT_EQ(small.schedule.base_lr, static_cast<float>(8e-5 * 4 / 1152));
  EXPECT_EQ(small.schedule.warmup_steps, 8000 * 288);
  EXPECT_EQ(mlperf_training(1000).schedule.warmup_steps, (8000 * 1152 + 999) / 1000);
}

TEST(Llama31Settings, ResolveFillsThePresetAndTheMicroBatches) {
  transformer::TransformerWorkload w(recipe());
  const train::RunFlags f =
      test::resolved(w, {"--preset", "405b-tp8", "--microbatches", "4", "--seed", "5"});
  EXPECT_EQ(w.shape().layers, 0) << "the layer count comes from the memory budget";
  EXPECT_EQ(w.microbatches(), 4);
  EXPECT_EQ(f.seed, 5u);
  EXPECT_FLOAT_EQ(train::training_config(w, f).schedule.base_lr,
                  static_cast<float>(8e-5 * 4 / 1152));
  EXPECT_EQ(w.config()["kv_heads"], 1);
  transformer::TransformerWorkload t(recipe());
  const train::RunFlags g =
      test::resolved(t, {"--preset", "tiny", "--layers", "3", "--graphs", "full"});
  EXPECT_EQ(t.shape().layers, 3);
  EXPECT_EQ(g.graphs, "full");
  transformer::TransformerWorkload u(recipe());
  EXPECT_THROW(test::resolved(u, {"--preset", "tiny", "--layers", "127"}), bench::UsageError);
}

}  // namespace
}  // namespace replay::llama31
