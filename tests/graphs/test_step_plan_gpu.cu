// StepPlan on the device, on a toy training step (dropout forward, backward, SGD with a step
// counter): none, layer and full modes give bit-identical weights, activations and counters after a
// neutral warm-up; a moved argument is an error naming region and argument, and update()
// re-captures in place; shadow verification passes on correct regions and catches a host value
// baked into a kernel at capture; a host sync inside a region is refused with a clear message;
// per-graph statistics; the REPLAY_TRACE_ENQUEUE report; shape keys (a ladder of lengths): one
// graph per key, every key bit-identical to eager, and a replay at a key other than the selected
// shape is an error.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "graphs/rng.h"
#include "graphs/step_plan.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

constexpr int kN = 4096;

// h = x * w * mask / keep, mask from the region's RNG: a different mask every step.
__global__ void forward_kernel(float* h, const float* x, const float* w, int n, RngArgs rng,
                               float keep) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const Philox4 r = rng_draw(rng, static_cast<uint64_t>(i / 4));
  const uint32_t c[4] = {r.x, r.y, r.z, r.w};
  const float u = philox_uniform(c[i % 4]);
  h[i] = u <= keep ? x[i] * w[i] / keep : 0.0f;
}

__global__ void backward_kernel(float* g, const float* h, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) g[i] = 0.5f * h[i] + 0.25f * x[i];
}

// w -= lr * g; the step counter is read and written on the device.
__global__ void sgd_kernel(float* w, const float* g, const float* lr, int64_t* step, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) w[i] -= *lr * g[i];
  if (i == 0) *step += 1;
}

__global__ void multiply_kernel(float* y, const float* x, const float* w, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * w[i];
}

__global__ void scale_kernel(float* y, const float* x, float factor, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * factor;
}

constexpr int kBlocks = (kN + 255) / 256;

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// The toy model: buffers, RNG and the three regions. Fresh and identical for every mode.
struct Toy {
  DeviceBuffer<float> x{test::random_uniform(kN, 1)}, x2{test::random_uniform(kN, 2)};
  DeviceBuffer<float> w{test::random_uniform(kN, 3)}, h{kN}, g{kN};
  DeviceBuffer<float> lr{std::vector<float>{0.01f}};
  DeviceBuffer<int64_t> step{std::vector<int64_t>{0}};
  DeviceBuffer<char> rng_memory{RngTracker::device_bytes(2)};
  RngTracker rng{rng_memory.get(), RngTracker::device_bytes(2), 2};
  const float* input = x.get();  // what the forward region reads; a test may move it
  std::unique_ptr<StepPlan> plan;

  Toy(StepPlanOptions options, cudaStream_t stream) {
    rng.add_stream(kTensorParallelRng, 2024);
    const RngArgs dropout = rng.register_op(kTensorParallelRng, "layer0.dropout");
    rng.initialize(stream);
    plan = std::make_unique<StepPlan>("toy", options);
    plan->add_region({"layer0.fwd", RegionKind::kForwardLayer,
                      [this, dropout](cudaStream_t s, const RegionArgs& a) {
                        forward_kernel<<<kBlocks, 256, 0, s>>>(
                            a["h"].as<float>(DType::kFP32), a["x"].as<float>(DType::kFP32),
                            a["w"].as<float>(DType::kFP32), kN, dropout, 0.75f);
                        REPLAY_LAUNCH_CHECK();
                      },
                      [this] {
                        return RegionArgs()
                            .read("x", TensorView(const_cast<float*>(input), DType::kFP32, {kN}))
                            .read("w", TensorView(w.get(), DType::kFP32, {kN}))
                            .write("h", TensorView(h.get(), DType::kFP32, {kN}));
                      }});
    plan->add_region({"layer0.bwd", RegionKind::kBackwardLayer,
                      [this](cudaStream_t s, const RegionArgs& a) {
                        backward_kernel<<<kBlocks, 256, 0, s>>>(a["g"].as<float>(DType::kFP32),
                                                                h.get(),
                                                                a["x"].as<float>(DType::kFP32), kN);
                        REPLAY_LAUNCH_CHECK();
                      },
                      [this] {
                        return RegionArgs()
                            .read("x", TensorView(const_cast<float*>(input), DType::kFP32, {kN}))
                            .read("h", TensorView(h.get(), DType::kFP32, {kN}))
                            .write("g", TensorView(g.get(), DType::kFP32, {kN}));
                      }});
    plan->add_region({"optimizer", RegionKind::kOther,
                      [this](cudaStream_t s, const RegionArgs&) {
                        sgd_kernel<<<kBlocks, 256, 0, s>>>(w.get(), g.get(), lr.get(), step.get(),
                                                           kN);
                        REPLAY_LAUNCH_CHECK();
                      },
                      [this] {
                        return RegionArgs()
                            .read("g", TensorView(g.get(), DType::kFP32, {kN}))
                            .read("lr", TensorView(lr.get(), DType::kFP32, {1}))
                            .read_write("w", TensorView(w.get(), DType::kFP32, {kN}))
                            .read_write("step", TensorView(step.get(), DType::kINT64, {1}));
                      }});
    plan->add_state("w", TensorView(w.get(), DType::kFP32, {kN}));
    plan->add_state("step", TensorView(step.get(), DType::kINT64, {1}));
    plan->set_rng(&rng);
  }
};

struct Result {
  std::vector<float> w, h;
  std::vector<int64_t> step;
  std::vector<PhiloxSlot> slots;
};

Result run(GraphMode mode, int steps, std::vector<std::vector<float>>* activations = nullptr) {
  CaptureStream work;
  StepPlanOptions opt(mode);
  opt.warmup_steps = 3;
  Toy toy(opt, work.get());
  for (int k = 0; k < steps; ++k) {
    toy.plan->run_step(work.get());
    if (activations) activations->push_back(toy.h.download());
  }
  Result r{toy.w.download(), toy.h.download(), toy.step.download(), std::vector<PhiloxSlot>(1)};
  EXPECT_EQ(cudaMemcpy(r.slots.data(), toy.rng.slots(), sizeof(PhiloxSlot), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return r;
}

TEST(StepPlan, WarmupIsNeutralAndEveryModeIsBitIdentical) {
  const int steps = 5;
  std::vector<std::vector<float>> activations;
  const Result none = run(GraphMode::kNone, steps, &activations);
  EXPECT_EQ(none.step[0], steps);
  EXPECT_EQ(none.slots[0].offset, static_cast<uint64_t>(steps));
  for (int k = 1; k < steps; ++k)
    EXPECT_NE(activations[static_cast<size_t>(k)], activations[static_cast<size_t>(k - 1)])
        << "dropout mask repeated at step " << k;

  for (GraphMode mode : {GraphMode::kLayer, GraphMode::kFull}) {
    const Result r = run(mode, steps);
    const std::string m = graph_mode_name(mode);
    EXPECT_EQ(r.step[0], steps) << m << ": warm-up steps leaked into the step counter";
    EXPECT_EQ(r.slots[0].offset, static_cast<uint64_t>(steps))
        << m << ": warm-up RNG use was not undone";
    EXPECT_TRUE(test::bit_equal(m + " weights", none.w.data(), r.w.data(), none.w.size() * 4));
    EXPECT_TRUE(test::bit_equal(m + " activations", none.h.data(), r.h.data(), none.h.size() * 4));
  }
}

TEST(StepPlan, GraphsPerModeAndStatistics) {
  CaptureStream work;
  for (GraphMode mode : {GraphMode::kNone, GraphMode::kLayer, GraphMode::kFull}) {
    Toy toy(StepPlanOptions(mode), work.get());
    toy.plan->run_step(work.get());
    const auto stats = toy.plan->graph_stats();
    const size_t expected = mode == GraphMode::kNone ? 0 : mode == GraphMode::kLayer ? 2 : 1;
    ASSERT_EQ(stats.size(), expected) << graph_mode_name(mode);
    for (const GraphStats& s : stats) {
      EXPECT_GT(s.nodes, 0u) << s.name;
      EXPECT_GT(s.capture_ms, 0.0) << s.name;
      EXPECT_GT(s.instantiate_ms, 0.0) << s.name;
    }
    if (mode == GraphMode::kLayer) {
      EXPECT_EQ(stats[0].name, "layer0.fwd");  // captured in execution order
      EXPECT_EQ(stats[1].name, "layer0.bwd");
    }
    if (mode == GraphMode::kFull) {
      EXPECT_EQ(stats[0].name, "toy");
      EXPECT_EQ(stats[0].nodes, 4u);  // forward, backward, optimizer, RNG advance
    }
    EXPECT_TRUE(has(toy.plan->describe(), "layer0.fwd")) << toy.plan->describe();
  }
}

// REPLAY_TRACE_ENQUEUE: one stderr line a step (host enqueue time, units over 200 us), read when
// the plan is made; the step's results do not change.
TEST(StepPlan, EnqueueTraceReportsEveryStepAndChangesNothing) {
  const int steps = 3;
  const Result plain = run(GraphMode::kLayer, steps);
  ASSERT_EQ(setenv("REPLAY_TRACE_ENQUEUE", "1", 1), 0);
  testing::internal::CaptureStderr();
  const Result traced = run(GraphMode::kLayer, steps);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(unsetenv("REPLAY_TRACE_ENQUEUE"), 0);
  for (int k = 0; k < steps; ++k)
    EXPECT_TRUE(has(err, "[replay graphs] step 'toy' #" + std::to_string(k) + " enqueued in "))
        << err;
  EXPECT_FALSE(has(err, "#" + std::to_string(steps) + " ")) << err;
  EXPECT_TRUE(has(err, "units over 200 us:")) << err;
  EXPECT_TRUE(
      test::bit_equal("traced weights", plain.w.data(), traced.w.data(), plain.w.size() * 4));
  EXPECT_EQ(traced.step[0], steps);
}

TEST(StepPlan, MovedArgumentIsAnErrorNamingRegionAndArgument) {
  for (GraphMode mode : {GraphMode::kLayer, GraphMode::kFull}) {
    CaptureStream work;
    Toy toy(StepPlanOptions(mode), work.get());
    toy.plan->run_step(work.get());
    toy.input = toy.x2.get();  // the workload moved the input
    try {
      toy.plan->run_step(work.get());
      FAIL() << graph_mode_name(mode) << ": replayed on a stale address";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_TRUE(has(m, "region 'layer0.fwd'")) << m;
      EXPECT_TRUE(has(m, "argument 'x' was captured as fp32[4096] at")) << m;
      EXPECT_TRUE(has(m, "StepPlan::update()")) << m;
    }
    // update() re-captures the graphs whose arguments moved, in place: only a pointer changed.
    const std::vector<UpdateReport> reports = toy.plan->update(work.get());
    ASSERT_EQ(reports.size(),
              mode == GraphMode::kLayer ? 2u : 1u);  // layer: forward and backward read x
    for (const UpdateReport& r : reports) EXPECT_TRUE(r.in_place) << r.graph << ": " << r.reason;
    toy.plan->run_step(work.get());
    const VerifyReport v = toy.plan->verify_step(work.get());
    EXPECT_TRUE(v.ok) << v.message();  // the updated graphs read x2, as the eager run does
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

TEST(StepPlan, VerificationPassesOnCorrectRegions) {
  for (GraphMode mode : {GraphMode::kLayer, GraphMode::kFull}) {
    CaptureStream work;
    Toy toy(StepPlanOptions(mode), work.get());
    toy.plan->run_step(work.get());
    const VerifyReport v = toy.plan->verify_step(work.get());
    EXPECT_TRUE(v.ok) << v.message();
    EXPECT_EQ(v.graphs_checked, mode == GraphMode::kLayer ? 2 : 1);
    // full: h, g, w, step from the regions, RNG slots (the state repeats w and step).
    EXPECT_EQ(v.tensors_checked, mode == GraphMode::kLayer ? 2 : 5);
    const std::vector<int64_t> step = toy.step.download();
    EXPECT_EQ(step[0], 2) << "the verified step counts once";
  }
}

TEST(StepPlan, VerificationCatchesAHostValueBakedAtCapture) {
  CaptureStream work;
  DeviceBuffer<float> x(test::random_uniform(kN, 5)), y(kN);
  float factor = 2.0f;  // the bug: a host value passed by value to a captured kernel
  StepPlan plan("baked", StepPlanOptions(GraphMode::kLayer));
  plan.add_region({"scale", RegionKind::kForwardLayer,
                   [&](cudaStream_t s, const RegionArgs&) {
                     scale_kernel<<<kBlocks, 256, 0, s>>>(y.get(), x.get(), factor, kN);
                     REPLAY_LAUNCH_CHECK();
                   },
                   [&] {
                     return RegionArgs()
                         .read("x", TensorView(x.get(), DType::kFP32, {kN}))
                         .write("y", TensorView(y.get(), DType::kFP32, {kN}));
                   }});
  plan.run_step(work.get());
  VerifyReport v = plan.verify_step(work.get());
  EXPECT_TRUE(v.ok) << v.message();

  factor = 3.0f;  // eager runs see it, the graph keeps 2
  v = plan.verify_step(work.get());
  ASSERT_FALSE(v.ok);
  EXPECT_EQ(v.graph, "scale");
  EXPECT_EQ(v.tensor, "scale:y");
  const std::vector<float> hx = x.download();
  int64_t first = 0;
  while (hx[static_cast<size_t>(first)] == 0.0f) ++first;
  EXPECT_EQ(v.index, first);
  EXPECT_EQ(v.eager_value,
            format_element(std::vector<float>{hx[static_cast<size_t>(first)] * 3.0f}.data(),
                           DType::kFP32, 0));
  EXPECT_EQ(v.graph_value,
            format_element(std::vector<float>{hx[static_cast<size_t>(first)] * 2.0f}.data(),
                           DType::kFP32, 0));
  EXPECT_TRUE(has(v.message(), "graph 'scale': output 'scale:y' differs at element"))
      << v.message();
  // The step's results are the graphed ones.
  EXPECT_EQ(y.download()[static_cast<size_t>(first)], hx[static_cast<size_t>(first)] * 2.0f);
}

TEST(StepPlan, HostSyncInsideARegionIsRefusedWithAClearMessage) {
  CaptureStream work;
  DeviceBuffer<float> x(test::random_uniform(kN, 6)), y(kN);
  StepPlanOptions opt(GraphMode::kFull);
  opt.warmup_steps = 1;
  StepPlan plan("sync", opt);
  plan.add_region({"loss.print", RegionKind::kOther, [&](cudaStream_t s, const RegionArgs&) {
                     scale_kernel<<<kBlocks, 256, 0, s>>>(y.get(), x.get(), 1.0f, kN);
                     REPLAY_LAUNCH_CHECK();
                     REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));  // e.g. to print the loss
                   }});
  try {
    plan.run_step(work.get());
    FAIL() << "a region that synchronizes was captured";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has(m, "graph 'sync'")) << m;
    EXPECT_TRUE(has(m, "host synchronization during capture (cudaErrorStreamCaptureUnsupported)"))
        << m;
  }
  EXPECT_FALSE(plan.prepared());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A step at two lengths (a ladder of 1024 and 4096 elements): y = x * w, then w -= lr * y over the
// first n elements, n the selected rung's. The launches take n by value: each key's graph holds its
// own.
struct Ladder {
  static constexpr int kRungs[2] = {1024, kN};
  DeviceBuffer<float> x{test::random_uniform(kN, 5)}, w{test::random_uniform(kN, 6)}, y{kN};
  DeviceBuffer<float> lr{std::vector<float>{0.125f}};
  DeviceBuffer<int64_t> step{std::vector<int64_t>{0}};
  int n = kRungs[0];
  std::unique_ptr<StepPlan> plan;

  explicit Ladder(GraphMode mode) {
    StepPlanOptions options(mode);
    options.warmup_steps = 2;
    plan = std::make_unique<StepPlan>("ladder", options);
    plan->add_region({"layer0.fwd", RegionKind::kForwardLayer,
                      [this](cudaStream_t s, const RegionArgs&) {
                        multiply_kernel<<<(n + 255) / 256, 256, 0, s>>>(y.get(), x.get(), w.get(),
                                                                        n);
                        REPLAY_LAUNCH_CHECK();
                      },
                      [this] {
                        return RegionArgs()
                            .read("x", TensorView(x.get(), DType::kFP32, {n}))
                            .read("w", TensorView(w.get(), DType::kFP32, {n}))
                            .write("y", TensorView(y.get(), DType::kFP32, {n}));
                      }});
    plan->add_region({"optimizer", RegionKind::kOther,
                      [this](cudaStream_t s, const RegionArgs&) {
                        sgd_kernel<<<(n + 255) / 256, 256, 0, s>>>(w.get(), y.get(), lr.get(),
                                                                   step.get(), n);
                        REPLAY_LAUNCH_CHECK();
                      },
                      [this] {
                        return RegionArgs()
                            .read("y", TensorView(y.get(), DType::kFP32, {n}))
                            .read_write("w", TensorView(w.get(), DType::kFP32, {kN}))
                            .read_write("step", TensorView(step.get(), DType::kINT64, {1}));
                      }});
    plan->add_state("w", TensorView(w.get(), DType::kFP32, {kN}));
    plan->add_state("step", TensorView(step.get(), DType::kINT64, {1}));
    plan->set_shape_keys({"n1024", "n4096"}, [this](int key) { n = kRungs[key]; });
  }
};

TEST(StepPlanShapeKeys, EveryKeyHasItsGraphsAndEveryModeIsBitIdentical) {
  const int keys[] = {0, 1, 1, 0, 1, 0};
  std::vector<float> eager;
  for (GraphMode mode : {GraphMode::kNone, GraphMode::kLayer, GraphMode::kFull}) {
    CaptureStream work;
    Ladder ladder(mode);
    for (int key : keys) {
      ladder.n = Ladder::kRungs[key];  // the batch's rung, as a loader would select it
      ladder.plan->run_step(work.get(), key);
    }
    const std::string m = graph_mode_name(mode);
    EXPECT_EQ(ladder.step.download()[0], 6)
        << m << ": warm-up at every key leaked into the counter";
    const std::vector<float> w = ladder.w.download();
    if (mode == GraphMode::kNone) {
      eager = w;
      EXPECT_TRUE(ladder.plan->graph_stats().empty());
      continue;
    }
    EXPECT_TRUE(test::bit_equal(m + " weights", eager.data(), w.data(), w.size() * 4));
    const auto stats = ladder.plan->graph_stats();
    ASSERT_EQ(stats.size(), 2u) << m;  // per key: layer0.fwd (layer), or the whole step (full)
    const std::string text = ladder.plan->describe();
    EXPECT_TRUE(has(text, "shape keys n1024 n4096")) << text;
    EXPECT_TRUE(has(text, mode == GraphMode::kFull ? "ladder@n4096" : "layer0.fwd@n4096")) << text;
  }
  // The rungs differ: the weights moved over 4096 elements, not only the first 1024.
  const std::vector<float> start = test::random_uniform(kN, 6);
  EXPECT_NE(start[kN - 1], eager[kN - 1]);
}

TEST(StepPlanShapeKeys, AReplayAtAnotherKeyThanTheSelectedShapeIsAnError) {
  CaptureStream work;
  Ladder ladder(GraphMode::kLayer);
  ladder.n = Ladder::kRungs[1];
  ladder.plan->run_step(work.get(), 1);
  try {
    ladder.plan->run_step(work.get(), 0);  // the shape is still rung 1's
    FAIL() << "replayed key 0's graph on rung 1's arguments";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "graph 'layer0.fwd@n1024'") && has(e.what(), "argument 'x'"))
        << e.what();
  }
  EXPECT_THROW(ladder.plan->run_step(work.get(), 2), Error);  // no such key
  StepPlan twice("twice", StepPlanOptions(GraphMode::kNone));
  EXPECT_THROW(twice.set_shape_keys({"a", "a"}, [](int) {}), Error);
  EXPECT_THROW(twice.set_shape_keys({}, [](int) {}), Error);
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
}

}  // namespace
}  // namespace replay::graphs
