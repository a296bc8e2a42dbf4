// init.h: device-side tensor initialisation from Philox (normal, uniform, constant) for parameters
// and benchmark inputs. Deterministic for a given seed, whatever the launch configuration.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tensor.h"

namespace replay {

// x[i] = mean + stddev * N(0,1), the normal drawn by Box-Muller from philox_block(seed, stream_id,
// i/4). Supports bf16, fp16 and fp32 tensors.
void init_normal(const TensorView& x, uint64_t seed, uint64_t stream_id, float mean, float stddev,
                 cudaStream_t stream);
// x[i] uniform in [lo, hi).
void init_uniform(const TensorView& x, uint64_t seed, uint64_t stream_id, float lo, float hi,
                  cudaStream_t stream);
// x[i] = value.
void init_constant(const TensorView& x, float value, cudaStream_t stream);

}  // namespace replay
