// llama31.cpp: the Llama 3.1 405B recipe of replay-llama31: presets, MLPerf optimizer and log keys.
#include "workloads/llama31/llama31.h"

#include "common/bench/mllog.h"
#include "common/check.h"

namespace replay::llama31 {

using transformer::TransformerShape;

namespace {

// The Llama options of the shared transformer: RMSNorm (eps 1e-5), RoPE base 500000 with the
// Llama 3.1 frequency scaling, SwiGLU, no biases, untied LM head, no dropout. The vocabulary is
// padded to a multiple of 8 x TP only, so 32000 splits exactly (4000 per GPU at TP8).
TransformerShape llama_options(TransformerShape s) {
  s.norm = transformer::NormKind::kRMSNorm;
  s.norm_eps = 1e-5f;
  s.position = transformer::PositionKind::kRope;
  s.rope_theta = 500000.0;
  s.rope_llama31_scaling = true;
  s.mlp = transformer::MlpKind::kSwiGLU;
  s.bias = false;
  s.tied_embedding = false;
  s.dropout = 0.0f;  // MLPerf
  s.vocab_multiple = 8;
  return s;
}

TransformerShape llama31_405b(int tp) {
  TransformerShape s;
  s.layers = 0;  // from the memory budget
  s.hidden = 16384;
  s.heads = 128;
  s.heads_kv = 8;
  s.head_dim = 128;
  s.ffn = 53248;
  s.seq = 8192;
  s.micro_batch = 1;
  s.vocab = 32000;
  s.tp = tp;
  return llama_options(s);
}

TransformerShape tiny() {
  TransformerShape s;
  s.layers = 2;
  s.hidden = 128;
  s.heads = 4;  // 2 KV heads: the tensor-parallel tests split them over 2 ranks
  s.heads_kv = 2;
  s.head_dim = 64;
  s.ffn = 256;
  s.seq = 128;
  s.micro_batch = 2;
  s.vocab = 512;
  return llama_options(s);
}

}  // namespace

train::TrainingConfig mlperf_training(int64_t global_batch) {
  REPLAY_REQUIRE(global_batch >= 1, "global batch must be positive");
  constexpr int64_t kReferenceBatch = 1152, kWarmupSteps = 8000, kDecaySteps = 1200000;
  train::TrainingConfig o;
  o.adam = AdamWHyper{0.9f, 0.95f, 1e-5f, 0.1f};
  o.schedule.kind = train::LrKind::kWarmupCosine;
  o.schedule.base_lr = static_cast<float>(8e-5 * static_cast<double>(global_batch) /
                                          static_cast<double>(kReferenceBatch));
  o.schedule.min_lr = 8e-7f;
  o.schedule.warmup_steps = (kWarmupSteps * kReferenceBatch + global_batch - 1) / global_batch;
  o.schedule.total_steps = (kDecaySteps * kReferenceBatch + global_batch - 1) / global_batch;
  o.schedule_source =
      "MLPerf Llama 3.1 405B: 8000 warm-up and 1,200,000 decay steps of 1152 "
      "sequences, and 8e-5 x GBS / 1152, at the shard's global batch of " +
      std::to_string(global_batch) + " sequence(s)";
  o.clip_norm = 1.0f;
  return o;
}

const transformer::Recipe& recipe() {
  namespace k = bench::mlkey;
  static const transformer::Recipe r{
      {"replay-llama31", "llama31", "Llama 3.1", "tiny", "tokens", "tok", k::kLlama31_405b},
      "Llama 3.1 405B",
      kModelLayers,
      {
          {{"tiny", "2 layers of width 128, 4 query heads and 2 KV heads of 64: the test model",
            20},
           tiny(),
           transformer::tiny_schedule()},
          {{"405b-tp8",
            "Llama 3.1 405B, one GPU of NVIDIA's H100 layout (TP8, micro-batch 1, sequence 8192)",
            20},
           llama31_405b(8),
           std::nullopt},
          {{"405b-tp4",
            "Llama 3.1 405B, one GPU of the H200 layout (TP4, micro-batch 1, sequence 8192)", 20},
           llama31_405b(4),
           std::nullopt},
      },
      mlperf_training,
      {"adamw", k::kOptAdamwBeta1, k::kOptAdamwBeta2, k::kOptAdamwEpsilon, k::kOptAdamwWeightDecay},
      /*report_kv_heads=*/true,
  };
  return r;
}

}  // namespace replay::llama31
