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

// GPT-3 Small (Brown et al. 2020, table 2.1): 125M parameters, 12 layers of width 768, 12 heads of
// 64, the GPT-3 vocabulary and a sequence of 1024 (GPT-3 used 2048; 1024 keeps a micro-batch of 8
// on one GPU with room to spare). Dropout 0, as MLPerf. Its generated data use the first 8192
// tokens of the vocabulary (Recipe: data_vocab), so that its floor is a few thousand steps away.
TransformerShape small() {
  TransformerShape s;
  s.layers = 12;
  s.hidden = 768;
  s.heads = 12;
  s.head_dim = 64;
  s.ffn = 4 * 768;
  s.seq = 1024;
  s.micro_batch = 8;
  s.vocab = 50257;
  s.dropout = 0.0f;
  return s;
}

// The small preset's schedule: GPT-3 Small's peak 6e-4 after a short warm-up, cosine decay to a
// tenth.
train::LrSchedule small_schedule() {
  train::LrSchedule s;
  s.kind = train::LrKind::kWarmupCosine;
  s.base_lr = 6e-4f;
  s.min_lr = 6e-5f;
  s.warmup_steps = 100;
  s.total_steps = 4000;
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
          {{"small",
            "GPT-3 Small (125M, 12 layers of width 768, sequence 1024, micro-batch 8): time to "
            "train on one GPU",
            2000},
           small(),
           small_schedule(),
           32768,
           8192},
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
