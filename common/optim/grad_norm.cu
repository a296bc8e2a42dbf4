// grad_norm.cu: per-chunk fp64 sums of squares, then a single-block fixed-order reduction that
// writes the norm, the clip-and-unscale multiplier and the non-finite flag.
#include "common/optim/grad_norm.h"

#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // PackF32, block_sum_once

namespace replay {
namespace {

constexpr int kChunkThreads = 256;
constexpr int kFinalThreads = 1024;

__device__ void finish_norm(double acc, float* norm, float* grad_scale, int32_t* found_inf,
                            float max_norm, const float* loss_scale) {
  const double inv_scale = loss_scale != nullptr ? 1.0 / static_cast<double>(*loss_scale) : 1.0;
  const double total = sqrt(acc) * inv_scale;
  const double clip = max_norm > 0.0f ? fmin(1.0, max_norm / (total + 1e-6)) : 1.0;
  *norm = static_cast<float>(total);
  *grad_scale = static_cast<float>(clip * inv_scale);
  if (found_inf != nullptr && !isfinite(total)) *found_inf = 1;
}

__global__ void __launch_bounds__(kChunkThreads)
    grad_norm_chunks_kernel(double* __restrict__ partials, GradNormTable table) {
  __shared__ double scratch[32];
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const float* g = table.tensors[chunk.tensor].grad;
  const int64_t end = chunk.start + chunk.length;
  double acc = 0.0;
  for (int64_t i = chunk.start + 4 * threadIdx.x; i < end; i += 4 * kChunkThreads) {
    if (i + 4 <= end) {
      const PackF32 x = PackF32::load_cs(g + i);
      for (int k = 0; k < 4; ++k) acc += static_cast<double>(x.v[k]) * x.v[k];
    } else {
      for (int64_t j = i; j < end; ++j) acc += static_cast<double>(g[j]) * g[j];
    }
  }
  acc = block_sum_once(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// sumsq null: the norm and its scalars; otherwise only the sum of squares (a data-parallel rank's
// share, summed over the ranks before grad_norm_from_sumsq).
__global__ void __launch_bounds__(kFinalThreads)
    grad_norm_final_kernel(float* __restrict__ norm, float* __restrict__ grad_scale,
                           int32_t* __restrict__ found_inf, const double* __restrict__ partials,
                           int count, float max_norm, const float* __restrict__ loss_scale,
                           double* __restrict__ sumsq) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kFinalThreads) acc += partials[i];
  acc = block_sum_once(acc, scratch);
  if (threadIdx.x != 0) return;
  if (sumsq != nullptr) {
    *sumsq = acc;
    return;
  }
  finish_norm(acc, norm, grad_scale, found_inf, max_norm, loss_scale);
}

__global__ void grad_norm_from_sumsq_kernel(float* __restrict__ norm,
                                            float* __restrict__ grad_scale,
                                            int32_t* __restrict__ found_inf,
                                            const double* __restrict__ sumsq, float max_norm,
                                            const float* __restrict__ loss_scale) {
  finish_norm(*sumsq, norm, grad_scale, found_inf, max_norm, loss_scale);
}

}  // namespace

void GradNormTableBuilder::add(const float* grad, int64_t numel) {
  REPLAY_REQUIRE(grad != nullptr && reinterpret_cast<uintptr_t>(grad) % 16 == 0,
                 "gradient tensors must be non-null and 16-byte aligned");
  builder_.add(GradNormTensor{grad, numel});
}

size_t grad_norm_workspace_bytes(const GradNormTable& table) {
  return static_cast<size_t>(table.num_chunks) * sizeof(double);
}

void grad_norm(const GradNormTable& table, float max_norm, const float* loss_scale, float* norm,
               float* grad_scale, int32_t* found_inf, void* workspace, size_t workspace_bytes,
               cudaStream_t stream) {
  REPLAY_REQUIRE(table.tensors != nullptr && table.num_chunks > 0, "grad norm table not built");
  REPLAY_REQUIRE(norm != nullptr && grad_scale != nullptr, "grad norm outputs must be given");
  REPLAY_REQUIRE(workspace_bytes >= grad_norm_workspace_bytes(table),
                 "grad norm workspace too small: " + std::to_string(workspace_bytes) + " bytes");
  REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 8 == 0, "workspace not 8-byte aligned");
  auto* partials = static_cast<double*>(workspace);
  grad_norm_chunks_kernel<<<static_cast<unsigned>(table.num_chunks), kChunkThreads, 0, stream>>>(
      partials, table);
  REPLAY_LAUNCH_CHECK();
  grad_norm_final_kernel<<<1, kFinalThreads, 0, stream>>>(
      norm, grad_scale, found_inf, partials, table.num_chunks, max_norm, loss_scale, nullptr);
  REPLAY_LAUNCH_CHECK();
}

void grad_norm_sumsq(const GradNormTable& table, double* sumsq, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  REPLAY_REQUIRE(sumsq != nullptr, "grad_norm_sumsq: no output");
  REPLAY_REQUIRE(workspace_bytes >= grad_norm_workspace_bytes(table),
                 "grad norm workspace too small: " + std::to_string(workspace_bytes) + " bytes");
  if (table.num_chunks == 0) {  // a rank whose share holds no gradient
    REPLAY_CUDA_CHECK(cudaMemsetAsync(sumsq, 0, sizeof(double), stream));
    return;
  }
  auto* partials = static_cast<double*>(workspace);
  grad_norm_chunks_kernel<<<static_cast<unsigned>(table.num_chunks), kChunkThreads, 0, stream>>>(
      partials, table);
  REPLAY_LAUNCH_CHECK();
  grad_norm_final_kernel<<<1, kFinalThreads, 0, stream>>>(nullptr, nullptr, nullptr, partials,
                                                          table.num_chunks, 0.0f, nullptr, sumsq);
  REPLAY_LAUNCH_CHECK();
}

void grad_norm_from_sumsq(const double* sumsq, float max_norm, const float* loss_scale, float* norm,
                          float* grad_scale, int32_t* found_inf, cudaStream_t stream) {
  REPLAY_REQUIRE(sumsq != nullptr && norm != nullptr && grad_scale != nullptr,
                 "grad_norm_from_sumsq: null argument");
  grad_norm_from_sumsq_kernel<<<1, 1, 0, stream>>>(norm, grad_scale, found_inf, sumsq, max_norm,
                                                   loss_scale);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
