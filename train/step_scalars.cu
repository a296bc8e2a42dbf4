// step_scalars.cu: the step-scalar kernels (one thread each) and the grad-norm wiring.
#include "train/step_scalars.h"

#include "common/check.h"

namespace replay::train {

// ---- Step scalars ----

namespace {

__global__ void init_step_scalars_kernel(StepScalars* s, float loss_scale, int32_t hysteresis) {
  StepScalars v{};
  v.loss_scale = loss_scale;
  v.grad_scale = 1.0f;
  v.hysteresis_left = hysteresis;
  *s = v;
}

__global__ void begin_step_kernel(StepScalars* s) {
  s->found_inf = 0;
  s->noop = 0;
}

// Writes only the fields it owns, so a kernel on another stream may write the others (loss, say).
__global__ void prepare_optimizer_kernel(StepScalars* s, LrSchedule schedule) {
  StepScalars v = *s;
  prepare_optimizer_update(v, schedule);
  s->noop = v.noop;
  s->step = v.step;
  s->lr = v.lr;
}

__global__ void end_step_kernel(StepScalars* s, LossScalerConfig scaler, bool scale) {
  StepScalars v = *s;
  if (scale) {
    loss_scaler_update(v, scaler);
    s->loss_scale = v.loss_scale;
    s->growth_tracker = v.growth_tracker;
    s->hysteresis_left = v.hysteresis_left;
  }
  s->iteration = v.iteration + 1;
}

__global__ void compute_lr_kernel(const int64_t* step, float* lr, LrSchedule schedule) {
  *lr = lr_at(schedule, *step - 1);
}

}  // namespace

BufferId plan_step_scalars(ArenaPlan& plan, const std::string& name) {
  return plan.add(name, sizeof(StepScalars), "train", Lifetime{}, 16);
}

TensorView step_scalars_view(StepScalars* s) {
  return TensorView(s, DType::kUINT8, {static_cast<int64_t>(sizeof(StepScalars))});
}

void init_step_scalars(StepScalars* s, float loss_scale, int32_t hysteresis, cudaStream_t stream) {
  REPLAY_REQUIRE(s != nullptr && reinterpret_cast<uintptr_t>(s) % alignof(StepScalars) == 0,
                 "StepScalars must be non-null and 8-byte aligned");
  REPLAY_REQUIRE(loss_scale > 0.0f, "the loss scale must be positive");
  REPLAY_REQUIRE(hysteresis >= 1, "loss-scaler hysteresis must be at least 1");
  init_step_scalars_kernel<<<1, 1, 0, stream>>>(s, loss_scale, hysteresis);
  REPLAY_LAUNCH_CHECK();
}

void begin_step(StepScalars* s, cudaStream_t stream) {
  begin_step_kernel<<<1, 1, 0, stream>>>(s);
  REPLAY_LAUNCH_CHECK();
}

void prepare_optimizer(const LrSchedule& schedule, StepScalars* s, cudaStream_t stream) {
  validate(schedule);
  prepare_optimizer_kernel<<<1, 1, 0, stream>>>(s, schedule);
  REPLAY_LAUNCH_CHECK();
}

void end_step(StepScalars* s, const LossScalerConfig* scaler, cudaStream_t stream) {
  if (scaler != nullptr) validate(*scaler);
  end_step_kernel<<<1, 1, 0, stream>>>(s, scaler ? *scaler : LossScalerConfig{}, scaler != nullptr);
  REPLAY_LAUNCH_CHECK();
}

void compute_lr(const LrSchedule& schedule, const int64_t* step, float* lr, cudaStream_t stream) {
  validate(schedule);
  compute_lr_kernel<<<1, 1, 0, stream>>>(step, lr, schedule);
  REPLAY_LAUNCH_CHECK();
}

void clip_grad_norm(const GradNormTable& table, float max_norm, StepScalars* s, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  REPLAY_REQUIRE(s != nullptr, "clip_grad_norm needs the step scalars");
  grad_norm(table, max_norm, &s->loss_scale, &s->grad_norm, &s->grad_scale, &s->found_inf,
            workspace, workspace_bytes, stream);
}

void validate(const LossScalerConfig& c) {
  REPLAY_REQUIRE(c.growth_interval >= 1 && c.hysteresis >= 1,
                 "loss scaler: growth interval and hysteresis must be >= 1");
  REPLAY_REQUIRE(c.backoff_factor > 0.0f && c.backoff_factor < 1.0f && c.growth_factor > 1.0f,
                 "loss scaler: backoff in (0, 1), growth > 1");
  REPLAY_REQUIRE(c.min_scale > 0.0f && c.min_scale <= c.init_scale && c.init_scale <= c.max_scale,
                 "loss scaler: 0 < min_scale <= init_scale <= max_scale");
}

}  // namespace replay::train
