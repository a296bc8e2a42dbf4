// mlp_workload.h: the smallest workload that is not a transformer, and the example of what a new
// workload implements (README.md, "Adding a workload"): a classifier of a few GeLU layers, every
// GEMM through cuBLASLt with fused bias-GeLU epilogues, the fused cross-entropy, on synthetic data
// (Gaussian inputs labelled by a random teacher), with a held-out split and an evaluation of its
// loss. It touches no file in train/ or graphs/: it fills in train::Workload and train::Model and
// runs through train::run in all three graph modes.
//
// Per hidden layer l (h_0 = x, [B, D]; h_l, aux_l [B, H]), then the head:
//   h_{l+1} = gelu(h_l W_l^T + b_l), aux_l = the pre-activation     GEMM, bias-GeLU-aux epilogue
//   logits = h_L Wo^T + bo [B, K]; loss = cross-entropy(logits, y)   GEMM, bias epilogue; fused CE
// Backward: dlogits from the cross-entropy (scaled by the loss scale); dWo and dbo from one GEMM
// (bias-gradient epilogue); dz_{L-1} = (dlogits Wo) * gelu'(aux_{L-1}) (dGeLU epilogue); per layer
// dW_l and db_l = dz_l^T h_l and its column sums, and dz_{l-1} the same way.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/gemm.h"
#include "train/workload.h"

namespace replay::example {

struct MlpShape {
  int64_t inputs = 64;         // D
  int64_t hidden = 128;        // H
  int64_t layers = 2;          // hidden layers L
  int64_t classes = 16;        // K
  int64_t batch = 256;         // B
  int64_t train_batches = 32;  // the synthetic training split, in batches
  int64_t eval_batches = 4;    // the held-out split, in batches
};

class MlpModel : public train::Model {
 public:
  MlpModel(const Context& ctx, const MlpShape& shape, uint64_t data_seed);
  ~MlpModel() override;

  std::string describe() const override;
  train::ParamStore& params() override { return params_; }
  const train::ParamStore& params() const override { return params_; }
  void plan(ArenaPlan& plan) override;
  void bind(const Arena& arena) override;
  void initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) override;
  std::vector<graphs::Region> regions() override;
  int load_batch(cudaStream_t stream) override;
  // The training batches cycle through the split: position p is batch p mod train_batches.
  int64_t data_position() const override { return next_train_; }
  void seek_data(int64_t position) override;
  bool shard_data(int rank, int count) override;

  std::optional<train::EvalInfo> evaluation() const override;
  std::vector<graphs::Region> eval_regions() override;
  void begin_eval(cudaStream_t stream) override;
  void load_eval_batch(cudaStream_t stream) override;
  double end_eval(cudaStream_t stream) override;

  double flops_per_step() const override;
  std::string flops_formula() const override;
  double units_per_step() const override { return static_cast<double>(shape_.batch); }
  double samples_per_step() const override { return static_cast<double>(shape_.batch); }

 private:
  struct Layer {
    train::ParamId weight = -1, bias = -1;
    GemmPlan *forward = nullptr, *wgrad = nullptr, *dgrad = nullptr;  // dgrad: into the layer below
  };
  struct Buffer {
    BufferId id = -1;
    DType dtype = DType::kBF16;
    int64_t elements = 0;
    TensorView* view = nullptr;
  };

  void add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype, int64_t n);
  void gemm(GemmPlan* plan, GemmArgs args, cudaStream_t stream) const;
  const TensorView& input(int l) const { return l == 0 ? x_ : h_[static_cast<size_t>(l - 1)]; }
  TensorView weights(train::ParamId first, train::ParamId last) const;
  TensorView grads(train::ParamId first, train::ParamId last) const;
  void forward(int l, cudaStream_t s) const;
  void head(cudaStream_t s) const;
  void backward(int l, cudaStream_t s) const;
  void eval_head(cudaStream_t s) const;
  void copy_rows(int64_t first_row, cudaStream_t s);

  MlpShape shape_;
  train::ParamStore params_;
  GemmCache gemms_;
  std::vector<Layer> layers_;
  Layer out_;
  train::StepIO io_;
  // The synthetic data in pinned host memory: inputs [N, D] bf16 and labels [N], the training split
  // first, then the held-out one.
  void* host_x_ = nullptr;
  int32_t* host_y_ = nullptr;
  int64_t next_train_ = 0;           // training batches loaded (the data position)
  int64_t stride_ = 1, offset_ = 0;  // data parallelism: batch b is b * stride + offset
  int64_t next_eval_ = 0, evaluated_ = 0;
  std::vector<Buffer> buffers_;
  TensorView x_, y_, logits_, dlogits_, stats_, row_loss_, count_, gemm_ws_;
  TensorView eval_loss_, eval_sum_;
  std::vector<TensorView> h_, aux_, dz_;  // per hidden layer
};

class MlpWorkload : public train::Workload {
 public:
  MlpWorkload();

  const train::WorkloadInfo& info() const override { return info_; }
  const std::vector<train::Preset>& presets() const override { return presets_; }
  void add_flags(CLI::App& app) override;
  void resolve(const train::RunFlags& flags) override;
  nlohmann::ordered_json config() const override;
  std::string precision() const override { return "bf16"; }
  train::TrainingConfig training() const override;
  void open_data(const train::RunFlags& flags, std::FILE* out) override;
  std::unique_ptr<train::Model> build(Context& ctx, const train::TrainingConfig& training,
                                      const train::RunFlags& flags, std::FILE* out) override;
  bool evaluates() const override { return true; }
  void log_config(bench::MlLogger& log, const train::Model& model,
                  const train::TrainingConfig& training) const override;

  const MlpShape& shape() const { return shape_; }

 private:
  train::WorkloadInfo info_;
  std::vector<train::Preset> presets_;
  int width_flag_ = 0, depth_flag_ = 0;  // 0: the preset's
  bool loss_scaling_ = false;
  MlpShape shape_;
};

}  // namespace replay::example
