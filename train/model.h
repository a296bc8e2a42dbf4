// model.h: train::Model, what the trainer drives: one model's buffers, parameters, step regions,
// data and cost, for one run. A workload builds it (workload.h); the trainer plans the arena around
// it, adds the optimizer, the step scalars, the RNG and the readback, and runs its regions eagerly,
// as per-layer graphs or as one graph (trainer.h). Nothing here knows a transformer, a UNet or an
// LSTM.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/arena.h"
#include "graphs/rng.h"
#include "graphs/step_plan.h"
#include "train/params.h"

namespace replay::train {

// What the trainer hands the model at initialization (device pointers into the step scalars).
struct StepIO {
  float* loss = nullptr;               // where the step's loss goes (the loss region writes it)
  const float* loss_scale = nullptr;   // the dynamic loss scale: the loss gradient is multiplied by
                                       // it (1.0 without loss scaling)
  const int64_t* iteration = nullptr;  // steps executed, skipped ones included (0 in the first)
};

// A model's evaluation: a metric over held-out batches, accumulated on the device by eval regions
// and read once at the end of each evaluation.
struct EvalInfo {
  std::string metric;  // "loss", "accuracy", "wer": mllog's eval_accuracy value
  bool higher_is_better = false;
  int64_t samples_per_batch = 1;
  int64_t default_samples = 0;    // held-out samples per evaluation unless --eval-samples says
  int64_t available_samples = 0;  // the held-out split's size
  // In `full` mode the evaluation is one graph too, unless the model says its eval regions must be
  // graphed one by one (`layer`'s units): RNN-T, whose cuDNN LSTM encoder and WHILE-node decoder
  // aborted the process when captured into one graph (workloads/rnnt/README.md).
  bool one_graph_in_full = true;
};

class Model {
 public:
  virtual ~Model() = default;

  // One line for the start-up header ("layers 2, hidden 128, ...").
  virtual std::string describe() const = 0;
  virtual ParamStore& params() = 0;
  virtual const ParamStore& params() const = 0;

  // ---- Set-up, in this order ----
  // Every buffer of the model, its ParamStore's included, with lifetimes in the step's phases.
  virtual void plan(ArenaPlan& plan) = 0;
  virtual void bind(const Arena& arena) = 0;
  // Parameters from `seed` and the model's constants. Synchronizes `stream`.
  virtual void initialize(uint64_t seed, const StepIO& io, cudaStream_t stream) = 0;
  // The random ops of a step (dropout, noise), on the tracker's named streams. Optional.
  virtual void register_rng(graphs::RngTracker& rng) { (void)rng; }

  // ---- The step ----
  // Forward and backward, in execution order; the trainer appends the optimizer. Every region
  // lists what it reads and writes (graphs/step_plan.h).
  virtual std::vector<graphs::Region> regions() = 0;
  // Shape keys of a step that runs at several shapes (graphs/step_plan.h): names, and what makes
  // the regions' arguments those of key k. None by default: one shape.
  virtual std::vector<std::string> shape_keys() const { return {}; }
  virtual void select_shape(int key) { (void)key; }
  // Copies the next training batch into the model's static inputs (outside any graph), selects the
  // shape key it needs, and returns it.
  virtual int load_batch(cudaStream_t stream) = 0;

  // ---- Checkpoints (train/checkpoint.h) ----
  // The training data's cursor: the index, in the model's own batch order, of the batch the next
  // load_batch() reads. A checkpoint stores it, so a resumed run sees the batches the uninterrupted
  // run would have seen.
  virtual int64_t data_position() const = 0;
  // Makes the next load_batch() read batch `position` (set-up, before the first load_batch()).
  virtual void seek_data(int64_t position) = 0;
  // Data parallelism: this rank reads its share of every global batch, batch position * count +
  // rank of the order (set-up, before the first load_batch()). False when the model cannot.
  virtual bool shard_data(int rank, int count) {
    (void)rank;
    (void)count;
    return false;
  }
  // Device state a step carries besides the parameters, the optimizer's moments, the step scalars
  // and the RNG (a router's biases, EMA weights), saved and loaded as "state.<name>". None by
  // default.
  struct NamedTensor {
    std::string name;
    TensorView view;
  };
  virtual std::vector<NamedTensor> checkpoint_state() const { return {}; }
  // The step's input batch as it sits in the model's static buffers (--dump-step writes it, so
  // another tool can compute the same step). None by default.
  virtual std::vector<NamedTensor> batch_tensors() const { return {}; }

  // ---- Evaluation (optional) ----
  virtual std::optional<EvalInfo> evaluation() const { return std::nullopt; }
  // Regions that evaluate the current held-out batch and add its result to device accumulators
  // (forward only, no random ops).
  virtual std::vector<graphs::Region> eval_regions() { return {}; }
  // Zeroes the accumulators and rewinds the held-out data (outside any graph).
  virtual void begin_eval(cudaStream_t stream) { (void)stream; }
  virtual void load_eval_batch(cudaStream_t stream) { (void)stream; }
  // The metric from the accumulators. Synchronizes: the end of an evaluation, never a step.
  virtual double end_eval(cudaStream_t stream) {
    (void)stream;
    return NAN;
  }

  // ---- Cost and throughput ----
  virtual double flops_per_step() const = 0;  // model FLOPs of one step
  virtual std::string flops_formula() const = 0;
  virtual double units_per_step() const = 0;  // in the workload's throughput unit (tokens, images)
  virtual double samples_per_step() const = 0;  // the global batch
  // What the step's collectives are: "none (tp 1)", "not run (1 process)", ...
  virtual std::string collectives() const { return "none"; }
  // The lowest loss the training data allow, where it is known (synthetic data); NaN otherwise.
  virtual double loss_floor() const { return NAN; }
};

}  // namespace replay::train
