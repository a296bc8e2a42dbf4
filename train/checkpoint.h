// checkpoint.h: training checkpoints, one safetensors file per save (common/safetensors.h), so
// PyTorch reads them with `safetensors.torch.load_file`. A checkpoint holds everything a step
// carries to the next, so a resumed run is bit-identical to one that never stopped:
//
//   <param name>                  the model weights in the run's weight dtype (bf16, fp16, fp32)
//   optimizer.master.<name>       fp32 master weights
//   optimizer.exp_avg.<name>      Adam's first moment (fp32)
//   optimizer.exp_avg_sq.<name>   Adam's second moment (fp32)
//   train.step, train.iteration   optimizer steps taken and steps executed (i64 scalars)
//   train.loss_scale, train.growth_tracker, train.hysteresis_left   the dynamic loss scaler
//   train.lr, train.loss          the last step's (informative; every step rewrites them)
//   rng.<stream>                  each Philox stream's {seed, offset} (i64 [2], the bits of u64)
//   data.position                 the index of the next training batch in the data order
//   state.<name>                  the model's own carried state (Model::checkpoint_state)
//
// and, as metadata, the format and its version, replay's version, the tool, workload, preset,
// precision, the model's layout line, the step, the resolved configuration as JSON, and the data
// hash the reader verifies. Gradients and activations are rewritten every step and are not saved.
//
// Files are named step-<iteration, 8 digits>.safetensors inside the --save directory; each is
// written to a temporary name and renamed when complete. --load takes a file or a directory (its
// newest step file).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "train/trainer.h"

namespace replay::train {

inline constexpr const char* kCheckpointFormat = "replay-checkpoint";
inline constexpr int kCheckpointVersion = 1;

// What a checkpoint must agree with before anything is loaded.
struct CheckpointIdentity {
  std::string tool, workload, preset, precision;
  uint64_t seed = 0;  // the data order depends on it, so a resumed run keeps the saved run's
};

// "step-00000010.safetensors".
std::string checkpoint_file_name(int64_t iteration);
// --load's argument: a checkpoint file, or a directory whose newest step file is taken. Throws
// bench::UsageError when there is none.
std::string find_checkpoint(const std::string& path);
// --save's directory, created when missing; throws bench::UsageError when it cannot be written.
void prepare_save_directory(const std::string& dir);

// The seed the checkpoint's run used (its metadata), for a resumed run given no --seed.
uint64_t checkpoint_seed(const std::string& path);
// An output file's directory exists and is writable (--dump-step): bench::UsageError naming the
// flag otherwise.
void check_output_file(const std::string& flag, const std::string& path);
// Opens `path` (safetensors validation) and checks that it is a replay checkpoint of this
// identity: format, version, workload, preset, precision and seed. Host only: before any GPU work.
std::unique_ptr<safetensors::Reader> open_checkpoint(const std::string& path,
                                                     const CheckpointIdentity& identity);

// The tensors a run of `trainer` saves and loads, in file order (names, dtypes, shapes). After
// Trainer::allocate().
std::vector<safetensors::TensorEntry> checkpoint_tensors(const Trainer& trainer);
// The checkpoint holds exactly the `expected` tensors, each with its dtype and shape. Throws
// bench::UsageError naming the first tensor that differs, with both shapes or dtypes.
void check_tensors(const safetensors::Reader& reader,
                   const std::vector<safetensors::TensorEntry>& expected);

// Saves the trainer's state after the steps its scalars count, as `dir`/step-<iteration>.
// Synchronizes the stream (a save is its own phase, never inside a timed step). Returns the path.
struct SavedCheckpoint {
  std::string path;
  int64_t iteration = 0;
  uint64_t bytes = 0;
};
// A distributed optimizer's master weights and moments come whole from `gathered`
// (Trainer::gather_optimizer_state on every rank first).
SavedCheckpoint save_checkpoint(const std::string& dir, const Trainer& trainer,
                                const CheckpointIdentity& identity,
                                const nlohmann::ordered_json& config,
                                const OptimizerStateHost* gathered = nullptr);

// Loads a checked checkpoint into the trainer (after allocate(), before prepare()): parameters,
// optimizer (a distributed optimizer's rank takes its share), step scalars, RNG slots, the
// model's state and its data position; the readback ring
// continues at the saved iteration. Returns that iteration. Synchronizes.
int64_t load_checkpoint(const safetensors::Reader& reader, Trainer& trainer);

// --dump-step: the quantities of the step just taken, for a cross-check by another tool
// (scripts/pytorch_baseline.py gradcheck): "loss" (f32 scalar), "grad.<param name>" (fp32, the
// gradient of the step's loss, unscaled: divided by the loss scale), and "batch.<name>" (the
// model's batch_tensors). Metadata: format "replay-step", tool, workload, preset, iteration.
// Synchronizes.
void dump_step(const std::string& path, const Trainer& trainer, const CheckpointIdentity& identity);

}  // namespace replay::train
