// Sync-free helpers on the device: learning-rate schedules equal the host formulas; found-inf over bf16,
// fp16 and fp32 tensors (aligned and not, chunk tails) sees every Inf and NaN and nothing else; the loss
// scaler and the no-op AdamW step through overflow and recovery inside one graph, step by step equal to
// the host mirror; the readback ring returns step s - 1 while step s is still blocked on the device.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/optim/adamw.h"
#include "graphs/graph.h"
#include "graphs/syncfree.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

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
  for (int64_t t : {1, 2, 50, 99, 100, 101, 102, 999, 1000, 1001, 5000, 6000, 6001, 9999, 10000, 10001, 46000,
                    46001, 47000, 60000, 200000, 1000000})
    steps.push_back(t);
  DeviceBuffer<int64_t> d_steps(steps);
  DeviceBuffer<float> d_lr(steps.size());
  CaptureStream work;
  for (const LrSchedule* sc : {&cosine, &constant, &rnnt}) {
    for (size_t i = 0; i < steps.size(); ++i) compute_lr(*sc, d_steps.get() + i, d_lr.get() + i, work.get());
    const std::vector<float> lr = d_lr.download();
    for (size_t i = 0; i < steps.size(); ++i) {
      const float host = lr_at(*sc, steps[i] - 1);
      EXPECT_NEAR(lr[i], host, 2e-7f * std::fabs(host)) << "kind " << static_cast<int>(sc->kind) << " t " << steps[i];
    }
  }
}

// One tensor of each type, with a planted value (raw bits) at a chosen element.
struct FoundInfCase {
  const char* what;
  int tensor;
  size_t index;
  uint32_t bits;
  int expected;
};

TEST(FoundInf, SeesEveryInfAndNanAcrossTypesAlignmentsAndTails) {
  CaptureStream work;
  const size_t n32 = 100003, n16 = 33333, nh = 20000;  // several 16384-element chunks, ragged tails
  std::vector<float> f32 = test::random_uniform(n32, 11, -100.0f, 100.0f);
  std::vector<__nv_bfloat16> bf = test::to_bf16(test::random_uniform(n16, 12, -100.0f, 100.0f));
  std::vector<__half> hf(nh);
  const std::vector<float> hsrc = test::random_uniform(nh, 13, -100.0f, 100.0f);
  for (size_t i = 0; i < nh; ++i) hf[i] = __float2half_rn(hsrc[i]);

  DeviceBuffer<float> d32(f32);
  DeviceBuffer<char> dbf(n16 * 2 + 2);  // the bf16 tensor starts 2 bytes in: not 16-byte aligned
  ASSERT_EQ(cudaMemcpy(dbf.get() + 2, bf.data(), n16 * 2, cudaMemcpyHostToDevice), cudaSuccess);
  DeviceBuffer<__half> dhf(nh);
  ASSERT_EQ(cudaMemcpy(dhf.get(), hf.data(), nh * 2, cudaMemcpyHostToDevice), cudaSuccess);

  FoundInfTableBuilder builder;
  builder.add(TensorView(d32.get(), DType::kFP32, {static_cast<int64_t>(n32)}));
  builder.add(TensorView(dbf.get() + 2, DType::kBF16, {static_cast<int64_t>(n16)}));
  builder.add(TensorView(dhf.get(), DType::kFP16, {static_cast<int64_t>(nh)}));
  DeviceBuffer<char> table_memory(builder.device_bytes());
  const FoundInfTable table = builder.build(table_memory.get(), builder.device_bytes(), work.get());
  DeviceBuffer<int32_t> flag(1);

  char* bases[3] = {reinterpret_cast<char*>(d32.get()), dbf.get() + 2, reinterpret_cast<char*>(dhf.get())};
  const size_t esize[3] = {4, 2, 2};
  const FoundInfCase cases[] = {
      {"all finite", 0, 0, 0, 0},
      {"fp32 +Inf in the last element", 0, n32 - 1, 0x7f800000u, 1},
      {"fp32 NaN in a chunk middle", 0, 16384 * 3 + 77, 0x7fc00001u, 1},
      {"fp32 largest finite", 0, 5, 0x7f7fffffu, 0},
      {"bf16 NaN", 1, 20000, 0x7fc1u, 1},
      {"bf16 -Inf in the first element", 1, 0, 0xff80u, 1},
      {"bf16 -Inf in the last element", 1, n16 - 1, 0xff80u, 1},
      {"bf16 largest finite", 1, 9, 0x7f7fu, 0},
      {"fp16 +Inf", 2, 16384, 0x7c00u, 1},
      {"fp16 NaN in the last element", 2, nh - 1, 0x7e00u, 1},
      {"fp16 largest finite", 2, 3, 0x7bffu, 0},
  };
  for (const FoundInfCase& c : cases) {
    char* at = bases[c.tensor] + c.index * esize[c.tensor];
    char saved[4];
    ASSERT_EQ(cudaMemcpy(saved, at, esize[c.tensor], cudaMemcpyDeviceToHost), cudaSuccess);
    if (c.expected || c.bits) ASSERT_EQ(cudaMemcpy(at, &c.bits, esize[c.tensor], cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(flag.get(), 0, 4), cudaSuccess);
    check_found_inf(table, flag.get(), work.get());
    EXPECT_EQ(flag.download()[0], c.expected) << c.what;
    ASSERT_EQ(cudaMemcpy(at, saved, esize[c.tensor], cudaMemcpyHostToDevice), cudaSuccess);
  }
  // The flag is only ever raised: a clean check leaves an earlier overflow standing.
  ASSERT_EQ(cudaMemset(flag.get(), 0xff, 4), cudaSuccess);
  check_found_inf(table, flag.get(), work.get());
  EXPECT_EQ(flag.download()[0], -1);
}

// grad = base * loss_scale, with +Inf in element 0 when *inject is set: what a scaled backward produces.
__global__ void scaled_grad_kernel(float* grad, const float* base, const float* loss_scale, const int32_t* inject,
                                   int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  grad[i] = base[i] * *loss_scale;
  if (i == 0 && *inject) grad[0] = INFINITY;
}

TEST(LossScaling, ScalerAndNoopOptimizerThroughOverflowAndRecoveryInOneGraph) {
  const int n = 40000;
  CaptureStream work, cap;
  DeviceBuffer<float> master(test::random_uniform(n, 21)), base(test::random_uniform(n, 22, -1e-2f, 1e-2f));
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
  const FoundInfTable check_table = checks.build(check_memory.get(), checks.device_bytes(), work.get());

  init_step_scalars(s, scaler.init_scale, scaler.hysteresis, work.get());
  Graph step("scaled.step");
  step.build(cap.get(), [&](cudaStream_t st) {
    begin_step(s, st);
    scaled_grad_kernel<<<(n + 255) / 256, 256, 0, st>>>(grad.get(), base.get(), &s->loss_scale, inject.get(), n);
    REPLAY_LAUNCH_CHECK();
    check_found_inf(check_table, &s->found_inf, st);
    clip_grad_norm(norm_table, 1.0f, s, norm_workspace.get(), grad_norm_workspace_bytes(norm_table), st);
    prepare_optimizer(schedule, s, st);
    adamw_step(adam_table, AdamWHyper{}, &s->lr, &s->step, &s->grad_scale, &s->noop, st);
    end_step(s, &scaler, st);
  }, work.get());

  StepScalars host{};
  host.loss_scale = scaler.init_scale;
  host.grad_scale = 1.0f;
  host.hysteresis_left = scaler.hysteresis;
  std::vector<float> before = master.download();
  // finite, overflow (tolerated), overflow (backs off), three finite (grows back), overflow, finite.
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
      EXPECT_TRUE(test::bit_equal(at + ": skipped step left the weights", before.data(), after.data(), after.size() * 4));
    } else {
      EXPECT_NE(before, after) << at << ": a finite step must update the weights";
      for (float w : after) ASSERT_TRUE(std::isfinite(w)) << at;
    }
    before = after;
  }
  EXPECT_EQ(host.step, 5);              // five finite steps
  EXPECT_EQ(host.loss_scale, 1024.0f);  // 1024 -> 512 (backoff) -> 1024 (growth); the last overflow tolerated
  EXPECT_EQ(host.hysteresis_left, 1);
}

// Spins until the host sets *flag (mapped pinned memory), at most a few seconds.
__global__ void wait_for_host_kernel(const volatile int32_t* flag) {
  for (long i = 0; i < 20000000 && *flag == 0; ++i) __nanosleep(200);
}

__global__ void write_loss_kernel(StepScalars* s) { s->loss = 100.0f + static_cast<float>(s->iteration); }

TEST(Readback, HostReadsEarlierStepsWithoutWaitingOnTheCurrentOne) {
  CaptureStream work, cap;
  DeviceBuffer<char> scalars_memory(sizeof(StepScalars));
  auto* s = reinterpret_cast<StepScalars*>(scalars_memory.get());
  init_step_scalars(s, 1.0f, 1, work.get());
  ReadbackRing ring(4, &s->iteration,
                    {{"loss", &s->loss, ScalarType::kF32}, {"iteration", &s->iteration, ScalarType::kI64},
                     {"found_inf", &s->found_inf, ScalarType::kI32}});
  Graph step("readback.step");
  step.build(cap.get(), [&](cudaStream_t st) {
    begin_step(s, st);
    write_loss_kernel<<<1, 1, 0, st>>>(s);
    REPLAY_LAUNCH_CHECK();
    ring.copy(st);
    end_step(s, nullptr, st);
  }, work.get());

  int32_t* gate = nullptr;
  int32_t* gate_device = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&gate), 4, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_device), gate, 0), cudaSuccess);

  for (int k = 0; k < 10; ++k) {
    const bool block = k == 6;
    if (block) {
      *reinterpret_cast<volatile int32_t*>(gate) = 0;
      wait_for_host_kernel<<<1, 1, 0, work.get()>>>(gate_device);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    }
    step.launch(work.get());
    ring.step_enqueued(work.get());
    ASSERT_EQ(ring.steps_enqueued(), k + 1);
    if (k >= 1) {
      const ReadbackSample r = ring.read(k - 1);  // one step late
      EXPECT_EQ(r.iteration, k - 1);
      EXPECT_EQ(r.get("loss"), 100.0 + (k - 1));
      EXPECT_EQ(r.get("iteration"), k - 1);
      EXPECT_EQ(r.get("found_inf"), 0);
    }
    if (block) {
      EXPECT_FALSE(ring.try_read(k).has_value()) << "step " << k << " cannot have finished: the device waits";
      EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "'not ready' must not be left as an error";
      *reinterpret_cast<volatile int32_t*>(gate) = 1;
      EXPECT_EQ(ring.read(k).get("loss"), 100.0 + k);
    }
  }
  EXPECT_THROW(ring.read(5), Error);   // its slot has been reused (ring of 4)
  EXPECT_THROW(ring.read(10), Error);  // not enqueued
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  ASSERT_EQ(cudaFreeHost(gate), cudaSuccess);
}

TEST(Readback, DisagreeingCountersAreAClearError) {
  CaptureStream work;
  DeviceBuffer<int64_t> frozen(std::vector<int64_t>{0});  // a counter nobody advances
  DeviceBuffer<float> loss(std::vector<float>{1.5f});
  ReadbackRing ring(2, frozen.get(), {{"loss", loss.get(), ScalarType::kF32}});
  for (int k = 0; k < 2; ++k) {
    ring.copy(work.get());
    ring.step_enqueued(work.get());
  }
  EXPECT_EQ(ring.read(0).get("loss"), 1.5);
  try {
    ring.read(1);
    FAIL() << "step 1 was read from step 0's slot";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "disagree")) << e.what();
  }
}

}  // namespace
}  // namespace replay::graphs
