// transducer_reference.h: the fp64 CPU reference of the RNN-T loss (transducer.h): per-utterance
// losses and their gradient with respect to the logits, with the kernels' conventions (layout
// [B, T, U + 1, V], the blank a parameter, lengths and labels clamped, frame length 0 an empty
// slot).
#pragma once

#include <cstdint>

#include "workloads/rnnt/transducer.h"  // TransducerShape

namespace replay::rnnt::ref {

// loss [B]: -log P(y_b | x_b), 0 for empty slots. grad: null, or [B, T, U + 1, V] written with
// grad_scale * d(sum_b loss_b) / d logits (zeros past the lengths). Written from the lattice's
// definition, not from the kernels: log_softmax per row, alpha and beta in log space, and the
// gradient by the chain rule through the blank's and the labels' log-probabilities (the kernels
// use the occupancy form instead; the two agree in exact arithmetic). labels may be null when
// U == 0. Positions past the lengths are never read.
void transducer_loss(double* loss, double* grad, const double* logits, const int32_t* labels,
                     const int32_t* frame_lengths, const int32_t* label_lengths,
                     const TransducerShape& shape, double grad_scale = 1.0);

}  // namespace replay::rnnt::ref
