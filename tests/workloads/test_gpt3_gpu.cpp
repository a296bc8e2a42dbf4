// replay-gpt3's tiny preset on the GPU (the checks themselves:
// tests/workloads/workload_test_util.h):
// - Gpt3Modes: none, layer and full (graph modes with --verify-graphs on step 0) train 12 steps
//   with dropout 0.1 and give bit-identical losses, bf16 weights and fp32 master weights, with the
//   graph counts each mode implies; the loss falls. With two micro-batches too (gradient
//   accumulation).
// - Gpt3Reference: one step's loss, every parameter gradient and the embedding-output gradient
//   match the fp64 CPU model of the same network (tests/workloads/gpt_reference.h), dropout 0.
// - Gpt3Binary: the executable writes a JSON summary with SCHEMA.md's fields and a complete mllog.
// - Gpt3Mllog (registered separately, exit 77 without the checker): that mllog passes MLCommons'
//   compliance checker with replay's shard rules.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/workloads/gpt_reference.h"
#include "tests/workloads/workload_test_util.h"
#include "workloads/gpt3/gpt3.h"

namespace replay::gpt3 {
namespace {

TEST(Gpt3Modes, LossesAndWeightsAreBitIdenticalAcrossModesAndTheLossFalls) {
  test::expect_modes_bit_identical_and_loss_falls(recipe(), {"--steps", "12", "--dropout", "0.1"});
}

TEST(Gpt3Schedule, TheTinyPresetLearnsWithinAFewHundredSteps) {
  test::expect_tiny_schedule_learns(recipe());
}

TEST(Gpt3TimeToTrain, ReachesItsTargetAtTheSameStepInEveryMode) {
  test::expect_time_to_train(recipe());
}

TEST(Gpt3Checkpoint, ResumeIsBitExactInEveryMode) {
  test::expect_resume_bit_exact(recipe());
}

TEST(Gpt3Modes, GradientAccumulationIsBitIdenticalAcrossModes) {
  test::ModeRuns runs;
  ASSERT_NO_FATAL_FAILURE(test::expect_accumulation_bit_identical(
      recipe(), {"--steps", "4", "--dropout", "0.1", "--microbatches", "2"}, &runs));
  EXPECT_EQ(runs.layer.report.graph_count, 8);
}

TEST(Gpt3Reference, OneStepMatchesTheCpuModel) {
  transformer::TransformerWorkload w(recipe());
  const train::RunFlags f =
      test::resolved(w, test::tiny_args({"--graphs", "none", "--dropout", "0", "--warmup", "0"}));
  const transformer::TransformerShape& sh = w.shape();
  test::GptDims d;
  d.batch = sh.micro_batch, d.seq = sh.seq, d.hidden = sh.hidden, d.heads = sh.heads,
  d.head_dim = sh.head_dim;
  d.ffn = sh.ffn, d.vocab = sh.padded_vocab(), d.layers = sh.layers, d.eps = sh.norm_eps;
  test::ReferenceModel ref;
  ref.count = test::GptParams::count(d);
  ref.sizes = test::GptParams::sizes(d);
  ref.name = [&](int id) { return test::GptParams::name(d, id); };
  ref.backward = [&](std::vector<std::vector<double>> params, const int32_t* tokens,
                     const int32_t* targets, std::vector<std::vector<double>>* grads,
                     std::vector<double>* dx0) {
    const test::GptParams p{std::move(params)};
    test::GptParams g;
    const double loss = test::gpt_backward(d, p, tokens, targets, &g, dx0);
    *grads = std::move(g.t);
    return loss;
  };
  test::expect_one_step_matches(w, f, ref);
}

TEST(Gpt3Binary, WritesTheJsonSummaryAndACompleteMllog) {
  test::expect_summary_and_mllog(recipe(), REPLAY_GPT3_BINARY, {});
}

TEST(Gpt3Mllog, TinyRunPassesTheComplianceChecker) {
  test::expect_mllog_passes_checker(recipe(), REPLAY_GPT3_BINARY, "shard_gpt3.yaml");
}

}  // namespace
}  // namespace replay::gpt3
