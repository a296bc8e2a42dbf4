// syncfree.h: what keeps the host out of the step: device-resident step scalars, learning-rate schedules
// evaluated on the device from the step counter (with identical host formulas for tests), found-inf over
// many tensors, dynamic loss scaling with hysteresis on the device, the no-op flag optimizer kernels read,
// grad-norm clipping through replay_optim, and a pinned readback ring the host reads steps late.
//
// A training step on the device, in order (every call is capturable):
//   begin_step(s)                          found_inf = 0, noop = 0
//   ... forward and backward ...
//   check_found_inf(table, &s->found_inf)  fp16/bf16/fp32 tensors (with loss scaling)
//   clip_grad_norm(norms, max_norm, s)     grad_norm, grad_scale (clip / loss_scale), found_inf on NaN/Inf
//   prepare_optimizer(schedule, s)         noop = found_inf or hold; unless noop: step += 1, lr = schedule(step - 1)
//   adamw_step(..., &s->lr, &s->step, &s->grad_scale, &s->noop)
//   readback.copy(stream)                  this step's scalars into the pinned ring
//   end_step(s, scaler)                    loss-scale update from found_inf; iteration += 1
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/arena.h"
#include "common/optim/grad_norm.h"
#include "common/optim/multi_tensor.h"
#include "common/philox.h"  // REPLAY_HOST_DEVICE
#include "common/tensor.h"

namespace replay::graphs {

// The scalars of a training step, in device memory (one arena buffer); kernels take pointers to fields.
// Register the whole struct as StepPlan state so warm-up leaves it untouched.
struct StepScalars {
  int64_t step;             // optimizer steps taken, this one included once prepare_optimizer ran (t >= 1)
  int64_t iteration;        // steps executed, skipped ones included (0 during the first step)
  float lr;                 // learning rate of this step
  float loss;               // loss of this step (written by the loss kernel)
  float loss_scale;         // dynamic loss scale (1 without loss scaling)
  float grad_norm;          // global L2 norm of the unscaled gradients
  float grad_scale;         // multiplier the optimizer applies to gradients: clip coefficient / loss_scale
  int32_t found_inf;        // 1 when a gradient (or the grad norm) is Inf or NaN this step
  int32_t noop;             // 1: optimizer kernels return at once (set from found_inf)
  int32_t growth_tracker;   // loss scaler: consecutive finite steps since the scale last changed
  int32_t hysteresis_left;  // loss scaler: overflows still tolerated before the scale backs off
  int32_t hold;             // 1 during StepPlan's neutral warm-up: the optimizer applies nothing, so
                            // parameters and optimizer state need no saving (StepPlan::set_warmup_hold)
};

// Reserves a StepScalars in an arena plan (lifetime: the whole run).
BufferId plan_step_scalars(ArenaPlan& plan, const std::string& name = "graphs.step_scalars");
// The struct viewed as bytes, for StepPlan::add_state and RegionArgs.
TensorView step_scalars_view(StepScalars* s);
// Sets every field: step 0, iteration 0, lr 0, loss 0, the scaler's initial scale and hysteresis, flags 0.
void init_step_scalars(StepScalars* s, float loss_scale, int32_t hysteresis, cudaStream_t stream);

// ---- Learning-rate schedules ----
// s is the 0-based index of the optimizer step (StepScalars::step - 1).
//   kWarmupCosine:   s < W: base * (s + 1) / W;  W <= s < T: min + (base - min) * (1 + cos(pi (s - W) / (T - W))) / 2;
//                    s >= T: min
//   kWarmupConstant: s < W: base * (s + 1) / W;  else base
//   kRnntWarmupHoldDecay (MLPerf RNN-T reference lr_policy; epochs of steps_per_epoch steps, 1-based epoch
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
        const double p = static_cast<double>(s - sc.warmup_steps) / static_cast<double>(sc.total_steps - sc.warmup_steps);
        lr = lo + (base - lo) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
      } else {
        lr = lo;
      }
      break;
    case LrKind::kWarmupConstant:
      lr = s < sc.warmup_steps ? base * static_cast<double>(s + 1) / static_cast<double>(sc.warmup_steps) : base;
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
        lr = base * pow(static_cast<double>(sc.gamma), static_cast<double>(epoch - sc.warmup_epochs - sc.hold_epochs));
      }
      lr = lr > lo ? lr : lo;
      break;
    }
    default: lr = base;
  }
  return static_cast<float>(lr);
}

// Checks a schedule's parameters (positive warm-up where used, T > W, ...); throws Error naming the field.
void validate(const LrSchedule& schedule);

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
      if (grown <= c.max_scale && grown <= 3.40282347e38f) s.loss_scale = grown;  // finite and within max
    }
  }
}

// The optimizer side of a step, host mirror of prepare_optimizer(): noop from found_inf (or the warm-up
// hold), step and lr.
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

// ---- Found-inf over many tensors ----
struct FoundInfTensor {
  const void* data;
  int64_t numel;
  int32_t dtype;  // DType as an integer: kBF16, kFP16 or kFP32
  int32_t pad;
};
using FoundInfTable = MultiTensorTable<FoundInfTensor>;

// Packs the table at set-up: add() every tensor, query device_bytes(), build() into that memory.
class FoundInfTableBuilder {
 public:
  void add(const TensorView& tensor);  // bf16, fp16 or fp32, contiguous
  size_t device_bytes() const { return builder_.device_bytes(); }
  FoundInfTable build(void* device, size_t bytes, cudaStream_t stream) const {
    return builder_.build(device, bytes, stream);
  }

 private:
  MultiTensorBuilder<FoundInfTensor> builder_;
};

// Sets *found_inf = 1 when any element of any tensor is Inf or NaN; leaves it unchanged otherwise (so
// several checks can share the flag; begin_step clears it). One launch for the whole table.
void check_found_inf(const FoundInfTable& table, int32_t* found_inf, cudaStream_t stream);

// ---- Grad-norm clipping (replay_optim's kernels, wired to the step scalars) ----
// grad_norm = ||g|| / loss_scale, grad_scale = min(1, max_norm / (grad_norm + 1e-6)) / loss_scale
// (max_norm <= 0: no clipping), found_inf = 1 when the norm is not finite.
void clip_grad_norm(const GradNormTable& table, float max_norm, StepScalars* s, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// ---- Asynchronous readback ----
// Selected device scalars are copied every step, by a captured kernel, into slot (*iteration % slots) of a
// pinned, device-mapped host ring, with the iteration as a tag. After enqueuing step s the host records
// one event (outside any graph); read(s - lag) waits for step s - lag only, never for the current step.
enum class ScalarType { kF32, kI32, kI64 };

struct ReadbackField {
  std::string name;
  const void* device;  // a device scalar (e.g. &scalars->loss)
  ScalarType type;
};

struct ReadbackSample {
  int64_t iteration = -1;
  std::vector<std::string> names;
  std::vector<double> values;
  double get(const std::string& name) const;  // throws naming an unknown field
};

struct ReadbackSlot;  // one slot of the pinned ring (syncfree.cu)

class ReadbackRing {
 public:
  static constexpr int kMaxFields = 8;

  // `iteration`: a device int64 holding the 0-based index of the executing step when copy() runs
  // (StepScalars::iteration, with copy() before end_step()). Allocates the pinned ring and the events:
  // set-up only.
  ReadbackRing(int slots, const int64_t* iteration, std::vector<ReadbackField> fields);
  ~ReadbackRing();
  ReadbackRing(const ReadbackRing&) = delete;
  ReadbackRing& operator=(const ReadbackRing&) = delete;

  // Inside the step (captured in graph modes): one kernel writes every field into the slot.
  void copy(cudaStream_t stream) const;
  // After the host has enqueued a step (outside graphs): records that step's event.
  void step_enqueued(cudaStream_t stream);
  int64_t steps_enqueued() const { return enqueued_; }

  // Step s's values, s one of the last `slots` steps enqueued: waits for that step's event only.
  // Throws when the slot holds another iteration (the device counter and the host disagree).
  ReadbackSample read(int64_t s) const;
  // The same without waiting: nothing when step s has not finished.
  std::optional<ReadbackSample> try_read(int64_t s) const;

 private:
  ReadbackSample decode(int64_t s) const;
  void check_readable(int64_t s) const;

  int slots_ = 0;
  const int64_t* iteration_ = nullptr;
  std::vector<ReadbackField> fields_;
  ReadbackSlot* host_ = nullptr;    // pinned, mapped
  ReadbackSlot* device_ = nullptr;  // the same memory as the device sees it
  std::vector<cudaEvent_t> events_;
  int64_t enqueued_ = 0;
};

}  // namespace replay::graphs
