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
// One tensor-parallel rank's shard of a larger tensor (train/params.h): the shard is [rows, cols],
// the full tensor [sum of sections x ranks, full_cols]. The shard's rows come in up to four
// sections (a fused Q/K/V or gate/up weight), section s holding rows[s] rows that sit at row
// full_row[s] of the full tensor; its columns sit at column col_offset of a full row.
struct InitSlice {
  int sections = 1;
  int64_t rows[4] = {0, 0, 0, 0};
  int64_t full_row[4] = {0, 0, 0, 0};
  int64_t cols = 0;
  int64_t full_cols = 0;
  int64_t col_offset = 0;
};
// x[i] = mean + stddev * N(0,1) with the value init_normal draws for element g(i) of the full
// tensor, so the shards of every rank together hold exactly what one process draws for the whole
// tensor (the same seed and stream id): a tensor-parallel run starts from the one-GPU model.
void init_normal_slice(const TensorView& x, const InitSlice& slice, uint64_t seed,
                       uint64_t stream_id, float mean, float stddev, cudaStream_t stream);
// x[i] = value.
void init_constant(const TensorView& x, float value, cudaStream_t stream);

}  // namespace replay
