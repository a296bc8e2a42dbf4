// replay-llama31's tiny preset on the GPU (RMSNorm, RoPE, GQA with 4 query heads on 2 KV heads,
// SwiGLU, no biases, untied LM head; the checks themselves: tests/workloads/workload_test_util.h):
// - Llama31Modes: none, layer and full (graph modes with --verify-graphs on step 0) train 12 steps
//   and give bit-identical losses, bf16 weights and fp32 master weights, with the graph counts each
//   mode implies; the loss falls. With two micro-batches too (gradient accumulation inside the
//   step, all of it in the full-iteration graph).
// - Llama31Reference: one step's loss, every parameter gradient and the embedding-output gradient
//   match the fp64 CPU model of the same network (tests/workloads/llama_reference.h).
// - Llama31Binary: the executable writes a JSON summary with SCHEMA.md's fields and a complete
//   mllog.
// - Llama31Mllog (registered separately, exit 77 without the checker): that mllog passes MLCommons'
//   compliance checker with replay's shard rules (shard_llama31_405b.yaml).
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/workloads/llama_reference.h"
#include "tests/workloads/workload_test_util.h"
#include "workloads/llama31/llama31.h"

namespace replay::llama31 {
namespace {

TEST(Llama31Modes, LossesAndWeightsAreBitIdenticalAcrossModesAndTheLossFalls) {
  test::expect_modes_bit_identical_and_loss_falls(recipe(), {"--steps", "12"});
}

TEST(Llama31Schedule, TheTinyPresetLearnsWithinAFewHundredSteps) {
  test::expect_tiny_schedule_learns(recipe());
}

TEST(Llama31TimeToTrain, ReachesItsTargetAtTheSameStepInEveryMode) {
  test::expect_time_to_train(recipe());
}

TEST(Llama31Checkpoint, ResumeIsBitExactInEveryMode) {
  test::expect_resume_bit_exact(recipe());
}

TEST(Llama31Modes, GradientAccumulationIsBitIdenticalAcrossModes) {
  test::ModeRuns runs;
  ASSERT_NO_FATAL_FAILURE(test::expect_accumulation_bit_identical(
      recipe(), {"--steps", "4", "--microbatches", "2"}, &runs));
  EXPECT_EQ(runs.layer.report.graph_count, 8);
  EXPECT_EQ(runs.full.report.graph_count, 1);  // both micro-batches and the optimizer in one graph
}

TEST(Llama31Reference, OneStepMatchesTheCpuModel) {
  transformer::TransformerWorkload w(recipe());
  const train::RunFlags f =
      test::resolved(w, test::tiny_args({"--graphs", "none", "--warmup", "0"}));
  const transformer::TransformerShape& sh = w.shape();
  test::LlamaDims d;
  d.batch = sh.micro_batch, d.seq = sh.seq, d.hidden = sh.hidden, d.heads = sh.heads;
  d.heads_kv = sh.kv_heads(), d.head_dim = sh.head_dim, d.ffn = sh.ffn;
  d.vocab = sh.padded_vocab(), d.layers = sh.layers, d.eps = sh.norm_eps;
  d.rope_theta = sh.rope_theta, d.rope_llama31_scaling = sh.rope_llama31_scaling;
  test::ReferenceModel ref;
  ref.count = test::LlamaParams::count(d);
  ref.sizes = test::LlamaParams::sizes(d);
  ref.name = [&](int id) { return test::LlamaParams::name(d, id); };
  ref.backward = [&](std::vector<std::vector<double>> params, const int32_t* tokens,
                     const int32_t* targets, std::vector<std::vector<double>>* grads,
                     std::vector<double>* dx0) {
    const test::LlamaParams p{std::move(params)};
    test::LlamaParams g;
    const double loss = test::llama_backward(d, p, tokens, targets, &g, dx0);
    *grads = std::move(g.t);
    return loss;
  };
  test::expect_one_step_matches(w, f, ref);
}

TEST(Llama31Binary, WritesTheJsonSummaryAndACompleteMllog) {
  test::expect_summary_and_mllog(recipe(), REPLAY_LLAMA31_BINARY, [](const nlohmann::json& j) {
    EXPECT_EQ(j["config"]["heads"], 4);
    EXPECT_EQ(j["config"]["kv_heads"], 2);
  });
}

TEST(Llama31Mllog, TinyRunPassesTheComplianceChecker) {
  test::expect_mllog_passes_checker(recipe(), REPLAY_LLAMA31_BINARY, "shard_llama31_405b.yaml");
}

}  // namespace
}  // namespace replay::llama31
