// trainer.h: Trainer, a model's training step declared as a graph-layer StepPlan: the model's
// regions in execution order, then the optimizer, run eagerly (`none`), as one graph per layer
// forward and backward (`layer`), or as one graph for the whole step (`full`). The optimizer is
// sync-free: grad-norm clipping, the device learning-rate schedule, dynamic loss scaling (fp16) and
// AdamW read their scalars on the device (step_scalars.h), and the host reads the loss steps late
// from the readback ring. Evaluation runs the model's eval regions as a second plan in the same
// mode.
//
// Bit-identical modes. Every mode launches the same kernels with the same arguments in the same
// order on one stream: the model keeps its own launches deterministic (fixed GEMM algorithms,
// fixed- order reductions, Philox dropout from device slots), and the neutral warm-up (the step
// scalars registered as StepPlan state, the optimizer held, RNG slots restored) runs in every mode,
// so step 0 starts from the same bytes everywhere.
//
// Every region runs inside an NVTX range named after it, and an error it raises names it (a capture
// its call refuses says which region, in full mode too). --inject plants its fault at the end of
// the first forward-layer region (the first region when the model has none); replay-order also at
// the end of the next layer region.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/arena.h"
#include "common/bench/harness.h"
#include "common/bench/peaks.h"
#include "common/comm.h"
#include "common/context.h"
#include "graphs/conditional.h"
#include "graphs/faults.h"
#include "graphs/readback.h"
#include "graphs/rng.h"
#include "graphs/step_plan.h"
#include "train/model.h"
#include "train/step_scalars.h"
#include "train/workload.h"

namespace replay::train {

struct TrainerOptions {
  graphs::GraphMode mode = graphs::GraphMode::kNone;
  int warmup = 3;            // neutral warm-up steps before step 0 (undone)
  uint64_t seed = 1;         // weights, dropout
  bool measure_peak = true;  // measure the bf16 GEMM peak at allocate() (its buffers share memory)
  graphs::Fault fault = graphs::Fault::kNone;  // --inject
  bool evaluate = false;  // build the model's evaluation plan (a run with --eval-interval)
  // Data parallelism (a group of more than one rank): the gradients are averaged by a
  // reduce-scatter into this rank's share of the buffers, the grad norm's sum of squares
  // all-reduced, the optimizer updates the share (ParamStore::set_shard) and the weights are
  // all-gathered, all inside the step (and its graphs); the loss is averaged over the ranks. Null:
  // one process.
  comm::Communicator* data_parallel = nullptr;
  // Data parallelism: parameters per gradient bucket (ParamStore::set_bucket_elements; 0: one
  // bucket). Each bucket is reduce-scattered right after the region that finishes its gradients;
  // in none and full mode on a side stream, overlapping the rest of the backward.
  int64_t bucket_elements = 0;
  // Tensor parallelism (a group of more than one rank): the model runs its own collectives; the
  // grad norm's sum of squares is summed over this group too (ParamStore counts replicated tensors
  // on rank 0 only).
  comm::Communicator* tensor_parallel = nullptr;
  // Waits on the step path poll the communicators and give up after its timeout (multi-GPU runs).
  comm::Watchdog* watchdog = nullptr;
};

// The optimizer's fp32 state, whole, on the host: what a checkpoint of a distributed optimizer
// writes (flat layout of ParamStore, buffer_numel() elements each).
struct OptimizerStateHost {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

class Trainer {
 public:
  static constexpr int kReadbackSlots = 8;
  static constexpr int kRngStreams = 3;  // data-parallel, tensor-parallel, expert-parallel

  // Plans the model's buffers and the trainer's own into the arena plan; allocates nothing yet.
  Trainer(Context& ctx, Model& model, TrainingConfig training, TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const TrainingConfig& training() const { return training_; }
  const TrainerOptions& options() const { return options_; }
  // Every buffer of the run, planned (offsets assigned). Valid until allocate().
  const ArenaPlan& arena_plan() const { return plan_; }

  // Creates the run's arena, measures the peak, initializes parameters, step scalars and RNG, and
  // declares the step plan (and, with options.evaluate, the evaluation plan). Synchronizes.
  void allocate();
  const Arena& arena() const;
  size_t used_before_arena() const { return used_before_arena_; }  // device memory in use before it
  const bench::Peaks& peaks() const { return peaks_; }

  // Loads the first batch, then the neutral warm-up and, in graph modes, capture and instantiation
  // of the step (and evaluation) plans. The first step() calls it when it was not called before.
  void prepare();
  // Copies the model's next batch into its static inputs (outside any graph): before every step
  // but the first, whose batch prepare() loaded.
  void load_batch();
  // Enqueues one training step on the batch last loaded; never synchronizes.
  void step();
  // One step whose graphs also run eagerly on the same inputs and RNG state, compared bitwise
  // (synchronizes: a diagnostic step).
  graphs::VerifyReport verify_step();
  // Step `s`'s loss, learning rate, grad norm and loss scale from the readback ring: waits for step
  // s only.
  bench::StepSample read(int64_t s) const;
  // Data parallel (a distributed optimizer): every rank's share of the fp32 master weights and
  // Adam's moments gathered whole, through the gradient buffer (free between steps, zeroed again
  // after), into `out` on the rank that saves (null on the others). Collective: every rank
  // calls it. Eager, synchronizes.
  void gather_optimizer_state(OptimizerStateHost* out);
  // One evaluation over `samples` held-out samples (rounded up to whole batches): the model's
  // metric. Synchronizes: an evaluation is its own phase, never inside a timed step.
  double evaluate(int64_t samples);

  Model& model() { return model_; }
  const Model& model() const { return model_; }
  const graphs::StepPlan& step_plan() const { return *step_plan_; }
  const graphs::StepPlan* eval_plan() const { return eval_plan_.get(); }
  StepScalars* scalars() const { return scalars_; }
  const graphs::RngTracker& rng() const { return *rng_; }
  // A run resumed from a checkpoint whose step scalars say `iteration` steps were taken: the
  // readback ring's first step is that iteration (after allocate(), before the first step).
  void resume_at(int64_t iteration);
  cudaStream_t stream() const { return ctx_.stream(); }
  // Multi-process runs: the collectives of one step and their bytes (comm::collective_bytes),
  // counted in the eager warm-up (after prepare(); none with --warmup 0 or one process).
  const std::optional<comm::Traffic>& step_traffic() const { return step_traffic_; }
  // The warm-up's eager collectives, timed: per communicator, kind, dtype and size, the calls a
  // step, the median time and the bus bandwidth (multi-GPU runs with a warm-up; empty otherwise).
  const std::vector<comm::CollectiveTiming>& collective_timings() const {
    return collective_timings_;
  }
  static constexpr int kTimedCollectives = 4096;  // per communicator, over the whole warm-up
  // The region --inject planted its fault in ("" without one).
  const std::string& fault_region() const { return fault_region_; }

 private:
  void build_step_plan();
  void build_eval_plan();
  // `site`: which of the fault's sites the region is (FaultInjector::sites()); -1: none.
  graphs::Region wrap(graphs::Region region, int site);
  // Data parallelism: which buckets each region finishes (the last region in step order whose
  // arguments write a bucket's gradients); the others go with the optimizer.
  std::vector<std::vector<int>> bucket_regions(const std::vector<graphs::Region>& regions);
  // The mean over the data-parallel ranks of bucket b's gradients, this rank's part in place.
  void reduce_scatter_bucket(int b, cudaStream_t stream) const;
  // Enqueues the reduce-scatters of `buckets` after the work on `stream` so far, on the side
  // stream (the optimizer joins it).
  void reduce_scatter_buckets(const std::vector<int>& buckets, cudaStream_t stream) const;
  void optimizer_step(cudaStream_t stream) const;
  bool stalls_here() const;  // --inject rank-stall: this process is the one that stalls
  graphs::RegionArgs optimizer_args() const;

  Context& ctx_;
  Model& model_;
  TrainingConfig training_;
  TrainerOptions options_;
  ArenaPlan plan_;
  bench::PeakBuffers peak_buffers_;
  BufferId scalars_id_ = -1, rng_id_ = -1, sumsq_id_ = -1, lamb_ws_id_ = -1;
  void* lamb_ws_ = nullptr;  // LAMB's per-chunk norms and per-tensor ratios
  double* sumsq_ = nullptr;  // data parallel: the grad norm's sum of squares, all-reduced
  const Arena* arena_ = nullptr;
  size_t used_before_arena_ = 0;
  bench::Peaks peaks_;
  StepScalars* scalars_ = nullptr;
  int key_ = 0;  // the shape key of the batch last loaded
  int64_t steps_enqueued_ = 0;
  std::optional<comm::Traffic> step_traffic_;
  std::vector<comm::CollectiveTiming> collective_timings_;
  std::string fault_region_;
  std::unique_ptr<graphs::RngTracker> rng_;
  std::unique_ptr<graphs::ReadbackRing> readback_;
  std::unique_ptr<graphs::FaultInjector> injector_;     // --inject only
  std::unique_ptr<graphs::Conditionals> conditionals_;  // TrainingConfig::skip_with_if only
  // Overlapped reduce-scatters (data parallel, every mode): their stream, the fork and join events.
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t comm_fork_ = nullptr, comm_join_ = nullptr;
  std::vector<int> optimizer_buckets_;  // reduce-scattered by the optimizer itself
  std::unique_ptr<graphs::StepPlan> step_plan_;
  std::unique_ptr<graphs::StepPlan> eval_plan_;
};

}  // namespace replay::train
