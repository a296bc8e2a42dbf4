// params.h: ParamStore, the parameters of a model laid out in five contiguous arena buffers (model
// weights in the model's dtype: bf16, fp16 or fp32; fp32 master weights, fp32 gradients, Adam's two
// fp32 moments), each tensor at the same element offset in all five and 256-byte aligned, plus the
// multi-tensor tables the optimizer and the gradient norm run on. Under a distributed optimizer
// (set_shard) the master weights and moments hold only this rank's share of that flat layout. One
// buffer per kind keeps step-plan state, region arguments and hashes simple: a layer's parameters
// are one contiguous range.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/arena.h"
#include "common/kernels/init.h"
#include "common/optim/adamw.h"
#include "common/optim/grad_norm.h"
#include "common/check.h"
#include "common/tensor.h"

namespace replay::train {

enum class ParamInit : uint8_t { kNormal, kZeros, kOnes };

// Tensor parallelism: how one rank's tensor sits in the full tensor, so that initialize() draws
// for it the full tensor's numbers (init_normal_slice) and the ranks together start from the
// one-process model. kRows: the rank holds tp_sections[s] rows of each section of the full tensor
// (one section for a column-parallel weight or the vocabulary; q, k and v of a fused QKV weight;
// gate and up of a fused SwiGLU weight); kCols: an equal block of every row's columns (a
// row-parallel weight).
enum class TpSplit : uint8_t { kNone, kRows, kCols };

struct ParamSpec {
  std::string name;            // "layer3.mlp.fc1.weight"
  std::vector<int64_t> shape;  // row-major; a linear layer's weight is [out, in]
  ParamInit init = ParamInit::kNormal;
  float stddev = 0.02f;      // kNormal: N(0, stddev^2)
  bool weight_decay = true;  // matrices and embeddings decay; biases and norm parameters do not
  // Tensor parallelism: the same tensor on every rank of the group (norms, row-parallel biases,
  // position embeddings), drawn alike and counted once in the gradient norm.
  bool tp_replicated = false;
  TpSplit tp_split = TpSplit::kNone;
  std::vector<int64_t> tp_sections;  // kRows: this rank's rows per section (empty: one section)
};

using ParamId = int;

class ParamStore {
 public:
  // Every tensor starts at a multiple of this many elements: 256 bytes in bf16, what GEMM plans
  // assume (GemmDesc::alignment).
  static constexpr int64_t kAlignElements = 128;

  // `weight_dtype`: what the model computes with (bf16, fp16 or fp32).
  explicit ParamStore(DType weight_dtype = DType::kBF16);
  DType weight_dtype() const { return weight_dtype_; }

  // Registers a tensor; only before plan().
  ParamId add(ParamSpec spec);

  int count() const { return static_cast<int>(specs_.size()); }
  const ParamSpec& spec(ParamId id) const { return specs_.at(static_cast<size_t>(id)); }
  int64_t numel(ParamId id) const { return numel_.at(static_cast<size_t>(id)); }
  int64_t offset(ParamId id) const { return offset_.at(static_cast<size_t>(id)); }
  int64_t total_numel() const;                   // the parameter count N (gaps excluded)
  int64_t buffer_numel() const { return end_; }  // length of each buffer, alignment gaps included

  // Data parallelism with a distributed optimizer (ZeRO-1), before plan(): `count` ranks each own
  // 1/count of the flat buffers, this one share `rank`. The buffers grow to a multiple of count x
  // kAlignElements so the shares are equal and aligned. The fp32 master weights and both moments
  // are allocated for the share only (masters(), exp_avg(), exp_avg_sq() hold shard_numel()
  // elements: this rank's part of every bucket, set_bucket_elements): what makes the optimizer's
  // memory per GPU fall with count. The weights and gradients stay whole; the AdamW and grad-norm
  // tables cover the share (the pieces of the tensors that fall in it). The gradients are
  // reduce-scattered into the share and the weights all-gathered from the shares
  // (train/trainer.cpp).
  void set_shard(int rank, int count);
  // Gradient buckets of the distributed optimizer, before plan(): the tensors are grouped, from
  // the last (whose gradients the backward finishes first) to the first, into buckets of at least
  // `elements` parameters, each laid out contiguously and padded to a multiple of count x
  // kAlignElements. Each bucket is reduce-scattered on its own as soon as the backward has
  // finished its gradients, and every bucket is split over the ranks: a rank's share is its
  // 1/count of every bucket, concatenated in flat order. Without it: one bucket of everything.
  void set_bucket_elements(int64_t elements);
  // A bucket: flat elements [begin, begin + length); this rank's share of it starts at flat
  // element begin + rank x length / count and at element share_begin of the share.
  struct Bucket {
    int64_t begin = 0, length = 0, share_begin = 0;
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }  // flat order, after plan()
  // The share element that holds flat element `flat`, or -1 when another rank's share holds it.
  int64_t share_index(int64_t flat) const;
  // This rank's part of the bucket that holds flat element `flat`: flat elements [begin, begin +
  // length), held from share element share_begin on.
  Bucket share_part(int64_t flat) const;
  // Tensor parallelism, before initialize(): this process is rank `rank` of `count`. A tensor with
  // a tp_split draws its slice of the full tensor's numbers (the ranks together hold what one
  // process draws); a sharded one without draws its own per rank (Philox stream id + 1 + rank x
  // 65536); replicated ones draw the same everywhere, and only rank 0's gradient-norm table holds
  // them, so the norm's sum of squares summed over the group counts every parameter once.
  void set_tensor_parallel(int rank, int count);
  int shard_rank() const { return shard_rank_; }
  int shard_count() const { return shard_count_; }
  int64_t shard_numel() const { return end_ / shard_count_; }  // the share: 1/count of each bucket

  // Adds the five buffers, the AdamW and grad-norm tables and the grad-norm workspace (lifetime
  // `optimizer`, the phase the optimizer runs in) to the plan.
  void plan(ArenaPlan& plan, Lifetime optimizer);
  void bind(const Arena& arena);

  // After bind(): pointers to one tensor, and views of whole buffers or of the contiguous range of
  // tensors [first, last] (region arguments and state of the step plan). weight<T>() checks that T
  // has the size of the weight dtype.
  void* weight(ParamId id) const {
    return static_cast<char*>(weights_) +
           offset(id) * static_cast<int64_t>(dtype_size(weight_dtype_));
  }
  template <typename T>
  T* weight(ParamId id) const {
    REPLAY_REQUIRE(sizeof(T) == dtype_size(weight_dtype_),
                   std::string("parameter weights are ") + dtype_name(weight_dtype_));
    return static_cast<T*>(weight(id));
  }
  // One tensor's master weights: only without a distributed optimizer (masters hold a share).
  float* master(ParamId id) const {
    REPLAY_REQUIRE(shard_count_ == 1, "ParamStore::master: the master weights are sharded");
    return masters_ + offset(id);
  }
  float* grad(ParamId id) const { return grads_ + offset(id); }
  TensorView weights() const;
  TensorView masters() const;
  TensorView grads() const;
  TensorView exp_avg() const;
  TensorView exp_avg_sq() const;
  TensorView weight_range(ParamId first, ParamId last) const;
  TensorView grad_range(ParamId first, ParamId last) const;

  // Set-up (synchronizes `stream`): zeroes all five buffers (gaps included, so hashes and
  // verification see defined bytes), draws every master weight (Philox: seed, stream id = id + 1)
  // and the model weight from the same draws (so weight = dtype(master)), and builds the tables.
  // The fp32 draws go to the gradient buffer first (whole, and unused before the first step),
  // which hands the masters their share and is zeroed again.
  void initialize(uint64_t seed, cudaStream_t stream);

  const AdamWTable& adamw_table() const { return adamw_table_; }
  const GradNormTable& grad_norm_table() const { return grad_norm_table_; }
  void* grad_norm_workspace() const { return grad_norm_ws_; }
  size_t grad_norm_workspace_bytes() const { return grad_norm_ws_bytes_; }

 private:
  TensorView range(void* base, DType dtype, ParamId first, ParamId last) const;
  InitSlice tp_slice(ParamId id) const;  // where a tp_split tensor sits in the full one

  DType weight_dtype_;
  std::vector<ParamSpec> specs_;
  std::vector<int64_t> numel_, offset_;
  int64_t end_ = 0;
  bool planned_ = false;
  int shard_rank_ = 0, shard_count_ = 1;
  int64_t bucket_elements_ = 0;  // 0: one bucket
  std::vector<Bucket> buckets_;
  int tp_rank_ = 0, tp_count_ = 1;
  // The pieces of the tensors in this rank's share: (tensor, first element, length), in flat
  // order (so in share order too).
  struct Piece {
    ParamId id;
    int64_t first, length;
  };
  std::vector<Piece> pieces() const;
  BufferId weights_id_ = -1, masters_id_ = -1, grads_id_ = -1, m_id_ = -1, v_id_ = -1;
  BufferId adamw_table_id_ = -1, norm_table_id_ = -1, norm_ws_id_ = -1;
  void* weights_ = nullptr;
  float *masters_ = nullptr, *grads_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  void* adamw_table_memory_ = nullptr;
  size_t adamw_table_bytes_ = 0;
  void* norm_table_memory_ = nullptr;
  size_t norm_table_bytes_ = 0;
  void* grad_norm_ws_ = nullptr;
  size_t grad_norm_ws_bytes_ = 0;
  AdamWTable adamw_table_;
  GradNormTable grad_norm_table_;
};

}  // namespace replay::train
