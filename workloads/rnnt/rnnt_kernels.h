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

namespace replay::rnnt {

// ---- Greedy decoding (MLPerf's RNN-T greedy decoder, batched) -----------------------------------
// Per utterance b: the last emitted label (the blank at the start), the prediction network's
// state, the frame t, the symbols emitted at this frame and in all. One decode step: the
// prediction network on the last label (from the committed state), the joint at frame t, the
// argmax k; then k == blank advances t, any other k is emitted (the label and the new state
// committed) and after max_per_frame symbols at one frame t advances anyway; an utterance is done
// at t == T_b or after max_symbols symbols. The step repeats while any utterance is active.
struct DecodeState {
  int32_t* label = nullptr;     // [B]
  int32_t* frame = nullptr;     // [B]
  int32_t* at_frame = nullptr;  // [B] symbols emitted at the current frame
  int32_t* active = nullptr;    // [B] 1 while decoding
  int32_t* flag = nullptr;      // [1] 1 while any utterance is active (the WHILE condition)
  int32_t* tokens = nullptr;    // [B, max_symbols] emitted labels
  int32_t* lengths = nullptr;   // [B] labels emitted
};
struct DecodeShape {
  int64_t batch = 0, vocab = 0, layers = 0, hidden = 0;  // B, V, the prediction LSTM's L and H
  int32_t blank = 0;
  int32_t max_per_frame = 30;
  int32_t max_symbols = 300;
};
// Resets the state for a batch with frame_lengths [B] (an utterance of 0 frames is done at once)
// and zeroes the committed LSTM state h, c [L, B, H].
void decode_init(const DecodeState& st, void* h, void* c, DType type, const int32_t* frame_lengths,
                 const DecodeShape& shape, cudaStream_t stream);
// x[b, :] = table[label[b], :] (the prediction network's input: the embedding row of the label).
void decode_embed(void* x, const void* table, const int32_t* label, DType type,
                  const DecodeShape& shape, int64_t channels, cudaStream_t stream);
// hj[b, :] = relu(enc[b, min(frame[b], T - 1), :] + q[b, :]); enc [B, T, J], q [B, J].
void decode_joint(void* hj, const void* enc, const void* q, const int32_t* frame, DType type,
                  int64_t batch, int64_t frames, int64_t hidden, cudaStream_t stream);
// The argmax of logits [B, V] (the lowest index among equal maxima), the state update above, the
// new LSTM state hy, cy committed into h, c for the utterances that emitted, and the flag.
void decode_update(const DecodeState& st, const void* logits, void* h, void* c, const void* hy,
                   const void* cy, DType type, const int32_t* frame_lengths,
                   const DecodeShape& shape, cudaStream_t stream);
// Copies tokens and lengths into slot (*counter mod slots) of out_tokens [slots, B, max_symbols]
// and out_lengths [slots, B], then increments *counter.
void decode_store(int32_t* out_tokens, int32_t* out_lengths, int32_t* counter, int64_t slots,
                  const DecodeState& st, const DecodeShape& shape, cudaStream_t stream);

}  // namespace replay::rnnt

namespace replay::rnnt {

// The exponential moving average of the weights evaluation uses (MLPerf RNN-T's EMA):
// ema[i] = decay * ema[i] + (1 - decay) * w[i] in fp32, i < n. decay in [0, 1).
void ema_update(float* ema, const float* w, int64_t n, float decay, cudaStream_t stream);

}  // namespace replay::rnnt

namespace replay::rnnt {

// ---- A stopwatch on the device -----------------------------------------------------------------
// Times phases of work that may be inside CUDA graphs and WHILE nodes, with no host read until the
// end: clock [1 + slots] uint64, clock[0] the last mark (%globaltimer, ns), clock[1 + k] the time
// summed into slot k. clock_mark(clock, k) adds (now - clock[0]) to clock[1 + k] when k >= 0 and
// sets clock[0] = now; k = -1 only marks. One thread, in stream order: a mark is taken when the
// work before it on the stream is done. %globaltimer's resolution is a microsecond or finer.
void clock_mark(uint64_t* clock, int slot, int slots, cudaStream_t stream);

}  // namespace replay::rnnt
