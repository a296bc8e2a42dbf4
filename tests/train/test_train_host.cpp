// train/ on the CPU: learning-rate schedules (known values, validation), the loss scaler's
// hysteresis and clamps, and the optimizer's no-op on overflow (the host mirrors of the device
// kernels), and the distributed optimizer's memory (the optimizer state planned for one share).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/arena.h"
#include "train/params.h"
#include "train/schedule.h"
#include "train/step_scalars.h"

namespace replay::train {
namespace {

TEST(LrSchedule, WarmupCosineKnownValues) {
  LrSchedule sc;
  sc.kind = LrKind::kWarmupCosine;
  sc.base_lr = 1.0f;
  sc.min_lr = 0.1f;
  sc.warmup_steps = 10;
  sc.total_steps = 110;
  validate(sc);
  EXPECT_FLOAT_EQ(lr_at(sc, 0), 0.1f);
  EXPECT_FLOAT_EQ(lr_at(sc, 4), 0.5f);
  EXPECT_FLOAT_EQ(lr_at(sc, 9), 1.0f);
  EXPECT_FLOAT_EQ(lr_at(sc, 10), 1.0f);
  EXPECT_FLOAT_EQ(lr_at(sc, 35), static_cast<float>(0.1 + 0.45 * (1.0 + std::sqrt(0.5))));
  EXPECT_FLOAT_EQ(lr_at(sc, 60), 0.55f);
  EXPECT_FLOAT_EQ(lr_at(sc, 110), 0.1f);
  EXPECT_FLOAT_EQ(lr_at(sc, 100000), 0.1f);
  for (int64_t s = 11; s < 110; ++s)
    EXPECT_LT(lr_at(sc, s), lr_at(sc, s - 1)) << "decays monotonically at " << s;
}

TEST(LrSchedule, WarmupConstantKnownValues) {
  LrSchedule sc;
  sc.kind = LrKind::kWarmupConstant;
  sc.base_lr = 2.0f;
  sc.warmup_steps = 4;
  validate(sc);
  EXPECT_FLOAT_EQ(lr_at(sc, 0), 0.5f);
  EXPECT_FLOAT_EQ(lr_at(sc, 2), 1.5f);
  EXPECT_FLOAT_EQ(lr_at(sc, 3), 2.0f);
  EXPECT_FLOAT_EQ(lr_at(sc, 1000000), 2.0f);
}

TEST(LrSchedule, RnntWarmupHoldExponentialDecayKnownValues) {
  LrSchedule sc;
  sc.kind = LrKind::kRnntWarmupHoldDecay;
  sc.base_lr = 1.0f;
  sc.min_lr = 0.01f;
  sc.steps_per_epoch = 10;
  sc.warmup_epochs = 2;
  sc.hold_epochs = 3;
  sc.gamma = 0.5f;
  validate(sc);
  EXPECT_FLOAT_EQ(lr_at(sc, 0), static_cast<float>(1.0 / 21.0));
  EXPECT_FLOAT_EQ(lr_at(sc, 19), static_cast<float>(20.0 / 21.0));
  EXPECT_FLOAT_EQ(lr_at(sc, 20), 1.0f);
  EXPECT_FLOAT_EQ(lr_at(sc, 49), 1.0f);
  EXPECT_FLOAT_EQ(lr_at(sc, 50), 0.5f);  // epoch 6: gamma^1
  EXPECT_FLOAT_EQ(lr_at(sc, 59), 0.5f);
  EXPECT_FLOAT_EQ(lr_at(sc, 60), 0.25f);    // epoch 7: gamma^2
  EXPECT_FLOAT_EQ(lr_at(sc, 1000), 0.01f);  // clamped at min_lr
}

TEST(LrSchedule, ValidateNamesTheBadField) {
  LrSchedule sc;
  sc.kind = LrKind::kWarmupCosine;
  sc.warmup_steps = 10;
  sc.total_steps = 10;
  EXPECT_THROW(validate(sc), Error);
  sc.kind = LrKind::kRnntWarmupHoldDecay;
  sc.gamma = 0.0f;
  EXPECT_THROW(validate(sc), Error);
}

StepScalars fresh_scalars(float scale, int32_t hysteresis) {
  StepScalars s{};
  s.loss_scale = scale;
  s.hysteresis_left = hysteresis;
  return s;
}

TEST(LossScaler, HysteresisDelaysBackoffUntilSpent) {
  LossScalerConfig c;
  c.growth_interval = 3;
  c.hysteresis = 2;
  StepScalars s = fresh_scalars(1024.0f, c.hysteresis);
  s.found_inf = 1;
  loss_scaler_update(s, c);  // first overflow: tolerated
  EXPECT_EQ(s.loss_scale, 1024.0f);
  EXPECT_EQ(s.hysteresis_left, 1);
  s.found_inf = 0;
  loss_scaler_update(s, c);  // a good step does not replenish hysteresis (Megatron)
  EXPECT_EQ(s.hysteresis_left, 1);
  EXPECT_EQ(s.growth_tracker, 1);
  s.found_inf = 1;
  loss_scaler_update(s, c);  // second overflow: backs off
  EXPECT_EQ(s.loss_scale, 512.0f);
  EXPECT_EQ(s.growth_tracker, 0);
  loss_scaler_update(s, c);  // every further overflow backs off until the scale grows again
  EXPECT_EQ(s.loss_scale, 256.0f);
  s.found_inf = 0;
  for (int i = 0; i < 2; ++i) loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 256.0f);
  loss_scaler_update(s, c);  // third finite step in a row: grows, hysteresis replenished
  EXPECT_EQ(s.loss_scale, 512.0f);
  EXPECT_EQ(s.growth_tracker, 0);
  EXPECT_EQ(s.hysteresis_left, 2);
}

TEST(LossScaler, HysteresisOneIsGradScaler) {
  LossScalerConfig c;
  c.growth_interval = 2;
  c.hysteresis = 1;
  StepScalars s = fresh_scalars(65536.0f, 1);
  s.found_inf = 1;
  loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 32768.0f);
  s.found_inf = 0;
  loss_scaler_update(s, c);
  loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 65536.0f);
}

TEST(LossScaler, ClampsAtMinAndMax) {
  LossScalerConfig c;
  c.growth_interval = 1;
  c.hysteresis = 1;
  c.min_scale = 4.0f;
  c.max_scale = 64.0f;
  StepScalars s = fresh_scalars(8.0f, 1);
  s.found_inf = 1;
  for (int i = 0; i < 5; ++i) loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 4.0f);
  s.found_inf = 0;
  for (int i = 0; i < 10; ++i) loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 64.0f);
  s.loss_scale = 3e38f;  // growth would overflow to Inf: kept, as GradScaler does
  c.max_scale = INFINITY;
  loss_scaler_update(s, c);
  EXPECT_EQ(s.loss_scale, 3e38f);
}

TEST(StepScalars, PrepareOptimizerSkipsOnOverflow) {
  LrSchedule sc;
  sc.kind = LrKind::kWarmupConstant;
  sc.base_lr = 1.0f;
  sc.warmup_steps = 2;
  StepScalars s = fresh_scalars(1.0f, 1);
  prepare_optimizer_update(s, sc);
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.noop, 0);
  EXPECT_FLOAT_EQ(s.lr, 0.5f);
  s.found_inf = 1;
  prepare_optimizer_update(s, sc);
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.noop, 1);
  EXPECT_FLOAT_EQ(s.lr, 0.5f);
  s.found_inf = 0;
  prepare_optimizer_update(s, sc);
  EXPECT_EQ(s.step, 2);
  EXPECT_FLOAT_EQ(s.lr, 1.0f);
}

// ZeRO-1: with D data-parallel ranks the master weights and both Adam moments are planned for the
// rank's 1/D share of the flat layout; the weights and gradients stay whole.
TEST(ParamStore, TheDistributedOptimizersStateIsAShare) {
  auto bytes_of = [](const ArenaPlan& plan, const std::string& name) -> int64_t {
    for (const ArenaPlan::Entry& e : plan.entries())
      if (e.name == name) return static_cast<int64_t>(e.bytes);
    ADD_FAILURE() << "no buffer " << name;
    return -1;
  };
  for (const int count : {1, 2, 4}) {
    ParamStore ps;
    for (const auto& [name, shape] :
         {std::pair<const char*, std::vector<int64_t>>{"w", {1000, 300}},
          {"b", {300}},
          {"g", {77}}}) {
      ParamSpec spec;
      spec.name = name;
      spec.shape = shape;
      ps.add(spec);
    }
    if (count > 1) ps.set_shard(count - 1, count);
    ArenaPlan plan;
    ps.plan(plan, {1, 1});
    const int64_t whole = ps.buffer_numel();
    EXPECT_EQ(whole % (count * ParamStore::kAlignElements), 0) << count;
    EXPECT_EQ(ps.shard_numel() * count, whole);
    EXPECT_EQ(bytes_of(plan, "grads"), whole * 4) << count;
    EXPECT_EQ(bytes_of(plan, "params.bf16"), whole * 2) << count;
    for (const char* state : {"params.master", "adam.exp_avg", "adam.exp_avg_sq"})
      EXPECT_EQ(bytes_of(plan, state), whole / count * 4) << state << " at " << count << " ranks";
    if (count > 1) {
      EXPECT_THROW(ps.master(0), Error) << "one tensor's masters are not addressable in a share";
    }
  }
}

}  // namespace
}  // namespace replay::train
