// lamb.h: LAMB (You et al. 2019, as NVIDIA's apex FusedLAMB that MLPerf RNN-T trains with) over the
// same multi-tensor table as AdamW (adamw.h): Adam moments, then a per-tensor trust ratio that
// scales each tensor's step by ||w|| / ||update||. Step, learning rate, gradient scale and the skip
// flag are read on the device, so the update can live inside a CUDA graph; the per-tensor norms are
// fixed-order reductions (per-chunk partial sums, then each tensor's chunks summed in order), so
// the result is bit-reproducible.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/optim/adamw.h"  // AdamWTable: the same entries serve LAMB

namespace replay {

// Constants of a run. MLPerf RNN-T: beta1 0.9, beta2 0.999, eps 1e-9, weight decay 1e-3.
struct LambHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-9f;
  float weight_decay = 1e-3f;
};

// Workspace bytes lamb_step needs for a table of `chunks` chunks and `tensors` tensors (per-chunk
// partial sums and per-tensor ratios), and an upper bound from the parameter count alone (for an
// arena plan made before the table exists).
size_t lamb_workspace_bytes(int64_t chunks, int64_t tensors);
size_t lamb_workspace_bound(int64_t total_numel, int64_t tensors);

// One LAMB step over the table. For every tensor, with g = grad * grad_scale[0], t = step[0]:
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd w     (wd where the tensor
//                                                                          applies weight decay)
//   r = ||w|| / ||u|| when both norms are positive, else 1 (fp32 norms over the tensor)
//   w -= lr r u;   model = bf16(w), fp16(w) or w
// noop: int32 device flag, or null; when non-zero nothing is touched. Three launches: moments and
// partial norms, ratios, update.
void lamb_step(const AdamWTable& table, const LambHyper& hyper, const float* lr,
               const int64_t* step, const float* grad_scale, const int32_t* noop, void* workspace,
               size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay
