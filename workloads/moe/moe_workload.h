// moe_workload.h: MoeWorkload, replay-moe's train::Workload: the presets (tiny, small, 671b-ep32),
// its own flags (--capacity-factor, --dropless, --graph-scope, --layers, --ep, --micro-batch,
// --rope-scaling), the resolved configuration, the synthetic data line, the model (moe_model.h) and
// the MLPerf events.
#pragma once

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "train/workload.h"
#include "workloads/moe/moe_model.h"

namespace replay::moe {

// The graph scopes --graph-scope accepts (Megatron's names, plus mlp for the dense blocks and
// moe_experts for the routed and shared experts).
const std::vector<std::string>& graph_scope_names();

class MoeWorkload : public train::Workload {
 public:
  MoeWorkload();

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
  void log_config(bench::MlLogger& log, const train::Model& model,
                  const train::TrainingConfig& training) const override;
  int expert_parallel() const override { return ep_flag_ > 0 ? ep_flag_ : 1; }
  void set_expert_parallel(int rank, int size, comm::Communicator* comm) override;

  const MoeShape& shape() const { return shape_; }
  const std::vector<std::string>& scopes() const { return scopes_; }
  // Device memory one more MoE block of the shape needs (parameters with their fp32 master,
  // gradient and Adam moments, and its saved activations), and what the run needs besides blocks.
  int64_t block_bytes() const;
  int64_t fixed_bytes() const;

 private:
  train::WorkloadInfo info_;
  std::vector<train::Preset> presets_;
  std::string preset_;
  double capacity_flag_ = -1;  // < 0: the preset's
  bool dropless_ = false;
  std::string scope_flag_;
  int layers_flag_ = 0;  // 0: the preset's, within the memory budget (671b-ep32)
  int ep_flag_ = 0;      // --ep: 0 not given (the preset's fold), else the expert-parallel ranks
  int micro_batch_flag_ = 0;       // --micro-batch: 0 the preset's
  std::string rope_scaling_flag_;  // --rope-scaling yarn|none; empty: the preset's
  comm::Communicator* ep_comm_ = nullptr;
  std::vector<std::string> scopes_;
  MoeShape shape_;
  std::string layers_note_;
};

}  // namespace replay::moe
