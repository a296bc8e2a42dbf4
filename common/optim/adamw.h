// adamw.h: fused AdamW (decoupled weight decay, as torch.optim.AdamW and Megatron's Adam) over
// every parameter tensor of a model in one launch. Step, learning rate, gradient scale and the skip
// flag are read on the device, so the update can live inside a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/optim/multi_tensor.h"
#include "common/tensor.h"

namespace replay {

// One parameter tensor. fp32 pointers 16-byte aligned, the model copy aligned to four of its
// elements (Arena buffers are).
struct AdamWTensor {
  float* master;      // fp32 master weights, updated in place
  void* model;        // the copy of the updated weights the model computes with; may be null
  const float* grad;  // fp32 gradient
  float* exp_avg;     // first moment
  float* exp_avg_sq;  // second moment
  int64_t numel;
  int32_t weight_decay;  // 1: apply weight decay (matrices), 0: not (biases, norms)
  int32_t model_dtype;   // DType of `model`: kBF16, kFP16 or kFP32
};

using AdamWTable = MultiTensorTable<AdamWTensor>;

// Packs the table at set-up: add() every tensor, query device_bytes(), build() into that memory.
class AdamWTableBuilder {
 public:
  // `model`: bf16, fp16 or fp32 (the copy rounds to it), or null data for none.
  void add(float* master, const TensorView& model, const float* grad, float* exp_avg,
           float* exp_avg_sq, int64_t numel, bool weight_decay);
  // The same with a bf16 copy (or null).
  void add(float* master, __nv_bfloat16* model, const float* grad, float* exp_avg,
           float* exp_avg_sq, int64_t numel, bool weight_decay);
  size_t device_bytes() const { return builder_.device_bytes(); }
  AdamWTable build(void* device, size_t bytes, cudaStream_t stream) const {
    return builder_.build(device, bytes, stream);
  }

 private:
  MultiTensorBuilder<AdamWTensor> builder_;
};

// Constants of a run (passed by value).
struct AdamWHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// One AdamW step over the table. For every element, with g = grad * grad_scale[0] and t = step[0]:
//   param *= 1 - lr * weight_decay                      (where the tensor applies weight decay)
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   model = bf16(param), fp16(param) or param, as the tensor's model_dtype says
// lr: fp32 device scalar. step: int64 device scalar, already incremented for this step (t >= 1).
// grad_scale: fp32 device scalar (clip coefficient times inverse loss scale), or null for 1.
// noop: int32 device flag, or null; when non-zero the kernel returns without touching anything.
void adamw_step(const AdamWTable& table, const AdamWHyper& hyper, const float* lr,
                const int64_t* step, const float* grad_scale, const int32_t* noop,
                cudaStream_t stream);

}  // namespace replay
