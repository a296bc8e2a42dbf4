// transducer.h: the RNN-T (transducer) loss over the joint network's logits, forward and backward,
// as device kernels that a CUDA graph can capture: every length, label and changing scalar is read
// on the device, the workspace is the caller's, and nothing is allocated or read back.
//
// Notation (Graves 2012): the joint gives logits z[b, t, u, v] for frame t < T_b, label position
// u <= U_b and symbol v < V (blank included). With lp = log_softmax over v,
//   alpha[t, u] = logaddexp(alpha[t-1, u] + lp[t-1, u, blank], alpha[t, u-1] + lp[t, u-1, y_u])
//   beta[t, u]  = logaddexp(beta[t+1, u] + lp[t, u, blank],    beta[t, u+1] + lp[t, u, y_{u+1}])
// from alpha[0, 0] = 0 and beta[T_b-1, U_b] = lp[T_b-1, U_b, blank] (the final blank), and the
// utterance's loss is -log P(y|x) = -(alpha[T_b-1, U_b] + lp[T_b-1, U_b, blank]) = -beta[0, 0].
//
//   transducer_forward:  lp of blank and of the next label per (b, t, u) (the log-sum-exp over V
//                        computed on the fly), alpha and beta, the per-utterance loss and its mean
//   transducer_backward: dloss/dz for every logit, written in place over the logits if wished
//
// The forward leaves in the workspace what the backward reads (the log-sum-exps, alpha, beta, the
// log-likelihoods): keep the workspace and the logits unchanged between the two calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/tensor.h"  // DType

namespace replay::rnnt {

// The most label positions (U + 1) an utterance may have: the alpha/beta recursion keeps one
// anti-diagonal of the lattice in a single warp's registers, at most 16 positions a lane.
constexpr int64_t kTransducerMaxPositions = 512;

// The joint's padded shape. logits [B, T, U + 1, V], row-major and contiguous, then:
//   labels [B, U] int32, frame_lengths [B] int32, label_lengths [B] int32 (device memory).
// The blank is a parameter: MLPerf's RNN-T (and torchaudio's default) put it last, blank = V - 1,
// with 1023 word pieces and V = 1024.
struct TransducerShape {
  int64_t batch = 0;       // B
  int64_t max_frames = 0;  // T: frames the logits are padded to
  int64_t max_labels = 0;  // U: labels the transcripts are padded to (U + 1 positions)
  int64_t vocab = 0;       // V, the blank included
  int32_t blank = 0;       // the blank's index in [0, V)

  int64_t positions() const { return max_labels + 1; }
  // Rows of V logits (one per (b, t, u)) and logits in all; the latter exceeds 2^31 at MLPerf's
  // sizes (192 x 205 x 72 x 1024 = 2.9e9), so every logit offset is a 64-bit integer.
  int64_t rows() const { return batch * max_frames * positions(); }
  int64_t elements() const { return rows() * vocab; }
};

// The row (b, t, u) of the logits, [0, rows()): its first logit is at row * V. 64-bit throughout,
// on the host and in the kernels.
__host__ __device__ constexpr int64_t transducer_row(int64_t b, int64_t t, int64_t u,
                                                     int64_t max_frames, int64_t positions) {
  return (b * max_frames + t) * positions + u;
}

// The device inputs. Lengths are clamped on the device to [0, T] and [0, U], and labels to [0, V),
// so that no value can make a kernel read or write out of bounds; labels past an utterance's
// length are never read. A label equal to the blank is not meaningful (nor are clamped values).
// An utterance with frame length 0 is an empty slot of the batch: its loss is 0, its gradient is
// 0, and the mean does not count it. Logits past an utterance's lengths are never read (they may
// hold anything, NaN included).
struct TransducerInputs {
  const void* logits = nullptr;            // [B, T, U + 1, V] of dtype
  DType dtype = DType::kFP16;              // kFP16 (what the workload trains with), kBF16 or kFP32
  const int32_t* labels = nullptr;         // [B, U]; may be null when U == 0
  const int32_t* frame_lengths = nullptr;  // [B], T_b
  const int32_t* label_lengths = nullptr;  // [B], U_b
};

// Bytes of workspace the forward fills and the backward reads: for every row the log-sum-exp,
// the blank's and the next label's log-probabilities, alpha and beta (five fp32 [B, T, U + 1]
// arrays), then the per-utterance log-likelihoods and the count of non-empty utterances. Depends
// on the shape only (plan it at the maximum shape of a graph's rung).
size_t transducer_workspace_bytes(const TransducerShape& shape);

// Forward. loss [B] fp32: -log P(y_b | x_b) per utterance (0 for empty slots). mean_loss: null,
// or one fp32: the mean over the non-empty utterances (0 when there are none), summed in a fixed
// order. Shape limits: B <= 65535, U + 1 <= kTransducerMaxPositions, T * (U + 1) < 2^31, V >= 1;
// workspace 16-byte aligned, at least transducer_workspace_bytes(shape).
void transducer_forward(float* loss, float* mean_loss, const TransducerInputs& in,
                        const TransducerShape& shape, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// What the backward differentiates: the sum of the utterances' losses, or their mean (the
// forward's mean_loss; the count of non-empty utterances comes from the forward's workspace).
enum class TransducerReduction { kSum, kMean };

// Backward: grad = grad_scale[0] * d(reduction of the losses) / d logits, in the logits' dtype,
// [B, T, U + 1, V]. For a row (b, t, u) inside the lengths, with gamma = exp(alpha + beta - logP),
//   grad[v] = scale * (softmax(z)[v] * gamma
//                      - [v == blank] exp(alpha[t,u] + lp[t,u,blank] + beta[t+1,u] - logP)
//                      - [v == y_{u+1}] exp(alpha[t,u] + lp[t,u,y_{u+1}] + beta[t,u+1] - logP))
// where beta[T_b, U_b] is 0 (the final blank); every other row is written with zeros.
// grad_scale is a device pointer (e.g. the dynamic loss scale), so a captured graph follows it.
// grad may be the logits buffer itself (in place: the gradient needs no second copy of the
// logits); otherwise the two must not overlap. Reads the workspace the forward filled.
void transducer_backward(void* grad, const TransducerInputs& in, const float* grad_scale,
                         TransducerReduction reduction, const TransducerShape& shape,
                         const void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay::rnnt
