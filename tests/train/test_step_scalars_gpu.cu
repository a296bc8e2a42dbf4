// The step scalars on the device: learning-rate schedules equal the host formulas; the loss scaler
// and the no-op AdamW step through overflow and recovery inside one graph, step by step equal to
// the host mirror.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/optim/adamw.h"
#include "common/optim/found_inf.h"
#include "graphs/graph.h"
#include "tests/support/compare.h"
#include "train/step_scalars.h"

namespace replay::train {
namespace {

using graphs::CaptureStream;
using graphs::Graph;
using test::DeviceBuffer;

TEST(LrScheduleGpu, DeviceFormulaMatchesHost) {
  LrSchedule cosine;
  cosine.kind = LrKind::kWarmupCosine;
  cosine.base_lr = 6e-4f;
  cosine.min_lr = 6e-5f;
  cosine.warmup_steps = 100;
  cosine.total_steps = 10000;
  LrSchedule constant;
  constant.kind = LrKind::kWarmupConstant;
  constant.base_lr = 1.25e-7f;
  constant.warmup_steps = 1000;
  LrSchedule rnnt;
  rnnt.kind = LrKind::kRnntWarmupHoldDecay;
  rnnt.base_lr = 4e-3f;
  rnnt.min_lr = 1e-5f;
  rnnt.steps_per_epoch = 1000;
  rnnt.warmup_epochs = 6;
  rnnt.hold_epochs = 40;
  rnnt.gamma = 0.915f;

  std::vector<int64_t> steps;  // StepScalars::step values (t >= 1)
  for (int64_t t : {1,    2,    50,   99,    100,   101,   102,   999,   1000,  1001,   5000,
                    6000, 6001, 9999, 10000, 10001, 46000, 46001, 47000, 60000, 200000, 1000000})
    steps.push_back(t);
  DeviceBuffer<int64_t> d_steps(steps);
  DeviceBuffer<float> d_lr(steps.size());
  CaptureStream work;
  for (const LrSchedule* sc : {&cosine, &constant, &rnnt}) {
    for (size_t i = 0; i < steps.size(); ++i)
      compute_lr(*sc, d_steps.get() + i, d_lr.get() + i, work.get());
    const std::vector<float> lr = d_lr.download();
    for (size_t i = 0; i < steps.size(); ++i) {
      const float host = lr_at(*sc, steps[i] - 1);
      EXPECT_NEAR(lr[i], host, 2e-7f * std::fabs(host))
          << "kind " << static_cast<int>(sc->kind) << " t " << steps[i];
    }
  }
}

// grad = base * loss_scale, with +Inf in element 0 when *inject is set: what a scaled backward
// produces.
__global__ void scaled_grad_kernel(float* grad, const float* base, const float* loss_scale,
                                   const int32_t* inject, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  grad[i] = base[i] * *loss_scale;
  if (i == 0 && *inject) grad[0] = INFINITY;
}

TEST(LossScaling, ScalerAndNoopOptimizerThroughOverflowAndRecoveryInOneGraph) {
  const int n = 40000;
  CaptureStream work, cap;
  DeviceBuffer<float> master(test::random_uniform(n, 21)),
      base(test::random_uniform(n, 22, -1e-2f, 1e-2f));
  DeviceBuffer<float> grad(n), m(std::vector<float>(n, 0.0f)), v(std::vector<float>(n, 0.0f));
  DeviceBuffer<int32_t> inject(std::vector<int32_t>{0});
  DeviceBuffer<char> scalars_memory(sizeof(StepScalars));
  auto* s = reinterpret_cast<StepScalars*>(scalars_memory.get());

  LossScalerConfig scaler;
  scaler.init_scale = 1024.0f;
  scaler.growth_interval = 3;
  scaler.hysteresis = 2;
  LrSchedule schedule;
  schedule.kind = LrKind::kWarmupConstant;
  schedule.base_lr = 1e-3f;
  schedule.warmup_steps = 2;

  AdamWTableBuilder adam;
  adam.add(master.get(), nullptr, grad.get(), m.get(), v.get(), n, true);
  DeviceBuffer<char> adam_memory(adam.device_bytes());
  const AdamWTable adam_table = adam.build(adam_memory.get(), adam.device_bytes(), work.get());
  GradNormTableBuilder norms;
  norms.add(grad.get(), n);
  DeviceBuffer<char> norm_memory(norms.device_bytes());
  const GradNormTable norm_table = norms.build(norm_memory.get(), norms.device_bytes(), work.get());
  DeviceBuffer<char> norm_workspace(grad_norm_workspace_bytes(norm_table));
  FoundInfTableBuilder checks;
  checks.add(TensorView(grad.get(), DType::kFP32, {n}));
  DeviceBuffer<char> check_memory(checks.device_bytes());
  const FoundInfTable check_table =
      checks.build(check_memory.get(), checks.device_bytes(), work.get());

  init_step_scalars(s, scaler.init_scale, scaler.hysteresis, work.get());
  Graph step("scaled.step");
  step.build(
      cap.get(),
      [&](cudaStream_t st) {
        begin_step(s, st);
        scaled_grad_kernel<<<(n + 255) / 256, 256, 0, st>>>(grad.get(), base.get(), &s->loss_scale,
                                                            inject.get(), n);
        REPLAY_LAUNCH_CHECK();
        check_found_inf(check_table, &s->found_inf, st);
        clip_grad_norm(norm_table, 1.0f, s, norm_workspace.get(),
                       grad_norm_workspace_bytes(norm_table), st);
        prepare_optimizer(schedule, s, st);
        adamw_step(adam_table, AdamWHyper{}, &s->lr, &s->step, &s->grad_scale, &s->noop, st);
        end_step(s, &scaler, st);
      },
      work.get());

  StepScalars host{};
  host.loss_scale = scaler.init_scale;
  host.grad_scale = 1.0f;
  host.hysteresis_left = scaler.hysteresis;
  std::vector<float> before = master.download();
  // finite, overflow (tolerated), overflow (backs off), three finite (grows back), overflow,
  // finite.
  const int overflow[] = {0, 1, 1, 0, 0, 0, 1, 0};
  for (int k = 0; k < 8; ++k) {
    ASSERT_EQ(cudaMemcpy(inject.get(), &overflow[k], 4, cudaMemcpyHostToDevice), cudaSuccess);
    step.launch(work.get());
    StepScalars dev{};
    ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&dev, s, sizeof(StepScalars), cudaMemcpyDeviceToHost), cudaSuccess);

    host.found_inf = overflow[k];  // the host mirror of the same step
    prepare_optimizer_update(host, schedule);
    loss_scaler_update(host, scaler);
    host.iteration += 1;
    const std::string at = "step " + std::to_string(k);
    EXPECT_EQ(dev.found_inf, host.found_inf) << at;
    EXPECT_EQ(dev.noop, host.noop) << at;
    EXPECT_EQ(dev.step, host.step) << at;
    EXPECT_EQ(dev.iteration, host.iteration) << at;
    EXPECT_EQ(dev.lr, host.lr) << at;
    EXPECT_EQ(dev.loss_scale, host.loss_scale) << at;
    EXPECT_EQ(dev.growth_tracker, host.growth_tracker) << at;
    EXPECT_EQ(dev.hysteresis_left, host.hysteresis_left) << at;
    if (!overflow[k]) EXPECT_TRUE(std::isfinite(dev.grad_norm) && dev.grad_norm > 0.0f) << at;

    const std::vector<float> after = master.download();
    if (overflow[k]) {
      EXPECT_TRUE(test::bit_equal(at + ": skipped step left the weights", before.data(),
                                  after.data(), after.size() * 4));
    } else {
      EXPECT_NE(before, after) << at << ": a finite step must update the weights";
      for (float w : after) ASSERT_TRUE(std::isfinite(w)) << at;
    }
    before = after;
  }
  EXPECT_EQ(host.step, 5);  // five finite steps
  EXPECT_EQ(host.loss_scale,
            1024.0f);  // 1024 -> 512 (backoff) -> 1024 (growth); the last overflow tolerated
  EXPECT_EQ(host.hysteresis_left, 1);
}

}  // namespace
}  // namespace replay::train
