// step_scalars.h: the scalars of a training step, in device memory, and the training policies that
// keep the host out of the step: the optimizer's step counter and learning rate (schedule.h),
// dynamic loss scaling with hysteresis decided from the found-inf flag, the no-op flag that makes
// the optimizer return early on overflow, and grad-norm clipping. Every call is a capturable launch
// that reads and writes StepScalars on the device.
//
// A training step on the device, in order:
//   begin_step(s)                          found_inf = 0, noop = 0
//   ... forward and backward (the loss gradient scaled by s->loss_scale) ...
//   check_found_inf(table, &s->found_inf)  fp16/bf16/fp32 tensors (with loss scaling;
//   optim/found_inf.h) clip_grad_norm(norms, max_norm, s)     grad_norm, grad_scale (clip /
//   loss_scale), found_inf on NaN/Inf prepare_optimizer(schedule, s)         noop = found_inf or
//   hold; unless noop: step += 1, lr = schedule(step - 1) adamw_step(..., &s->lr, &s->step,
//   &s->grad_scale, &s->noop) readback.copy(stream)                  this step's scalars into the
//   pinned ring (graphs/readback.h) end_step(s, scaler)                    loss-scale update from
//   found_inf; iteration += 1
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/arena.h"
#include "common/optim/grad_norm.h"
#include "common/philox.h"  // REPLAY_HOST_DEVICE
#include "common/tensor.h"
#include "train/schedule.h"

namespace replay::train {

// One arena buffer; kernels take pointers to fields. Register the whole struct as StepPlan state so
// warm-up leaves it untouched.
struct StepScalars {
  int64_t step;  // optimizer steps taken, this one included once prepare_optimizer ran (t >= 1)
  int64_t iteration;  // steps executed, skipped ones included (0 during the first step)
  float lr;           // learning rate of this step
  float loss;         // loss of this step (written by the loss kernel)
  float loss_scale;   // dynamic loss scale (1 without loss scaling)
  float grad_norm;    // global L2 norm of the unscaled gradients
  float grad_scale;  // multiplier the optimizer applies to gradients: clip coefficient / loss_scale
  int32_t found_inf;        // 1 when a gradient (or the grad norm) is Inf or NaN this step
  int32_t noop;             // 1: optimizer kernels return at once (set from found_inf)
  int32_t growth_tracker;   // loss scaler: consecutive finite steps since the scale last changed
  int32_t hysteresis_left;  // loss scaler: overflows still tolerated before the scale backs off
  int32_t hold;  // 1 during StepPlan's neutral warm-up: the optimizer applies nothing, so
                 // parameters and optimizer state need no saving (StepPlan::set_warmup_hold)
};

// Reserves a StepScalars in an arena plan (lifetime: the whole run).
BufferId plan_step_scalars(ArenaPlan& plan, const std::string& name = "train.step_scalars");
// The struct viewed as bytes, for StepPlan::add_state and RegionArgs.
TensorView step_scalars_view(StepScalars* s);
// Sets every field: step 0, iteration 0, lr 0, loss 0, the scaler's initial scale and hysteresis,
// flags 0.
void init_step_scalars(StepScalars* s, float loss_scale, int32_t hysteresis, cudaStream_t stream);

// ---- Dynamic loss scaling ----
// PyTorch GradScaler with Megatron's hysteresis (DynamicGradScaler), per step, from found_inf:
//   overflow:  growth_tracker = 0; hysteresis_left -= 1 (not below 0);
//              if hysteresis_left <= 0: scale = max(scale * backoff_factor, min_scale)
//   finite:    growth_tracker += 1; when it reaches growth_interval: growth_tracker = 0,
//              hysteresis_left = hysteresis, and scale *= growth_factor if the result is finite and
//              <= max_scale (GradScaler keeps the scale when growth would overflow).
// As in Megatron, hysteresis is replenished only when the scale grows, so after it is spent every
// overflow backs off until the next growth. hysteresis = 1 is plain GradScaler behaviour.
struct LossScalerConfig {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  int32_t hysteresis = 2;
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  // 2^24
};
// Throws Error naming the field when the configuration cannot work.
void validate(const LossScalerConfig& config);

REPLAY_HOST_DEVICE void loss_scaler_update(StepScalars& s, const LossScalerConfig& c) {
  if (s.found_inf != 0) {
    s.growth_tracker = 0;
    if (s.hysteresis_left > 0) s.hysteresis_left -= 1;
    if (s.hysteresis_left <= 0) {
      const float backed = s.loss_scale * c.backoff_factor;
      s.loss_scale = backed > c.min_scale ? backed : c.min_scale;
    }
  } else {
    s.growth_tracker += 1;
    if (s.growth_tracker >= c.growth_interval) {
      s.growth_tracker = 0;
      s.hysteresis_left = c.hysteresis;
      const float grown = s.loss_scale * c.growth_factor;
      if (grown <= c.max_scale && grown <= 3.40282347e38f)
        s.loss_scale = grown;  // finite, within max
    }
  }
}

// The optimizer side of a step, host mirror of prepare_optimizer(): noop from found_inf (or the
// warm-up hold), step and lr.
REPLAY_HOST_DEVICE void prepare_optimizer_update(StepScalars& s, const LrSchedule& sc) {
  s.noop = s.found_inf != 0 || s.hold != 0 ? 1 : 0;
  if (s.noop == 0) {
    s.step += 1;
    s.lr = lr_at(sc, s.step - 1);
  }
}

// ---- Device step bookkeeping (one single-thread kernel each) ----
void begin_step(StepScalars* s, cudaStream_t stream);
void prepare_optimizer(const LrSchedule& schedule, StepScalars* s, cudaStream_t stream);
// scaler: nullptr when the run does not scale the loss.
void end_step(StepScalars* s, const LossScalerConfig* scaler, cudaStream_t stream);
// lr = lr_at(schedule, *step - 1) alone, for workloads that keep their own step counter.
void compute_lr(const LrSchedule& schedule, const int64_t* step, float* lr, cudaStream_t stream);

// ---- Grad-norm clipping (common/optim's kernel, wired to the step scalars) ----
// grad_norm = ||g|| / loss_scale, grad_scale = min(1, max_norm / (grad_norm + 1e-6)) / loss_scale
// (max_norm <= 0: no clipping), found_inf = 1 when the norm is not finite.
void clip_grad_norm(const GradNormTable& table, float max_norm, StepScalars* s, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay::train
