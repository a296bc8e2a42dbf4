// grad_norm.h: deterministic global L2 norm over many fp32 gradient tensors, the gradient clipping
// coefficient and a non-finite flag, all written to device scalars (no host read-back). Per-chunk
// fp64 partial sums over a fixed chunking, then one block sums the partials in a fixed order, so
// the norm is bit-identical run to run and on any GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/optim/multi_tensor.h"

namespace replay {

struct GradNormTensor {
  const float* grad;  // 16-byte aligned
  int64_t numel;
};

using GradNormTable = MultiTensorTable<GradNormTensor>;

// Packs the table at set-up: add() every gradient, query device_bytes(), build() into that memory.
class GradNormTableBuilder {
 public:
  void add(const float* grad, int64_t numel);
  size_t device_bytes() const { return builder_.device_bytes(); }
  GradNormTable build(void* device, size_t bytes, cudaStream_t stream) const {
    return builder_.build(device, bytes, stream);
  }

 private:
  MultiTensorBuilder<GradNormTensor> builder_;
};

// Workspace: one fp64 partial sum per chunk.
size_t grad_norm_workspace_bytes(const GradNormTable& table);

// norm[0] = sqrt(sum of squares of every gradient) / loss_scale[0]   (loss_scale null: no division)
// grad_scale[0] = min(1, max_norm / (norm + 1e-6)) / loss_scale[0]    (max_norm <= 0: no clipping)
//   which is exactly the multiplier adamw_step reads: it clips and unscales in one.
// found_inf[0] is set to 1 when the norm is NaN or Inf and left as it is otherwise (the step's
// owner clears it, so other overflow checks can share the flag); may be null.
void grad_norm(const GradNormTable& table, float max_norm, const float* loss_scale, float* norm,
               float* grad_scale, int32_t* found_inf, void* workspace, size_t workspace_bytes,
               cudaStream_t stream);

// The same in two halves, for a norm over gradients split across data-parallel ranks: each rank
// writes the sum of squares of its share (fp64), the caller sums it over the ranks (an all-reduce,
// fixed order), and grad_norm_from_sumsq finishes as grad_norm does.
void grad_norm_sumsq(const GradNormTable& table, double* sumsq, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);
void grad_norm_from_sumsq(const double* sumsq, float max_norm, const float* loss_scale, float* norm,
                          float* grad_scale, int32_t* found_inf, cudaStream_t stream);

}  // namespace replay
