// unet_model.h: the Stable Diffusion v2 UNet (issue 28) as a train::Model: the diffusers
// UNet2DConditionModel structure (SD2's configuration: base 320 with multipliers 1, 2, 4, 4, two
// residual blocks per level, GroupNorm with 16 groups, spatial transformers with linear
// projections at every level but the last and in the middle, 64 channels per head, cross-attention
// to a 77 x 1024 context, GEGLU feed-forward, strided-convolution downsampling, nearest-neighbour
// upsampling then a convolution, concatenated skips), trained on the diffusion objective
// (diffusion.h: latents sampled from VAE moments, Philox noise and timesteps, v-prediction, MSE).
//
// How the step is built. The model is a list of nodes (a convolution, a GroupNorm, a linear layer,
// an attention, ...), each with a forward and a backward, over named tensors. From that list the
// model derives, at set-up and never during a step:
//   - every activation and gradient buffer with its lifetime in the step's phases (one per node
//     and direction: a node's forward, the loss, a node's backward), so the arena shares memory
//     between buffers that are never live together (an activation lives from its producer's
//     forward to the last forward or backward that reads it; a gradient from its first writer's
//     backward to its producer's); optionally (--recompute) norm and GEGLU outputs are not kept
//     but recomputed by the same kernels before the backward that reads them; GEGLU's input
//     gradient is written over its input;
//   - for each gradient, whether a node writes it or adds to it (a tensor read by several nodes:
//     the residual stream, the skips, the shared SiLU of the timestep embedding);
//   - the regions: one per UNet block forward ("down1.fwd") and backward ("down1.bwd"), and the
//     loss region between them; each lists the tensors and parameters it reads and writes.
// The trainer appends the optimizer; `layer` mode makes each block region a graph, `full` the whole
// step.
//
// Blocks: input (noise and timestep sampling, the timestep embedding's MLP, conv_in), down0 ..
// down{L-1}, mid, up0 .. up{L-1}, out (GroupNorm+SiLU, conv_out), and the loss. SD2: 11 blocks.
//
// Numerics: 16-bit weights and activations (fp16 by default, bf16 with --precision bf16), fp32
// master weights and gradients, fp32 accumulation everywhere; GroupNorm and LayerNorm (GroupNorm
// with one group over one token's channels) in fp32 math; attention in cuDNN's fp32 softmax. Every
// kernel and library call is deterministic (conv.h, gemm.h, attention.h, group_norm.h), so a step
// is bit-identical eager or captured.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/context.h"
#include "common/tensor.h"
#include "train/model.h"
#include "workloads/unet/latent_file.h"

namespace replay::unet {

struct UnetConfig {
  int64_t batch = 32;           // images per step (per GPU)
  int64_t latent = 64;          // latent height = width
  int64_t latent_channels = 4;  // in and out channels
  int64_t base = 320;           // channels of level 0 (and the timestep embedding's sinusoid)
  std::vector<int64_t> mult{1, 2, 4, 4};
  std::vector<bool> attention{true, true, true, false};  // spatial transformers per level
  int res_blocks = 2;        // residual blocks per down level (the up levels have one more)
  int groups = 16;           // GroupNorm groups
  int head_dim = 64;         // channels per attention head
  int64_t context_len = 77;  // text tokens
  int64_t context_dim = 1024;
  DType dtype = DType::kFP16;
  // Activations the backward recomputes instead of keeping (--recompute): GroupNorm(+SiLU) and
  // LayerNorm outputs (the norm's forward kernels again, from its saved input and weights) and
  // GEGLU outputs (the GEGLU kernel again, from the saved projection). Bit-identical either way:
  // the same kernels on the same bytes; they trade time for memory.
  bool recompute_norms = false;
  bool recompute_geglu = false;

  int levels() const { return static_cast<int>(mult.size()); }
  int64_t channels(int level) const { return base * mult[static_cast<size_t>(level)]; }
  int64_t time_dim() const { return 4 * base; }
  // Throws Error naming the field that the kernels or the structure cannot take.
  void validate() const;
  std::string describe() const;
};

// The data of a run. Batch p is batch p of common/data's BatchOrder over the training samples,
// shuffled per epoch from the data seed (the run's --seed), as the token files of the other
// workloads are read; load_batch copies its samples into the static input buffers. Either the
// training split is in pinned host memory (moments and text embeddings as fp16 bits, or bf16 text
// for a bf16 model), read once at set-up, or (stream) a LatentStream's prefetch thread reads each
// batch from the file ahead of the step, as BatchStream does for token files.
struct UnetData {
  LatentFileInfo info;
  int64_t samples = 0;                  // training samples the batches are drawn from
  std::vector<uint16_t> moments, text;  // held in memory: all `samples` of them
  bool stream = false;                  // streamed from info.path instead (moments, text empty)
  LatentDataShape shape;                // what the model takes (the stream validates against it)
};

// The network's structure without a GPU (no plans): parameter count and names in ParamStore order
// (diffusers' names, with attn1's to_q, to_k and to_v fused into to_qkv), blocks, nodes and the
// model FLOPs of a step.
struct UnetStructure {
  int64_t parameters = 0;
  int blocks = 0, nodes = 0;
  double flops_per_step = 0;
  std::vector<std::string> parameter_names;
  std::vector<int64_t> parameter_sizes;          // elements, same order
  std::vector<train::ParamInit> parameter_init;  // same order
  std::vector<int> nodes_per_class;  // nodes of each OpClass (--op-times), in OpClass order
  // A step's model FLOPs and least memory traffic of each OpClass (--op-times' rates): FLOPs for
  // convolutions, linear layers and attention; bytes of 16-bit activations and gradients, each
  // read or written once, for the norms and the pointwise ops (UnetModel's nodes say which).
  std::vector<double> flops_per_class, bytes_per_class;
  // The arena the model plans, its buffers at their lifetimes, with each attention call's
  // workspace estimated (the deterministic backward's: about B x heads x Sq x Skv x 2 bytes; the
  // forward's taken as 0) and without the other library workspaces (cuDNN's convolutions,
  // cuBLASLt: known once plans are built on a GPU, about 50 MiB); and the largest attention
  // workspace.
  size_t arena_bytes = 0;
  size_t attention_workspace_bytes = 0;
  // Where the arena goes: the table by group and the largest buffers, the phase at which the most
  // bytes are live (and the arena can be no smaller), what is live there by group and by the kind
  // of op that wrote it, the largest live buffers with their lifetimes.
  std::string memory_report;
  size_t peak_live_bytes = 0;
  std::string peak_phase;
  // Checks of the plan: convolutions whose input is not live at their backward (the weight
  // gradient reads it), and pairs of buffers live at the same phase that share bytes. Both 0.
  int conv_inputs_dead_at_backward = 0;
  int overlapping_live_pairs = 0;
};
UnetStructure unet_structure(const UnetConfig& config);

// The op classes --op-times sums node times over: convolutions (with their bias add, bias gradient
// and weight-gradient cast), GroupNorm(+SiLU), LayerNorm (the GroupNorm kernels with one group
// over one token), attention (cuDNN's fused attention, forward and backward), linear layers
// (cuBLASLt), pointwise ops (SiLU, additions, the timestep bias, GEGLU, upsampling,
// concatenation), the diffusion ops (noise and timestep sampling, the timestep embedding, the
// loss).
enum class OpClass : int {
  kConv,
  kGroupNorm,
  kLayerNorm,
  kAttention,
  kLinear,
  kPointwise,
  kDiffusion
};
constexpr int kOpClasses = 7;
const char* op_class_name(OpClass c);  // "convolution", "group_norm", ...

class UnetModel : public train::Model {
 public:
  // --overflow-at: the step (0-based, counted from the first timed step) whose loss gradient is
  // made infinite; -1: none.
  UnetModel(const Context& ctx, const UnetConfig& config, std::shared_ptr<const UnetData> data,
            int64_t overflow_at, uint64_t data_seed);
  ~UnetModel() override;

  std::string describe() const override;
  train::ParamStore& params() override;
  const train::ParamStore& params() const override;
  void plan(ArenaPlan& plan) override;
  void bind(const Arena& arena) override;
  void initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) override;
  void register_rng(graphs::RngTracker& rng) override;
  std::vector<graphs::Region> regions() override;
  int load_batch(cudaStream_t stream) override;
  int64_t data_position() const override;
  void seek_data(int64_t position) override;
  std::vector<NamedTensor> batch_tensors() const override;

  double flops_per_step() const override;
  std::string flops_formula() const override;
  double units_per_step() const override;
  double samples_per_step() const override;
  double loss_floor() const override;

  // --op-times FILE (eager runs only): every node's forward and backward timed with CUDA events,
  // summed per OpClass over every step but the first (lazy module loading), written to FILE as
  // JSON when the model is destroyed: per class ms and calls a step, and the achieved rate (model
  // TFLOP/s, or GB/s of least memory traffic: UnetStructure::flops_per_class, bytes_per_class).
  // Call before regions(); the event readback synchronizes at every load_batch.
  void time_ops(const std::string& path);
  // --poison-dead-buffers (eager runs only; a check, not a timed run): after every node's
  // forward and backward, the activation and gradient buffers whose planned lifetime ended there
  // are filled with 0xFF bytes (NaN in fp16, bf16 and fp32). A backward that read a buffer past
  // its lifetime (memory the arena may have given to another buffer) then reads NaN, and the
  // step overflows; with a complete plan the run is bit-identical to one without. Call before
  // regions().
  void poison_dead_buffers();

  // For reports and tests.
  int block_count() const;
  int64_t parameter_count() const;
  std::string plan_summary() const;  // convolution and attention plans, engines

  struct Impl;

 private:
  void write_op_times();
  std::unique_ptr<Impl> impl_;
};

}  // namespace replay::unet
