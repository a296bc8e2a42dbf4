// gpt3.cpp: the GPT-3 175B recipe of replay-gpt3: presets, MLPerf optimizer and log keys.
#include "workloads/gpt3/gpt3.h"

#include "common/bench/mllog.h"
#include "common/check.h"

namespace replay::gpt3 {

using transformer::TransformerShape;

namespace {

TransformerShape gpt3_175b(int tp) {
  TransformerShape s;
  s.layers = 0;  // from the memory budget
  s.hidden = 12288;
  s.heads = 96;
  s.head_dim = 128;
  s.ffn = 4 * 12288;
  s.seq = 2048;
  s.micro_batch = 1;
  s.vocab = 50257;
  s.tp = tp;
  s.dropout = 0.0f;  // MLPerf
  return s;
}

TransformerShape tiny() {
  TransformerShape s;
  s.layers = 2;
  s.hidden = 128;
  s.heads = 2;
  s.head_dim = 64;
  s.ffn = 512;
  s.seq = 128;
  s.micro_batch = 2;
  s.vocab = 512;
  return s;
}

}  // namespace

train::TrainingConfig mlperf_training(int64_t global_batch) {
  REPLAY_REQUIRE(global_batch >= 1, "global batch must be positive");
  constexpr int64_t kWarmupSamples = 265 * 1536, kDecaySamples = 166809600;
  train::TrainingConfig o;
  o.adam = AdamWHyper{0.9f, 0.95f, 1e-8f, 0.1f};
  o.schedule.kind = train::LrKind::kWarmupCosine;
  o.schedule.base_lr = 2e-5f;
  o.schedule.min_lr = 2e-6f;
  o.schedule.warmup_steps = (kWarmupSamples + global_batch - 1) / global_batch;
  o.schedule.total_steps = (kDecaySamples + global_batch - 1) / global_batch;
  o.schedule_source =
      "MLPerf GPT-3: 265 x 1536 warm-up samples and 166,809,600 decay samples, in "
      "steps of the shard's global batch of " +
      std::to_string(global_batch) + " sequence(s)";
  o.clip_norm = 1.0f;
  return o;
}

const transformer::Recipe& recipe() {
  namespace k = bench::mlkey;
  static const transformer::Recipe r{
      {"replay-gpt3", "gpt3", "GPT-3", "tiny", "tokens", "tok", k::kGpt3},
      "GPT-3 175B",
      kModelLayers,
      {
          {{"tiny", "2 layers of width 128: the test model, seconds on one GPU", 20},
           tiny(),
           transformer::tiny_schedule()},
          {{"175b-tp4",
            "GPT-3 175B, one GPU of NVIDIA's H100 layout (TP4, micro-batch 1, sequence 2048)", 50},
           gpt3_175b(4),
           std::nullopt},
          {{"175b-tp8", "GPT-3 175B, one GPU at TP8 (micro-batch 1, sequence 2048)", 50},
           gpt3_175b(8),
           std::nullopt},
      },
      mlperf_training,
      {"adam", k::kOptAdamBeta1, k::kOptAdamBeta2, k::kOptAdamEpsilon, k::kOptWeightDecay},
      /*report_kv_heads=*/false,
  };
  return r;
}

}  // namespace replay::gpt3
