// schedule.cpp: schedule checks and descriptions (the formula is schedule.h's, shared with the
// device).
#include "train/schedule.h"

#include <cstdio>

#include "common/check.h"

namespace replay::train {

void validate(const LrSchedule& sc) {
  REPLAY_REQUIRE(sc.base_lr >= 0.0f && sc.min_lr >= 0.0f, "learning rates must be non-negative");
  switch (sc.kind) {
    case LrKind::kWarmupCosine:
      REPLAY_REQUIRE(sc.warmup_steps >= 1, "warm-up + cosine: warmup_steps must be >= 1");
      REPLAY_REQUIRE(sc.total_steps > sc.warmup_steps,
                     "warm-up + cosine: total_steps must exceed warmup_steps");
      break;
    case LrKind::kWarmupConstant:
      REPLAY_REQUIRE(sc.warmup_steps >= 1, "warm-up + constant: warmup_steps must be >= 1");
      break;
    case LrKind::kRnntWarmupHoldDecay:
      REPLAY_REQUIRE(sc.steps_per_epoch >= 1, "RNN-T schedule: steps_per_epoch must be >= 1");
      REPLAY_REQUIRE(sc.warmup_epochs >= 0 && sc.hold_epochs >= 0,
                     "RNN-T schedule: epochs must be >= 0");
      REPLAY_REQUIRE(sc.gamma > 0.0f && sc.gamma <= 1.0f,
                     "RNN-T schedule: gamma must be in (0, 1]");
      break;
  }
}

std::string describe(const LrSchedule& sc) {
  char buf[256];
  switch (sc.kind) {
    case LrKind::kWarmupCosine:
      std::snprintf(buf, sizeof(buf),
                    "linear warm-up over %lld steps to %g, cosine decay to %g at step %lld",
                    static_cast<long long>(sc.warmup_steps), static_cast<double>(sc.base_lr),
                    static_cast<double>(sc.min_lr), static_cast<long long>(sc.total_steps));
      break;
    case LrKind::kWarmupConstant:
      std::snprintf(buf, sizeof(buf), "linear warm-up over %lld steps to %g, then constant",
                    static_cast<long long>(sc.warmup_steps), static_cast<double>(sc.base_lr));
      break;
    case LrKind::kRnntWarmupHoldDecay:
      std::snprintf(
          buf, sizeof(buf),
          "epochs of %lld steps: warm-up %lld epochs to %g, hold %lld, then x%g per epoch "
          "(at least %g)",
          static_cast<long long>(sc.steps_per_epoch), static_cast<long long>(sc.warmup_epochs),
          static_cast<double>(sc.base_lr), static_cast<long long>(sc.hold_epochs),
          static_cast<double>(sc.gamma), static_cast<double>(sc.min_lr));
      break;
  }
  return buf;
}

}  // namespace replay::train
