// accumulate.h: the two small reductions gradient accumulation over micro-batches needs beyond
// replay's library ops: adding a later micro-batch's bias gradient (which a GEMM epilogue can only
// write) into the first's, and averaging the micro-batches' losses into the step's loss.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace replay {

// dst[i] += src[i] for i < n (fp32). dst and src 16-byte aligned.
void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream);

// dst[0] = (src[0] + src[1] + ... + src[n-1]) / n, summed in that order in fp32 (one thread):
// bit-identical to the same loop on the host.
void mean_of(float* dst, const float* src, int n, cudaStream_t stream);

}  // namespace replay
