// training.h: Trainer, a transformer shard's training step declared as a graph-layer StepPlan: the
// regions in execution order (per micro-batch: embedding forward, layer i forward, head, layer i
// backward in reverse, embedding backward; then the optimizer), run eagerly (`none`), as one graph
// per layer forward and backward (`layer`), or as one graph for the whole step (`full`). The
// optimizer is sync-free: grad-norm clipping, the device learning-rate schedule and AdamW read
// their scalars on the device (graphs/syncfree.h), and the host reads the loss steps late from the
// readback ring.
//
// Bit-identical modes. Every mode launches the same kernels with the same arguments in the same
// order on one stream: GEMM algorithms are fixed at plan time, attention's backward is cuDNN's
// deterministic one, every reduction is fixed-order, and dropout draws from Philox slots in device
// memory that one captured kernel advances per step. The neutral warm-up (parameters, master
// weights, Adam moments and step scalars registered as StepPlan state, RNG slots restored) runs in
// every mode, so step 0 starts from the same bytes everywhere.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/arena.h"
#include "common/attention.h"
#include "common/bench/harness.h"
#include "common/bench/peaks.h"
#include "common/context.h"
#include "common/data/batch_stream.h"
#include "common/gemm.h"
#include "common/optim/adamw.h"
#include "graphs/rng.h"
#include "graphs/step_plan.h"
#include "graphs/syncfree.h"
#include "workloads/transformer/faults.h"
#include "workloads/transformer/model.h"
#include "workloads/transformer/shape.h"

namespace replay::transformer {

struct OptimizerConfig {
  AdamWHyper adam;              // betas, epsilon, decoupled weight decay
  graphs::LrSchedule schedule;  // evaluated on the device from the step counter
  float clip_norm = 1.0f;       // global gradient-norm clipping (<= 0: none)
};

struct TrainerConfig {
  TransformerShape shape;
  int microbatches = 1;
  OptimizerConfig optimizer;
  graphs::GraphMode mode = graphs::GraphMode::kNone;
  int warmup = 3;            // neutral warm-up steps before step 0 (undone)
  uint64_t seed = 1;         // weights, dropout
  bool measure_peak = true;  // measure the bf16 GEMM peak at allocate() (its buffers share memory)
  Fault fault = Fault::kNone;  // --inject: a bug planted in FaultInjector::kRegion (faults.h)
};

class Trainer {
 public:
  static constexpr int kReadbackSlots = 8;
  static constexpr int kRngStreams = 3;  // data-parallel, tensor-parallel, expert-parallel

  // Builds the model and its plans (set-up) and the arena plan; allocates nothing yet.
  Trainer(Context& ctx, TrainerConfig config, GemmCache& gemms, AttentionCache& attention,
          const bench::HostDelay* delay = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const TrainerConfig& config() const { return config_; }
  // Every buffer of the run, planned (offsets assigned). Valid until allocate().
  const ArenaPlan& arena_plan() const { return plan_; }

  // Creates the run's arena, measures the peak, initializes parameters, step scalars and RNG, and
  // declares the step plan. Synchronizes.
  void allocate();
  const Arena& arena() const;
  size_t used_before_arena() const { return used_before_arena_; }  // device memory in use before it
  const bench::Peaks& peaks() const { return peaks_; }

  // Copies the next micro-batches of `data` into the model's static inputs (outside any graph).
  void load_batch(data::BatchStream& data);
  // Neutral warm-up and, in graph modes, capture and instantiation. Call after the first
  // load_batch (the warm-up reads the inputs); run_step calls it otherwise.
  void prepare();
  // Enqueues one training step; never synchronizes.
  void step();
  // One step whose graphs also run eagerly on the same inputs and RNG state, compared bitwise
  // (synchronizes: a diagnostic step).
  graphs::VerifyReport verify_step();
  // Step `s`'s loss, learning rate and grad norm from the readback ring: waits for step s only.
  bench::StepSample read(int64_t s) const;

  Transformer& model() { return *model_; }
  const Transformer& model() const { return *model_; }
  const graphs::StepPlan& step_plan() const { return *step_plan_; }
  graphs::StepScalars* scalars() const { return scalars_; }
  cudaStream_t stream() const { return ctx_.stream(); }

  int64_t tokens_per_step() const { return config_.shape.tokens() * config_.microbatches; }
  // Model FLOPs of one step (SCHEMA.md): (6 N + 12 L s d) per token, N this shard's parameters and
  // d this shard's attention width (heads per GPU x head dim).
  double flops_per_step() const;
  static const char* flops_formula();

 private:
  void build_step_plan();
  void optimizer_step(cudaStream_t stream) const;
  graphs::RegionArgs optimizer_args() const;

  Context& ctx_;
  TrainerConfig config_;
  const bench::HostDelay* delay_;
  std::unique_ptr<Transformer> model_;
  ArenaPlan plan_;
  bench::PeakBuffers peak_buffers_;
  BufferId scalars_id_ = -1, rng_id_ = -1;
  const Arena* arena_ = nullptr;
  size_t used_before_arena_ = 0;
  bench::Peaks peaks_;
  graphs::StepScalars* scalars_ = nullptr;
  std::unique_ptr<graphs::RngTracker> rng_;
  std::unique_ptr<graphs::ReadbackRing> readback_;
  std::unique_ptr<FaultInjector> injector_;  // --inject only
  std::unique_ptr<graphs::StepPlan> step_plan_;
};

}  // namespace replay::transformer
