// llama31.h: replay-llama31: the Llama 3.1 405B recipe for the shared transformer workload
// (workloads/transformer/workload.h): presets (a tiny test model, and one GPU's slice at TP8,
// NVIDIA's H100 layout, or TP4, the H200 layout), MLPerf's Llama 3.1 hyperparameters and the log
// keys that differ. The model is workloads/transformer/ with the Llama options (RMSNorm, RoPE, GQA,
// SwiGLU, no biases, untied LM head).
#pragma once

#include <cstdint>

#include "workloads/transformer/workload.h"

namespace replay::llama31 {

constexpr int64_t kModelLayers = 126;  // Llama 3.1 405B

// MLPerf Llama 3.1 405B: AdamW, betas 0.9/0.95, eps 1e-5, weight decay
// 0.1, clip 1.0, learning rate 8e-5 x GBS / 1152 with linear warm-up over ceil(8000 x 1152 / GBS)
// steps and cosine decay to 8e-7 at ceil(1,200,000 x 1152 / GBS) steps.
train::TrainingConfig mlperf_training(int64_t global_batch);

// The recipe the shared workload runs: transformer::TransformerWorkload w(recipe()).
const transformer::Recipe& recipe();

}  // namespace replay::llama31
