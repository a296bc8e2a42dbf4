// replay-gpt3 on the CPU: the command line (bad flags exit 2 with "replay-gpt3: <flag> ..." before
// any GPU work, --help exits 0), preset resolution, MLPerf's schedule lengths, the shard shapes the
// presets derive, and the parameter store's layout.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/workloads/workload_test_util.h"
#include "workloads/gpt3/gpt3.h"
#include "workloads/transformer/params.h"

namespace replay::gpt3 {
namespace {

using test::has;
using test::Outcome;

Outcome run_binary(const std::string& args) {
  return test::shell(std::string("'") + REPLAY_GPT3_BINARY + "' " + args);
}

TEST(Gpt3Cli, BadFlagsExitTwoWithAClearMessage) {
  Outcome o = run_binary("--graphs sometimes");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "replay-gpt3: ") && has(o.output, "--graphs") &&
              has(o.output, "sometimes"))
      << o.output;
  o = run_binary("--preset 175b-tp3");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--preset") && has(o.output, "175b-tp4")) << o.output;
  o = run_binary("--preset 175b-tp4 --layers 97");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "replay-gpt3: --layers: GPT-3 175B has 96 layers, got 97")) << o.output;
  o = run_binary("--no-such-flag");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--no-such-flag")) << o.output;
  o = run_binary("--help");
  EXPECT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(has(o.output, "--host-delay-us")) << o.output;
}

bench::HarnessFlags flags(const std::vector<std::string>& args) {
  return *bench::parse_flags("replay-gpt3", args, preset_names(workload()), "tiny");
}

TEST(Gpt3Settings, PresetDefaultsFillTheFlags) {
  const transformer::Settings s = resolve(workload(), flags({}));
  EXPECT_EQ(s.preset.name, "tiny");
  EXPECT_EQ(s.flags.steps, 20);
  EXPECT_EQ(s.flags.layers, 2);
  EXPECT_EQ(s.flags.dropout, 0.0);
  EXPECT_NE(s.flags.seed, 0u) << "seed 0 is drawn from the clock";
  EXPECT_EQ(s.trainer.mode, graphs::GraphMode::kFull);
  EXPECT_EQ(s.trainer.shape.layers, 2);

  const transformer::Settings t =
      resolve(workload(), flags({"--preset", "175b-tp4", "--graphs", "layer", "--dropout", "0.1",
                                 "--seed", "9", "--microbatches", "2"}));
  EXPECT_EQ(t.trainer.shape.layers, 0) << "175B layers come from the memory budget";
  EXPECT_FLOAT_EQ(t.trainer.shape.dropout, 0.1f);
  EXPECT_EQ(t.trainer.seed, 9u);
  EXPECT_EQ(t.trainer.microbatches, 2);
  EXPECT_EQ(t.trainer.mode, graphs::GraphMode::kLayer);
  EXPECT_EQ(t.trainer.optimizer.schedule.warmup_steps, 265 * 1536 / 2);
  EXPECT_EQ(
      resolve(workload(), flags({"--preset", "175b-tp4", "--layers", "12"})).trainer.shape.layers,
      12);
  EXPECT_THROW(resolve(workload(), flags({"--preset", "175b-tp8", "--layers", "97"})),
               bench::UsageError);
}

TEST(Gpt3Settings, MlperfSchedule) {
  const transformer::OptimizerConfig gbs1536 = mlperf_optimizer(1536);
  EXPECT_EQ(gbs1536.schedule.warmup_steps, 265);
  EXPECT_EQ(gbs1536.schedule.total_steps, 108600);  // 166,809,600 samples
  EXPECT_FLOAT_EQ(gbs1536.schedule.base_lr, 2e-5f);
  EXPECT_FLOAT_EQ(gbs1536.schedule.min_lr, 2e-6f);
  EXPECT_FLOAT_EQ(gbs1536.adam.beta2, 0.95f);
  EXPECT_FLOAT_EQ(gbs1536.adam.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(gbs1536.clip_norm, 1.0f);
  EXPECT_EQ(mlperf_optimizer(1).schedule.warmup_steps, 407040);
  EXPECT_EQ(mlperf_optimizer(1000).schedule.warmup_steps, 408);  // ceil(407040 / 1000)
}

TEST(Gpt3Shapes, ShardsOfTheMlperfLayout) {
  const transformer::TransformerShape tp4 = preset(workload(), "175b-tp4").shape;
  EXPECT_EQ(tp4.padded_vocab(), 50688);  // 50257 up to a multiple of 128 x 4
  EXPECT_EQ(tp4.vocab_shard(), 12672);
  EXPECT_EQ(tp4.heads_shard(), 24);
  EXPECT_EQ(tp4.attn_width(), 3072);
  EXPECT_EQ(tp4.qkv_width(), 9216);  // QKV GEMM 2048x12288 by 12288x9216
  EXPECT_EQ(tp4.ffn_shard(), 12288);
  EXPECT_EQ(tp4.tokens(), 2048);
  const transformer::TransformerShape tp8 = preset(workload(), "175b-tp8").shape;
  EXPECT_EQ(tp8.padded_vocab(), 51200);
  EXPECT_EQ(tp8.vocab_shard(), 6400);
  EXPECT_EQ(tp8.heads_shard(), 12);
  EXPECT_EQ(tp8.ffn_shard(), 6144);
  const transformer::TransformerShape tiny = preset(workload(), "tiny").shape;
  EXPECT_EQ(tiny.padded_vocab(), 512);
  EXPECT_NO_THROW(tiny.validate());
  transformer::TransformerShape bad = tp4;
  bad.layers = 1;
  bad.heads = 94;  // not a multiple of tp 4
  EXPECT_THROW(bad.validate(), Error);
}

TEST(ParamStoreLayout, AlignedOffsetsAndRanges) {
  transformer::ParamStore store;
  const auto a = store.add({"a", {3, 5}, transformer::ParamInit::kNormal, 0.02f, true});
  const auto b = store.add({"b", {7}, transformer::ParamInit::kZeros, 0.0f, false});
  const auto c = store.add({"c", {128, 2}, transformer::ParamInit::kOnes, 0.0f, false});
  EXPECT_EQ(store.offset(a), 0);
  EXPECT_EQ(store.offset(b), 128);
  EXPECT_EQ(store.offset(c), 256);
  EXPECT_EQ(store.total_numel(), 15 + 7 + 256);
  EXPECT_EQ(store.buffer_numel(), 512);
  EXPECT_EQ(store.numel(c), 256);
  EXPECT_EQ(store.spec(b).name, "b");
}

}  // namespace
}  // namespace replay::gpt3
