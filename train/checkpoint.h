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
// precision, the model's layout line, the step, the resolved configuration as JSON, the
// tensor-parallel degree the run had and each split tensor's layout (train/tp_layout.h), and the
// data hash the reader verifies. Gradients and activations are rewritten every step and are not
// saved.
//
// Parallel runs write one file holding the whole model. Tensor parallel: every split tensor (its
// weights, masters and moments) is put together from the group's slices on the group's rank 0,
// tensor by tensor (train/host_group.h), replicated tensors and the scalars are rank 0's; data
// parallel: the distributed optimizer's shares are gathered first
// (Trainer::gather_optimizer_state). A load at any tensor-parallel degree that divides the shapes
// gives each rank its slice: the group's rank 0 reads the file and sends each rank its slice, and
// each data-parallel rank keeps its share of the optimizer state.
//
// Files are named step-<iteration, 8 digits>.safetensors inside the --save directory; each is
// written to a temporary name and renamed when complete. --load takes a file or a directory (its
// newest step file).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "train/host_group.h"
#include "train/tp_layout.h"
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

// Metadata keys: the tensor-parallel degree the checkpoint was written at, and a JSON object of
// each split tensor's layout ({"layer0.attn.qkv.weight": "rows 384,128,128", ...}; the optimizer's
// tensors share their parameter's).
inline constexpr const char* kTpDegreeKey = "tensor_parallel";
inline constexpr const char* kTpLayoutKey = "tensor_parallel_layout";
// The degree a checkpoint was written at (1 when it records none).
int checkpoint_tp(const safetensors::Reader& reader);
// Host only, before any GPU work: a run at tensor-parallel degree `tp` can take the checkpoint,
// every split tensor's rows (each section) or columns being a multiple of tp. Throws
// bench::UsageError naming the tensor, its layout and both degrees otherwise.
void check_tensor_parallel(const safetensors::Reader& reader, int tp);
// Every parameter of a tensor-parallel model at degree `tp` is either replicated or has a
// TpSplit, so its slices can be put together: bench::UsageError naming the first that is neither
// (a save or load of a model that a checkpoint cannot hold whole). After the model is built.
void check_tensor_parallel_params(const ParamStore& params, int tp);

// The tensors a run of `trainer` saves and loads, in file order (names, dtypes, shapes of the
// whole tensors). After Trainer::allocate().
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
// (Trainer::gather_optimizer_state on every rank first). Tensor parallel: collective over
// `tp_group` (the trainer's tensor-parallel group, as host processes; null: one process), whose
// rank 0 writes the file and returns its path and size (the others return the iteration only).
SavedCheckpoint save_checkpoint(const std::string& dir, const Trainer& trainer,
                                const CheckpointIdentity& identity,
                                const nlohmann::ordered_json& config,
                                const OptimizerStateHost* gathered = nullptr,
                                const HostGroup* tp_group = nullptr);

// Loads a checked checkpoint into the trainer (after allocate(), before prepare()): parameters,
// optimizer (a distributed optimizer's rank takes its share), step scalars, RNG slots, the
// model's state and its data position; the readback ring continues at the saved iteration.
// Tensor parallel: collective over `tp_group`; its rank 0 reads the file, each rank takes its
// slice of every split tensor, whatever degree wrote it (a split tensor whose layout differs
// from this run's is refused first). Returns the iteration. Synchronizes.
int64_t load_checkpoint(const safetensors::Reader& reader, Trainer& trainer,
                        const HostGroup* tp_group = nullptr);

// The host side of both, without a GPU: one tensor of the file, whole (`entry`: its name, dtype
// and whole shape), split over the tensor-parallel group by `layout`; a rank's slice passes
// through host memory (fetch fills it for a save, store takes it on a load).
struct CheckpointTensor {
  safetensors::TensorEntry entry;
  TpLayout layout;
  std::function<void(void* slice)> fetch;
  std::function<void(const void* slice)> store;
};
// Collective over `group` (null: one process): the slices of every tensor put together, one
// tensor at a time, on the group's rank 0, which writes `path` with `meta` and the
// tensor-parallel keys added (a kNone tensor is fetched there only). Returns the data bytes
// written (0 on the other ranks).
uint64_t write_checkpoint_tensors(const std::string& path,
                                  const std::vector<CheckpointTensor>& tensors,
                                  safetensors::Metadata meta, const HostGroup* group);
// Collective over `group`: its rank 0 streams `reader`'s data (its hash verified; the file holds
// exactly `tensors`, check_tensors) and every rank's store gets its slice of each tensor, in the
// file's order. `reader` is used on rank 0 only (null elsewhere is fine).
void read_checkpoint_tensors(const safetensors::Reader* reader,
                             const std::vector<CheckpointTensor>& tensors, const HostGroup* group);
// The file's layouts agree with `tensors`' (a file that records none, an older one, agrees):
// bench::UsageError naming the tensor and both layouts otherwise.
void check_layouts(const safetensors::Reader& reader, const std::vector<CheckpointTensor>& tensors);

// --dump-step: the quantities of the step just taken, for a cross-check by another tool
// (scripts/pytorch_baseline.py gradcheck): "loss" (f32 scalar), "grad.<param name>" (fp32, the
// gradient of the step's loss, unscaled: divided by the loss scale), and "batch.<name>" (the
// model's batch_tensors). Metadata: format "replay-step", tool, workload, preset, iteration.
// Synchronizes.
void dump_step(const std::string& path, const Trainer& trainer, const CheckpointIdentity& identity);

}  // namespace replay::train
