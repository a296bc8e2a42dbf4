// params.cpp: parameter layout, initialization and optimizer tables.
#include "train/params.h"

#include <algorithm>

#include "common/check.h"
#include "common/kernels/init.h"

namespace replay::train {

ParamStore::ParamStore(DType weight_dtype) : weight_dtype_(weight_dtype) {
  REPLAY_REQUIRE(
      weight_dtype == DType::kBF16 || weight_dtype == DType::kFP16 || weight_dtype == DType::kFP32,
      std::string("parameter weights must be bf16, fp16 or fp32, got ") + dtype_name(weight_dtype));
}

ParamId ParamStore::add(ParamSpec spec) {
  REPLAY_REQUIRE(!planned_, "parameter '" + spec.name + "' added after the arena was planned");
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  REPLAY_REQUIRE(!spec.shape.empty() && n > 0, "parameter '" + spec.name + "' is empty");
  specs_.push_back(std::move(spec));
  numel_.push_back(n);
  offset_.push_back(end_);
  end_ += (n + kAlignElements - 1) / kAlignElements * kAlignElements;
  return count() - 1;
}

int64_t ParamStore::total_numel() const {
  int64_t n = 0;
  for (int64_t x : numel_) n += x;
  return n;
}

void ParamStore::set_tensor_parallel(int rank, int count) {
  REPLAY_REQUIRE(count >= 1 && rank >= 0 && rank < count, "ParamStore::set_tensor_parallel");
  tp_rank_ = rank;
  tp_count_ = count;
}

void ParamStore::set_shard(int rank, int count) {
  REPLAY_REQUIRE(!planned_, "ParamStore::set_shard after plan");
  REPLAY_REQUIRE(count >= 1 && rank >= 0 && rank < count, "ParamStore::set_shard: bad rank");
  shard_rank_ = rank;
  shard_count_ = count;
}

void ParamStore::set_bucket_elements(int64_t elements) {
  REPLAY_REQUIRE(!planned_, "ParamStore::set_bucket_elements after plan");
  REPLAY_REQUIRE(elements >= 0, "ParamStore::set_bucket_elements: negative size");
  bucket_elements_ = elements;
}

std::vector<ParamStore::Piece> ParamStore::pieces() const {
  std::vector<Piece> out;
  ParamId id = 0;
  for (const Bucket& b : buckets_) {
    const int64_t lo = b.begin + shard_rank_ * (b.length / shard_count_),
                  hi = lo + b.length / shard_count_;
    while (id < count() && offset(id) + numel(id) <= lo) ++id;
    for (ParamId t = id; t < count() && offset(t) < hi; ++t) {
      const int64_t a = std::max(lo, offset(t)), e = std::min(hi, offset(t) + numel(t));
      if (a < e) out.push_back({t, a - offset(t), e - a});
    }
  }
  return out;
}

ParamStore::Bucket ParamStore::share_part(int64_t flat) const {
  for (const Bucket& b : buckets_)
    if (flat >= b.begin && flat < b.begin + b.length) {
      const int64_t part = b.length / shard_count_;
      return Bucket{b.begin + shard_rank_ * part, part, b.share_begin};
    }
  REPLAY_REQUIRE(
      false, "ParamStore::share_part: flat element " + std::to_string(flat) + " is in no bucket");
  return {};
}

int64_t ParamStore::share_index(int64_t flat) const {
  const Bucket p = share_part(flat);
  return flat >= p.begin && flat < p.begin + p.length ? p.share_begin + (flat - p.begin) : -1;
}

void ParamStore::plan(ArenaPlan& plan, Lifetime optimizer) {
  REPLAY_REQUIRE(!specs_.empty(), "a model without parameters");
  planned_ = true;
  // The buckets, from the last tensor back; each is laid out contiguously, padded to the quantum,
  // which moves the tensors' offsets.
  const int64_t quantum = kAlignElements * shard_count_;
  auto aligned = [](int64_t n) {
    return (n + kAlignElements - 1) / kAlignElements * kAlignElements;
  };
  std::vector<int> first_of_bucket;  // in flat order once reversed
  int64_t filled = 0;
  for (ParamId id = count() - 1; id >= 0; --id) {
    filled += numel(id);
    if (id == 0 || (bucket_elements_ > 0 && filled >= bucket_elements_)) {
      first_of_bucket.push_back(id);
      filled = 0;
    }
  }
  std::reverse(first_of_bucket.begin(), first_of_bucket.end());
  buckets_.clear();
  end_ = 0;
  for (size_t b = 0; b < first_of_bucket.size(); ++b) {
    const ParamId last = b + 1 < first_of_bucket.size() ? first_of_bucket[b + 1] : count();
    Bucket bucket;
    bucket.begin = end_;
    for (ParamId id = first_of_bucket[b]; id < last; ++id) {
      offset_[static_cast<size_t>(id)] = end_;
      end_ += aligned(numel(id));
    }
    end_ = (end_ + quantum - 1) / quantum * quantum;
    bucket.length = end_ - bucket.begin;
    bucket.share_begin = bucket.begin / shard_count_;
    buckets_.push_back(bucket);
  }
  weights_id_ =
      plan.add(std::string("params.") + dtype_name(weight_dtype_), weight_dtype_, end_, "params");
  const int64_t share = shard_numel();  // the optimizer's state: this rank's share
  masters_id_ = plan.add("params.master", DType::kFP32, share, "optimizer");
  m_id_ = plan.add("adam.exp_avg", DType::kFP32, share, "optimizer");
  v_id_ = plan.add("adam.exp_avg_sq", DType::kFP32, share, "optimizer");
  grads_id_ = plan.add("grads", DType::kFP32, end_, "grads");
  std::vector<int64_t> lengths;
  for (const Piece& p : pieces()) lengths.push_back(p.length);
  if (lengths.empty()) lengths.push_back(kAlignElements);  // a share of padding only
  adamw_table_bytes_ = MultiTensorBuilder<AdamWTensor>::device_bytes_for(lengths);
  norm_table_bytes_ = MultiTensorBuilder<GradNormTensor>::device_bytes_for(lengths);
  adamw_table_id_ = plan.add("adamw.table", adamw_table_bytes_, "optimizer");
  norm_table_id_ = plan.add("grad_norm.table", norm_table_bytes_, "optimizer");
  GradNormTable shape;  // the workspace depends on the chunk count only
  shape.num_chunks = static_cast<int>(MultiTensorBuilder<GradNormTensor>::chunk_count(lengths));
  grad_norm_ws_bytes_ = replay::grad_norm_workspace_bytes(shape);
  norm_ws_id_ = plan.add("grad_norm.workspace", grad_norm_ws_bytes_, "workspace", optimizer);
}

void ParamStore::bind(const Arena& arena) {
  REPLAY_REQUIRE(planned_, "ParamStore::bind before plan");
  weights_ = arena.data(weights_id_);
  masters_ = arena.as<float>(masters_id_);
  grads_ = arena.as<float>(grads_id_);
  m_ = arena.as<float>(m_id_);
  v_ = arena.as<float>(v_id_);
  adamw_table_memory_ = arena.data(adamw_table_id_);
  norm_table_memory_ = arena.data(norm_table_id_);
  grad_norm_ws_ = arena.data(norm_ws_id_);
}

TensorView ParamStore::weights() const {
  return TensorView(weights_, weight_dtype_, {end_});
}
TensorView ParamStore::masters() const {
  return TensorView(masters_, DType::kFP32, {shard_numel()});
}
TensorView ParamStore::grads() const {
  return TensorView(grads_, DType::kFP32, {end_});
}
TensorView ParamStore::exp_avg() const {
  return TensorView(m_, DType::kFP32, {shard_numel()});
}
TensorView ParamStore::exp_avg_sq() const {
  return TensorView(v_, DType::kFP32, {shard_numel()});
}

TensorView ParamStore::range(void* base, DType dtype, ParamId first, ParamId last) const {
  REPLAY_REQUIRE(first >= 0 && first <= last && last < count(), "parameter range out of bounds");
  const int64_t begin = offset(first), end = offset(last) + numel(last);
  return TensorView(static_cast<char*>(base) + begin * static_cast<int64_t>(dtype_size(dtype)),
                    dtype, {end - begin});
}

TensorView ParamStore::weight_range(ParamId first, ParamId last) const {
  return range(weights_, weight_dtype_, first, last);
}
TensorView ParamStore::grad_range(ParamId first, ParamId last) const {
  return range(grads_, DType::kFP32, first, last);
}

InitSlice ParamStore::tp_slice(ParamId id) const {
  const ParamSpec& s = spec(id);
  REPLAY_REQUIRE(!s.shape.empty(), "ParamStore: " + s.name + " has no shape to split");
  const int64_t n = numel(id), tp = tp_count_;
  InitSlice slice;
  if (s.tp_split == TpSplit::kCols) {
    slice.cols = s.shape.back();
    slice.rows[0] = n / slice.cols;
    slice.full_cols = slice.cols * tp;
    slice.col_offset = slice.cols * tp_rank_;
    return slice;
  }
  const std::vector<int64_t> sections =
      s.tp_sections.empty() ? std::vector<int64_t>{s.shape[0]} : s.tp_sections;
  REPLAY_REQUIRE(sections.size() <= 4, "ParamStore: " + s.name + " has more than 4 sections");
  slice.sections = static_cast<int>(sections.size());
  slice.cols = slice.full_cols = n / s.shape[0];
  int64_t at = 0, rows = 0;
  for (size_t k = 0; k < sections.size(); ++k) {
    slice.rows[k] = sections[k];
    slice.full_row[k] = at + tp_rank_ * sections[k];
    at += sections[k] * tp;
    rows += sections[k];
  }
  REPLAY_REQUIRE(rows == s.shape[0], "ParamStore: the sections of " + s.name +
                                         " do not add up to its " + std::to_string(s.shape[0]) +
                                         " rows");
  return slice;
}

void ParamStore::initialize(uint64_t seed, cudaStream_t stream) {
  REPLAY_REQUIRE(weights_ != nullptr, "ParamStore::initialize before bind");
  const auto n = static_cast<size_t>(end_), share = static_cast<size_t>(shard_numel());
  REPLAY_CUDA_CHECK(cudaMemsetAsync(weights_, 0, n * dtype_size(weight_dtype_), stream));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(grads_, 0, n * sizeof(float), stream));
  for (float* p : {masters_, m_, v_})
    REPLAY_CUDA_CHECK(cudaMemsetAsync(p, 0, share * sizeof(float), stream));
  AdamWTableBuilder adamw;
  GradNormTableBuilder norms;
  for (ParamId id = 0; id < count(); ++id) {
    const ParamSpec& s = spec(id);
    const TensorView fp32(grads_ + offset(id), DType::kFP32, {numel(id)});  // the masters' draws
    const TensorView model(weight(id), weight_dtype_, {numel(id)});
    for (const TensorView& t : {fp32, model}) {
      switch (s.init) {
        case ParamInit::kNormal:
          if (tp_count_ > 1 && s.tp_split != TpSplit::kNone)
            init_normal_slice(t, tp_slice(id), seed, static_cast<uint64_t>(id) + 1, 0.0f, s.stddev,
                              stream);
          else
            init_normal(t, seed,
                        static_cast<uint64_t>(id) + 1 +
                            (s.tp_replicated ? 0u : static_cast<uint64_t>(tp_rank_) << 16),
                        0.0f, s.stddev, stream);
          break;
        case ParamInit::kZeros:
          init_constant(t, 0.0f, stream);
          break;
        case ParamInit::kOnes:
          init_constant(t, 1.0f, stream);
          break;
      }
    }
  }
  // The masters' share of the draws (a part of every bucket), and the gradients zero again.
  for (const Bucket& b : buckets_) {
    const int64_t part = b.length / shard_count_;
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(
        masters_ + b.share_begin, grads_ + b.begin + shard_rank_ * part,
        static_cast<size_t>(part) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
  REPLAY_CUDA_CHECK(cudaMemsetAsync(grads_, 0, n * sizeof(float), stream));
  for (const Piece& p : pieces()) {
    const int64_t at = offset(p.id) + p.first, in_share = share_index(at);
    const TensorView model(
        static_cast<char*>(weights_) + at * static_cast<int64_t>(dtype_size(weight_dtype_)),
        weight_dtype_, {p.length});
    adamw.add(masters_ + in_share, model, grads_ + at, m_ + in_share, v_ + in_share, p.length,
              spec(p.id).weight_decay);
    if (tp_rank_ == 0 || !spec(p.id).tp_replicated) norms.add(grads_ + at, p.length);
  }
  adamw_table_ = adamw.build(adamw_table_memory_, adamw_table_bytes_, stream);  // synchronizes
  grad_norm_table_ = norms.build(norm_table_memory_, norm_table_bytes_, stream);
}

}  // namespace replay::train
