// rnnt_kernels.h: the RNN-T model's small hand kernels around its library calls (cuDNN LSTMs,
// cuBLASLt GEMMs, the transducer loss of transducer.h): dropout on 16-bit activations, the joint's
// broadcast add + ReLU + dropout and its backward reductions, the one-hot rows the embedding GEMMs
// take, casts between a 16-bit weight space and fp32, and an int32 fill for cuDNN's device lengths.
// Every launcher takes its stream, never allocates or synchronises, and checks its launch; every
// kernel has a CPU reference in tests/workloads/rnnt/test_rnnt_kernels_gpu.cu.
//
// Types: the 16-bit tensors are fp16 or bf16 (DType::kFP16, kBF16), math in fp32. Dropout masks
// follow common/kernels/dropout.h: element e (its flat index) of an op is kept when component e % 4
// of philox_block(slot.seed, slot.offset + op_offset, e / 4) is >= dropout_threshold(p), and kept
// elements are scaled by 1 / (1 - p); the backward regenerates the mask, so nothing is stored. p =
// 0 reads no RNG state and is exact.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/philox.h"
#include "common/tensor.h"

namespace replay::rnnt {

// dst[i] = value, i < n.
void fill_int32(int32_t* dst, int32_t value, int64_t n, cudaStream_t stream);
// dst[i] = float(src[i]) (src fp16 or bf16), i < n.
void cast_to_fp32(float* dst, const void* src, DType src_type, int64_t n, cudaStream_t stream);
// dst[i] = dst_type(src[i]), rounded to nearest even, i < n.
void cast_from_fp32(void* dst, DType dst_type, const float* src, int64_t n, cudaStream_t stream);

// out [rows, vocab]: out[r, v] = 1 when v == tokens[r] (clamped to [0, vocab)), else 0. The
// embedding is then out E (a GEMM, exact: one non-zero term per row) and its gradient out^T dX (a
// GEMM with a fixed-order fp32 reduction: deterministic, no atomics). vocab a multiple of 8.
void one_hot(void* out, DType type, const int32_t* tokens, int64_t rows, int64_t vocab,
             cudaStream_t stream);

// out = dropout(x) over n elements (out may alias x); dx = dropout'(dy) with the same mask (dx may
// alias dy). n a multiple of 4 is not required.
void dropout_forward(void* out, const void* x, DType type, int64_t n, float p, RngArgs rng,
                     cudaStream_t stream);
void dropout_backward(void* dx, const void* dy, DType type, int64_t n, float p, RngArgs rng,
                      cudaStream_t stream);

// The joint's hidden layer over the lattice: enc [B, T, J] (the encoder's projection, bias
// included), pred [B, P, J] (the prediction network's, P = U + 1 label positions) and
//   h[b, t, u, j] = dropout(relu(enc[b, t, j] + pred[b, u, j]))     h [B, T, P, J]
// with the mask's element index e = ((b T + t) P + u) J + j (64-bit).
struct JointShape {
  int64_t batch = 0, frames = 0, positions = 0, hidden = 0;  // B, T, P, J
  int64_t rows() const { return batch * frames * positions; }
  int64_t elements() const { return rows() * hidden; }
};
void joint_hidden_forward(void* h, const void* enc, const void* pred, DType type,
                          const JointShape& shape, float p, RngArgs rng, cudaStream_t stream);
// The backward from dh [B, T, P, J]: with g = dh * mask / (1 - p) * [enc + pred > 0] (the sum
// recomputed in fp32 exactly as the forward did),
//   denc[b, t, j] = sum over u of g,   dpred[b, u, j] = sum over t of g
// each summed in fp32 in increasing u (t) order by one thread, then rounded: deterministic.
void joint_hidden_backward(void* denc, void* dpred, const void* dh, const void* enc,
                           const void* pred, DType type, const JointShape& shape, float p,
                           RngArgs rng, cudaStream_t stream);

}  // namespace replay::rnnt
