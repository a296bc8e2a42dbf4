// replay-gpt3 on the CPU: the command line (bad flags exit 2 with "replay-gpt3: <flag> ..." before
// any GPU work, --help exits 0, --print-config prints the resolved shard), preset resolution,
// MLPerf's schedule lengths and the schedule flags, the shard shapes the presets derive, and the
// parameter store's layout.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/workloads/workload_test_util.h"
#include "train/driver.h"
#include "train/params.h"
#include "workloads/gpt3/gpt3.h"

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
  o = run_binary("--dropout 1");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--dropout: must be below 1")) << o.output;
  o = run_binary("--warmup-steps 100 --decay-steps 50");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "learning-rate schedule")) << o.output;
  o = run_binary("--eval-interval 10 --dropout 0.1");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--eval-interval: evaluation runs the forward without dropout"))
      << o.output;
  o = run_binary("--target-quality 1.2");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--target-quality") && has(o.output, "--eval-interval")) << o.output;
  o = run_binary("--help");
  EXPECT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(has(o.output, "--host-delay-us") && has(o.output, "--layers")) << o.output;
}

TEST(Gpt3Cli, UnwritableOutputsAreRefusedBeforeAnyWork) {
  Outcome o = run_binary("--preset tiny --json /proc/nope/x.json");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--json: the directory /proc/nope does not exist")) << o.output;
  o = run_binary("--preset tiny --mllog /tmp");  // a directory, not a file
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--mllog: /tmp is a directory")) << o.output;
}

TEST(Gpt3Cli, PrintConfigGivesTheResolvedShardWithoutAGpu) {
  const Outcome o = run_binary("--preset 175b-tp4 --seed 5 --lr 1e-4 --print-config");
  ASSERT_EQ(o.status, 0) << o.output;
  const nlohmann::json j = nlohmann::json::parse(o.output);
  EXPECT_EQ(j["tool"], "replay-gpt3");
  EXPECT_EQ(j["preset"], "175b-tp4");
  const nlohmann::json& c = j["config"];
  EXPECT_EQ(c["hidden"], 12288);
  EXPECT_EQ(c["heads"], 24);
  EXPECT_EQ(c["ffn"], 12288);
  EXPECT_EQ(c["vocab"], 50688);
  EXPECT_EQ(c["vocab_shard"], 12672);
  EXPECT_EQ(c["tp"], 4);
  EXPECT_EQ(c["layers"], 0) << "from the memory budget, at run time";
  EXPECT_EQ(c["model"]["layers"], 96);
  EXPECT_EQ(c["model"]["data_vocab"], 50257);
  EXPECT_EQ(c["model"]["norm"], "layernorm");
  EXPECT_EQ(c["seed"], 5);
  EXPECT_EQ(c["steps"], 50);
  EXPECT_DOUBLE_EQ(j["training"]["schedule"]["lr"].get<double>(), 1e-4);
  EXPECT_EQ(j["training"]["schedule"]["warmup_steps"], 407040);
  EXPECT_TRUE(j["training"]["loss_scaling"].is_null());
  EXPECT_TRUE(has(j["training"]["schedule"]["source"].get<std::string>(), "MLPerf GPT-3"));
  EXPECT_TRUE(has(j["training"]["schedule"]["source"].get<std::string>(), "schedule flags"));
}

TEST(Gpt3Cli, TheTinyPresetHasAScheduleOfItsOwnAndTheShardsMlperfs) {
  const nlohmann::json tiny = nlohmann::json::parse(run_binary("--print-config").output);
  EXPECT_DOUBLE_EQ(tiny["training"]["schedule"]["lr"].get<double>(), 3e-3);
  EXPECT_EQ(tiny["training"]["schedule"]["warmup_steps"], 20);
  EXPECT_EQ(tiny["training"]["schedule"]["decay_steps"], 400);
  EXPECT_TRUE(has(tiny["training"]["schedule"]["source"].get<std::string>(), "tiny preset's own"));
  const Outcome shard = run_binary("--preset 175b-tp8 --microbatches 2 --print-config");
  const nlohmann::json j = nlohmann::json::parse(shard.output);
  EXPECT_DOUBLE_EQ(j["training"]["schedule"]["lr"].get<double>(), 2e-5);
  EXPECT_EQ(j["training"]["schedule"]["warmup_steps"], 265 * 1536 / 2);
  EXPECT_TRUE(has(j["training"]["schedule"]["source"].get<std::string>(), "global batch of 2"));
}

TEST(Gpt3Cli, TheSmallPresetIsGpt3SmallWithItsOwnSchedule) {
  const nlohmann::json j =
      nlohmann::json::parse(run_binary("--preset small --print-config").output);
  const nlohmann::json& c = j["config"];
  EXPECT_EQ(c["layers"], 12);
  EXPECT_EQ(c["hidden"], 768);
  EXPECT_EQ(c["heads"], 12);
  EXPECT_EQ(c["head_dim"], 64);
  EXPECT_EQ(c["ffn"], 3072);
  EXPECT_EQ(c["seq"], 1024);
  EXPECT_EQ(c["micro_batch"], 8);
  EXPECT_EQ(c["tp"], 1);
  EXPECT_EQ(c["dropout"], 0.0);
  EXPECT_EQ(c["data_order"], "shuffled");
  // About 125M parameters: the embeddings (padded vocabulary and 1024 positions) and 12 layers.
  const double vocab = c["vocab"].get<double>(), h = 768;
  const double params = (vocab + 1024) * h + 12 * (12 * h * h + 13 * h) + 2 * h;
  EXPECT_NEAR(params / 1e6, 125.0, 2.0);
  EXPECT_DOUBLE_EQ(j["training"]["schedule"]["lr"].get<double>(), 6e-4);
  EXPECT_EQ(j["training"]["schedule"]["warmup_steps"], 100);
  EXPECT_TRUE(has(j["training"]["schedule"]["source"].get<std::string>(), "small preset's own"));
}

TEST(Gpt3Settings, PresetDefaultsFillTheFlags) {
  transformer::TransformerWorkload w(recipe());
  const train::RunFlags f = test::resolved(w, {});
  EXPECT_EQ(f.preset, "tiny");
  EXPECT_EQ(f.steps, 20);
  EXPECT_NE(f.seed, 0u) << "seed 0 is drawn from the clock";
  EXPECT_EQ(f.graphs, "full");
  EXPECT_EQ(w.shape().layers, 2);
  EXPECT_EQ(w.shape().dropout, 0.0f);

  transformer::TransformerWorkload t(recipe());
  const train::RunFlags g =
      test::resolved(t, {"--preset", "175b-tp4", "--graphs", "layer", "--dropout", "0.1", "--seed",
                         "9", "--microbatches", "2"});
  EXPECT_EQ(t.shape().layers, 0) << "175B layers come from the memory budget";
  EXPECT_FLOAT_EQ(t.shape().dropout, 0.1f);
  EXPECT_EQ(g.seed, 9u);
  EXPECT_EQ(t.microbatches(), 2);
  EXPECT_EQ(g.graphs, "layer");
  EXPECT_EQ(train::training_config(t, g).schedule.warmup_steps, 265 * 1536 / 2);
  EXPECT_DOUBLE_EQ(t.config()["dropout"].get<double>(), 0.1);

  transformer::TransformerWorkload u(recipe());
  test::resolved(u, {"--preset", "175b-tp4", "--layers", "12"});
  EXPECT_EQ(u.shape().layers, 12);
  transformer::TransformerWorkload v(recipe());
  EXPECT_THROW(test::resolved(v, {"--preset", "175b-tp8", "--layers", "97"}), bench::UsageError);
}

// --sequence-parallel needs tensor parallelism run by one process per rank: refused before any
// work without --tp, and in a one-process run (which runs no collectives).
TEST(Gpt3Settings, SequenceParallelNeedsTheGroupsProcesses) {
  transformer::TransformerWorkload a(recipe());
  EXPECT_THROW(test::resolved(a, {"--preset", "tiny", "--sequence-parallel"}), bench::UsageError);
  transformer::TransformerWorkload b(recipe());
  try {
    test::resolved(b, {"--preset", "tiny", "--tp", "2", "--sequence-parallel"});
    ADD_FAILURE() << "one process accepted --sequence-parallel";
  } catch (const bench::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("one process per tensor-parallel rank"), std::string::npos)
        << e.what();
  }
  transformer::TransformerWorkload c(recipe());
  test::resolved(c, {"--preset", "tiny", "--tp", "2"});
  EXPECT_FALSE(c.shape().sequence_parallel);
  EXPECT_EQ(c.config()["sequence_parallel"], false);
}

TEST(Gpt3Settings, ScheduleFlagsOverrideThePreset) {
  transformer::TransformerWorkload w(recipe());
  const train::RunFlags f = test::resolved(
      w, {"--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "2", "--decay-steps", "1000"});
  const train::TrainingConfig t = train::training_config(w, f);
  EXPECT_FLOAT_EQ(t.schedule.base_lr, 1e-3f);
  EXPECT_FLOAT_EQ(t.schedule.min_lr, 1e-4f);
  EXPECT_EQ(t.schedule.warmup_steps, 2);
  EXPECT_EQ(t.schedule.total_steps, 1000);
  EXPECT_FLOAT_EQ(t.adam.beta2, 0.95f) << "the rest stays MLPerf's";
}

TEST(Gpt3Settings, MlperfSchedule) {
  const train::TrainingConfig gbs1536 = mlperf_training(1536);
  EXPECT_EQ(gbs1536.schedule.warmup_steps, 265);
  EXPECT_EQ(gbs1536.schedule.total_steps, 108600);  // 166,809,600 samples
  EXPECT_FLOAT_EQ(gbs1536.schedule.base_lr, 2e-5f);
  EXPECT_FLOAT_EQ(gbs1536.schedule.min_lr, 2e-6f);
  EXPECT_FLOAT_EQ(gbs1536.adam.beta2, 0.95f);
  EXPECT_FLOAT_EQ(gbs1536.adam.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(gbs1536.clip_norm, 1.0f);
  EXPECT_EQ(mlperf_training(1).schedule.warmup_steps, 407040);
  EXPECT_EQ(mlperf_training(1000).schedule.warmup_steps, 408);  // ceil(407040 / 1000)
}

TEST(Gpt3Shapes, ShardsOfTheMlperfLayout) {
  auto preset = [](const std::string& name) {
    for (const transformer::Preset& p : recipe().presets)
      if (p.info.name == name) return p.shape;
    throw Error("test", "no preset", name);
  };
  const transformer::TransformerShape tp4 = preset("175b-tp4");
  EXPECT_EQ(tp4.padded_vocab(), 50688);  // 50257 up to a multiple of 128 x 4
  EXPECT_EQ(tp4.vocab_shard(), 12672);
  EXPECT_EQ(tp4.heads_shard(), 24);
  EXPECT_EQ(tp4.attn_width(), 3072);
  EXPECT_EQ(tp4.qkv_width(), 9216);  // QKV GEMM 2048x12288 by 12288x9216
  EXPECT_EQ(tp4.ffn_shard(), 12288);
  EXPECT_EQ(tp4.tokens(), 2048);
  const transformer::TransformerShape tp8 = preset("175b-tp8");
  EXPECT_EQ(tp8.padded_vocab(), 51200);
  EXPECT_EQ(tp8.vocab_shard(), 6400);
  EXPECT_EQ(tp8.heads_shard(), 12);
  EXPECT_EQ(tp8.ffn_shard(), 6144);
  const transformer::TransformerShape tiny = preset("tiny");
  EXPECT_EQ(tiny.padded_vocab(), 512);
  EXPECT_NO_THROW(tiny.validate());
  transformer::TransformerShape bad = tp4;
  bad.layers = 1;
  bad.heads = 94;  // not a multiple of tp 4
  EXPECT_THROW(bad.validate(), Error);
}

TEST(ParamStoreLayout, AlignedOffsetsAndRanges) {
  train::ParamStore store;
  auto spec = [](const char* name, std::vector<int64_t> shape, train::ParamInit init, float stddev,
                 bool decay) {
    train::ParamSpec s;
    s.name = name, s.shape = std::move(shape), s.init = init, s.stddev = stddev;
    s.weight_decay = decay;
    return s;
  };
  const auto a = store.add(spec("a", {3, 5}, train::ParamInit::kNormal, 0.02f, true));
  const auto b = store.add(spec("b", {7}, train::ParamInit::kZeros, 0.0f, false));
  const auto c = store.add(spec("c", {128, 2}, train::ParamInit::kOnes, 0.0f, false));
  EXPECT_EQ(store.offset(a), 0);
  EXPECT_EQ(store.offset(b), 128);
  EXPECT_EQ(store.offset(c), 256);
  EXPECT_EQ(store.total_numel(), 15 + 7 + 256);
  EXPECT_EQ(store.buffer_numel(), 512);
  EXPECT_EQ(store.numel(c), 256);
  EXPECT_EQ(store.spec(b).name, "b");
  EXPECT_EQ(store.weight_dtype(), DType::kBF16);
  EXPECT_EQ(train::ParamStore(DType::kFP16).weight_dtype(), DType::kFP16);
  EXPECT_THROW(train::ParamStore(DType::kINT32), Error);
}

}  // namespace
}  // namespace replay::gpt3
