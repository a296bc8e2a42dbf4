// gpt3.h: replay-gpt3: the GPT-3 175B recipe for the shared transformer workload
// (workloads/transformer/workload.h): presets (a tiny test model, and one GPU's slice of NVIDIA's
// H100 layout at TP4 or TP8), MLPerf's GPT-3 hyperparameters and the log keys that differ.
#pragma once

#include <cstdint>

#include "workloads/transformer/workload.h"

namespace replay::gpt3 {

constexpr int64_t kModelLayers = 96;  // GPT-3 175B

// MLPerf GPT-3: Adam with decoupled weight decay 0.1, betas 0.9/0.95,
// eps 1e-8, clip 1.0, learning rate 2e-5 with linear warm-up over 407,040 samples (ceil(265 x 1536
// / GBS) steps) and cosine decay to 2e-6 at 166,809,600 samples.
train::TrainingConfig mlperf_training(int64_t global_batch);

// The recipe the shared workload runs: transformer::TransformerWorkload w(recipe()).
const transformer::Recipe& recipe();

}  // namespace replay::gpt3
