// found_inf.h: whether any element of many bf16, fp16 or fp32 tensors is Inf or NaN, in one launch,
// into a device flag: the overflow check of dynamic loss scaling, with no host read.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/optim/multi_tensor.h"
#include "common/tensor.h"

namespace replay {

struct FoundInfTensor {
  const void* data;
  int64_t numel;
  int32_t dtype;  // DType as an integer: kBF16, kFP16 or kFP32
  int32_t pad;
};
using FoundInfTable = MultiTensorTable<FoundInfTensor>;

// Packs the table at set-up: add() every tensor, query device_bytes(), build() into that memory.
class FoundInfTableBuilder {
 public:
  void add(const TensorView& tensor);  // bf16, fp16 or fp32, contiguous
  size_t device_bytes() const { return builder_.device_bytes(); }
  FoundInfTable build(void* device, size_t bytes, cudaStream_t stream) const {
    return builder_.build(device, bytes, stream);
  }

 private:
  MultiTensorBuilder<FoundInfTensor> builder_;
};

// Sets *found_inf = 1 when any element of any tensor is Inf or NaN; leaves it unchanged otherwise
// (so several checks can share the flag; begin_step clears it). One launch for the whole table.
void check_found_inf(const FoundInfTable& table, int32_t* found_inf, cudaStream_t stream);

}  // namespace replay
