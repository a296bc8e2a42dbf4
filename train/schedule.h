// schedule.h: learning-rate schedules evaluated on the device from the step counter, with the same
// formula on the host (tests, the printed configuration): linear warm-up then cosine decay (GPT-3,
// Llama 3.1), warm-up then constant, and the MLPerf RNN-T reference's warm-up, hold and
// exponential decay by epoch.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/philox.h"  // REPLAY_HOST_DEVICE

namespace replay::train {

// s is the 0-based index of the optimizer step (StepScalars::step - 1).
//   kWarmupCosine:   s < W: base * (s + 1) / W;  W <= s < T: min + (base - min) * (1 + cos(pi (s -
//   W) / (T - W))) / 2;
//                    s >= T: min
//   kWarmupConstant: s < W: base * (s + 1) / W;  else base
//   kRnntWarmupHoldDecay (MLPerf RNN-T reference lr_policy; epochs of steps_per_epoch steps,
//   1-based epoch
//                    e = s / steps_per_epoch + 1, W and H in epochs):
//                    s < W * spe: base * (s + 1) / (W * spe + 1);  s < (W + H) * spe: base;
//                    else base * gamma^(e - W - H); every phase clamped below at min_lr, as there
enum class LrKind { kWarmupCosine, kWarmupConstant, kRnntWarmupHoldDecay };

struct LrSchedule {
  LrKind kind = LrKind::kWarmupCosine;
  float base_lr = 0;
  float min_lr = 0;
  int64_t warmup_steps = 0;     // W (cosine, constant)
  int64_t total_steps = 0;      // T: end of the cosine decay
  int64_t steps_per_epoch = 1;  // RNN-T
  int64_t warmup_epochs = 0;    // RNN-T
  int64_t hold_epochs = 0;      // RNN-T
  float gamma = 1;              // RNN-T: decay per epoch
};

// The formula, shared by host and device (fp64 inside, rounded to fp32 once).
REPLAY_HOST_DEVICE float lr_at(const LrSchedule& sc, int64_t s) {
  double lr;
  const double base = sc.base_lr, lo = sc.min_lr;
  switch (sc.kind) {
    case LrKind::kWarmupCosine:
      if (s < sc.warmup_steps) {
        lr = base * static_cast<double>(s + 1) / static_cast<double>(sc.warmup_steps);
      } else if (s < sc.total_steps) {
        const double p = static_cast<double>(s - sc.warmup_steps) /
                         static_cast<double>(sc.total_steps - sc.warmup_steps);
        lr = lo + (base - lo) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
      } else {
        lr = lo;
      }
      break;
    case LrKind::kWarmupConstant:
      lr = s < sc.warmup_steps
               ? base * static_cast<double>(s + 1) / static_cast<double>(sc.warmup_steps)
               : base;
      break;
    case LrKind::kRnntWarmupHoldDecay: {
      const int64_t warmup = sc.warmup_epochs * sc.steps_per_epoch;
      const int64_t hold_end = (sc.warmup_epochs + sc.hold_epochs) * sc.steps_per_epoch;
      if (s < warmup) {
        lr = base * static_cast<double>(s + 1) / static_cast<double>(warmup + 1);
      } else if (s < hold_end) {
        lr = base;
      } else {
        const int64_t epoch = s / sc.steps_per_epoch + 1;
        lr = base * pow(static_cast<double>(sc.gamma),
                        static_cast<double>(epoch - sc.warmup_epochs - sc.hold_epochs));
      }
      lr = lr > lo ? lr : lo;
      break;
    }
    default:
      lr = base;
  }
  return static_cast<float>(lr);
}

// Checks a schedule's parameters (positive warm-up where used, T > W, ...); throws Error naming the
// field.
void validate(const LrSchedule& schedule);

// "warm-up 10 steps to 1e-3, cosine to 1e-4 at step 500", for the printed configuration.
std::string describe(const LrSchedule& schedule);

}  // namespace replay::train
