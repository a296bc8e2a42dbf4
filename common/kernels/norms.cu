// norms.cu: LayerNorm and RMSNorm forward and backward (see norms.h).
//
// Forward: one warp per row for C <= 1024 (eight rows per block), otherwise one block per row. A
// thread holds its slice of the row in registers as bf16 (up to 8 packs of 16 bytes), so x is read
// from memory once; mean and variance are two passes over registers (exact two-pass variance, no
// E[x^2] - E[x]^2).
//
// Backward: a persistent kernel, one block per SM (more for narrow rows). Each block walks rows
// blockIdx.x, blockIdx.x + gridDim.x, ... and every thread owns the same columns in every row, so
// the dgamma/dbeta contributions accumulate in registers and each block writes one partial row; a
// second kernel sums the partials in a fixed order. The rows are streamed through shared memory
// with cp.async, several rows ahead, so loads stay in flight while the block reduces and writes the
// current row.
#include "common/kernels/norms.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxRowThreads = 512;    // threads on one row (block mode)
constexpr int kMaxPacksPerThread = 8;  // 16-byte packs per thread: C <= 512 * 8 * 8
constexpr int kWarpRowMaxPacks = 128;  // warp-per-row forward up to C = 1024
constexpr int kWarpRowsPerBlock = 8;
constexpr size_t kBwdInflightBytes = 64 << 10;  // bytes of rows each SM keeps in flight (backward)
constexpr int kBwdMaxStages = 8;
static_assert(kMaxRowThreads * kMaxPacksPerThread * 8 == kNormMaxChannels, "limits disagree");

// Sum over the threads of one row: a warp (tpr == 32) or the whole block (tpr == blockDim.x).
__device__ __forceinline__ float row_sum(float v, int tpr, float* scratch) {
  return tpr == 32 ? warp_reduce_sum(v) : block_reduce_sum(v, scratch);
}

// Two sums over the block at once, fixed order. scratch holds 64 floats.
__device__ __forceinline__ float2 block_reduce_sum2(float2 v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v.x = warp_reduce_sum(v.x);
  v.y = warp_reduce_sum(v.y);
  __syncthreads();  // scratch may still be read by the previous call
  if (lane == 0) {
    scratch[warp] = v.x;
    scratch[32 + warp] = v.y;
  }
  __syncthreads();
  const float a = lane < warps ? scratch[lane] : 0.0f;
  const float b = lane < warps ? scratch[32 + lane] : 0.0f;
  return make_float2(warp_reduce_sum(a), warp_reduce_sum(b));
}

// ---------------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+). A thread only ever reads back the 16-byte chunks
// it copied itself, so waiting on its own groups suffices; the 4-byte row statistics are copied by
// one thread and published by the __syncthreads that follows the wait.

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `pending` of this thread's committed groups are still in flight. wait_group
// takes an immediate, hence the switch (pending is uniform across the block).
__device__ __forceinline__ void cp_async_wait(int pending) {
  switch (pending) {
    case 0:
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      break;
    case 1:
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      break;
    case 2:
      asm volatile("cp.async.wait_group 2;\n" ::: "memory");
      break;
    case 3:
      asm volatile("cp.async.wait_group 3;\n" ::: "memory");
      break;
    case 4:
      asm volatile("cp.async.wait_group 4;\n" ::: "memory");
      break;
    case 5:
      asm volatile("cp.async.wait_group 5;\n" ::: "memory");
      break;
    case 6:
      asm volatile("cp.async.wait_group 6;\n" ::: "memory");
      break;
    default:
      asm volatile("cp.async.wait_group 7;\n" ::: "memory");
      break;
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward. Thread t of a row owns packs t, t + tpr, ..., so a warp's loads are contiguous.

template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_forward_kernel(bf16* out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                        const bf16* x, const bf16* __restrict__ gamma,
                        const bf16* __restrict__ beta, int64_t rows, int C, int tpr, float eps) {
  __shared__ float scratch[32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / tpr) + threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  // Only whole warps leave here (warp mode); in block mode every block has a valid row.
  if (row >= rows) return;
  const int packs = C / 8;
  const bf16* xr = x + row * C;

  PackBF16 xv[kPpt];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * tpr;
    if (p < packs) {
      xv[i] = PackBF16::load_cs(xr + p * 8);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += __bfloat162float(xv[i].v[j]);
    }
  }
  const float mean = kLayerNorm ? row_sum(sum, tpr, scratch) / C : 0.0f;
  float sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (t + i * tpr < packs) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float d = __bfloat162float(xv[i].v[j]) - mean;
        sq += d * d;
      }
    }
  }
  const float rstd = rsqrtf(row_sum(sq, tpr, scratch) / C + eps);
  if (t == 0) {
    if (kLayerNorm) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  bf16* outr = out + row * C;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * tpr;
    if (p < packs) {
      const PackBF16 g = PackBF16::load(gamma + p * 8);
      PackBF16 b;
      if (kLayerNorm) b = PackBF16::load(beta + p * 8);
      PackBF16 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float y = (__bfloat162float(xv[i].v[j]) - mean) * rstd * __bfloat162float(g.v[j]);
        if (kLayerNorm) y += __bfloat162float(b.v[j]);
        o.v[j] = __float2bfloat16_rn(y);
      }
      o.store(outr + p * 8);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward. Shared memory holds `stages` row buffers; one stage is
//   [16 bytes: mean, rstd][x: packs x 16 B][dout: packs x 16 B][dx to accumulate into: packs x 16
//   B].
// Row k of the block (global row blockIdx.x + k * gridDim.x) lives in stage k % stages.

__host__ __device__ constexpr size_t bwd_stage_bytes(int C, bool accumulate_dx) {
  return 16 + static_cast<size_t>(accumulate_dx ? 3 : 2) * C * sizeof(bf16);
}

template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(kMaxRowThreads, 1)
    norm_backward_kernel(bf16* dx, float* __restrict__ partials, const bf16* dout, const bf16* x,
                         const bf16* __restrict__ gamma, const float* __restrict__ mean,
                         const float* __restrict__ rstd, int64_t rows, int C, int stages,
                         bool accumulate_dx) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[64];
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  const size_t stage_bytes = bwd_stage_bytes(C, accumulate_dx);

  // Starts the copy of the block's k-th row (if it exists) into its stage; always commits a group
  // so that group k belongs to row k.
  auto issue = [&](int64_t k) {
    const int64_t row = blockIdx.x + k * gridDim.x;
    if (row < rows) {
      unsigned char* st = smem + (k % stages) * stage_bytes;
      PackBF16* xs = reinterpret_cast<PackBF16*>(st + 16);
      PackBF16* dys = xs + packs;
      PackBF16* dxs = dys + packs;
      const int64_t base = row * C;
#pragma unroll
      for (int i = 0; i < kPpt; ++i) {
        const int p = t + i * T;
        if (p < packs) {
          cp_async_16(xs + p, x + base + p * 8);
          cp_async_16(dys + p, dout + base + p * 8);
          if (accumulate_dx) cp_async_16(dxs + p, dx + base + p * 8);
        }
      }
      float* stats = reinterpret_cast<float*>(st);
      if (t == 0) cp_async_4(stats + 1, rstd + row);
      if (kLayerNorm && t == 1) cp_async_4(stats, mean + row);
    }
    cp_async_commit();
  };

  PackBF16 g[kPpt];
  float dgamma[kPpt][8], dbeta[kPpt][8];
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (t + i * T < packs) g[i] = PackBF16::load(gamma + (t + i * T) * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) dgamma[i][j] = dbeta[i][j] = 0.0f;
  }

  for (int s = 0; s < stages - 1; ++s) issue(s);
  for (int64_t k = 0; blockIdx.x + k * gridDim.x < rows; ++k) {
    const int64_t row = blockIdx.x + k * gridDim.x;
    // Stage (k + stages - 1) % stages was last read in iteration k - 1: this thread's own chunks
    // are consumed (their values fed the dx store), and every thread read the statistics before
    // that iteration's block reduction, which this thread has passed.
    issue(k + stages - 1);
    cp_async_wait(stages - 1);
    __syncthreads();

    const unsigned char* st = smem + (k % stages) * stage_bytes;
    const float* stats = reinterpret_cast<const float*>(st);
    const PackBF16* xs = reinterpret_cast<const PackBF16*>(st + 16);
    const PackBF16* dys = xs + packs;
    const PackBF16* dxs = dys + packs;
    const float mu = kLayerNorm ? stats[0] : 0.0f;
    const float rs = stats[1];

    // Pass 1: the two row sums, and this row's share of the parameter gradients.
    float2 sums = make_float2(0.0f, 0.0f);  // sum(g), sum(g * xhat) with g = dout * gamma
#pragma unroll
    for (int i = 0; i < kPpt; ++i) {
      const int p = t + i * T;
      if (p < packs) {
        const PackBF16 xv = xs[p], dv = dys[p];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xhat = (__bfloat162float(xv.v[j]) - mu) * rs;
          const float dy = __bfloat162float(dv.v[j]);
          const float gj = dy * __bfloat162float(g[i].v[j]);
          sums.x += gj;
          sums.y += gj * xhat;
          dgamma[i][j] += dy * xhat;
          dbeta[i][j] += dy;
        }
      }
    }
    sums = block_reduce_sum2(sums, scratch);
    const float mean_g = kLayerNorm ? sums.x / C : 0.0f;
    const float mean_gx = sums.y / C;

    // Pass 2: dx.
    bf16* dxr = dx + row * C;
#pragma unroll
    for (int i = 0; i < kPpt; ++i) {
      const int p = t + i * T;
      if (p < packs) {
        const PackBF16 xv = xs[p], dv = dys[p];
        PackBF16 prev;
        if (accumulate_dx) prev = dxs[p];
        PackBF16 o;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xhat = (__bfloat162float(xv.v[j]) - mu) * rs;
          const float gj = __bfloat162float(dv.v[j]) * __bfloat162float(g[i].v[j]);
          float d = rs * (gj - mean_g - xhat * mean_gx);
          if (accumulate_dx) d += __bfloat162float(prev.v[j]);
          o.v[j] = __float2bfloat16_rn(d);
        }
        o.store(dxr + p * 8);
      }
    }
  }

  // This block's partial sums: partials[0][block][:] = dgamma, partials[1][block][:] = dbeta.
  float* pg = partials + static_cast<int64_t>(blockIdx.x) * C;
  float* pb = partials + static_cast<int64_t>(gridDim.x + blockIdx.x) * C;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * T;
    if (p < packs) {
      reinterpret_cast<float4*>(pg + p * 8)[0] =
          make_float4(dgamma[i][0], dgamma[i][1], dgamma[i][2], dgamma[i][3]);
      reinterpret_cast<float4*>(pg + p * 8)[1] =
          make_float4(dgamma[i][4], dgamma[i][5], dgamma[i][6], dgamma[i][7]);
      if (kLayerNorm) {
        reinterpret_cast<float4*>(pb + p * 8)[0] =
            make_float4(dbeta[i][0], dbeta[i][1], dbeta[i][2], dbeta[i][3]);
        reinterpret_cast<float4*>(pb + p * 8)[1] =
            make_float4(dbeta[i][4], dbeta[i][5], dbeta[i][6], dbeta[i][7]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void check_shape(int64_t rows, int C) {
  REPLAY_REQUIRE(rows >= 1 && rows <= INT32_MAX, "norm rows must be in [1, 2^31)");
  REPLAY_REQUIRE(C >= 8 && C % 8 == 0 && C <= kNormMaxChannels,
                 "norm width C must be a multiple of 8 in [8, 32768], got " + std::to_string(C));
}

// Smallest packs-per-thread in {1, 2, 4, 8} that keeps a row on at most kMaxRowThreads threads.
int packs_per_thread(int packs) {
  int ppt = 1;
  while (ceil_div(packs, ppt) > kMaxRowThreads) ppt *= 2;
  return ppt;
}

int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  REPLAY_CUDA_CHECK(cudaGetDevice(&device));
  REPLAY_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

struct BackwardPlan {
  int ppt, threads, blocks, stages;
  size_t smem;
};

// Threads cover the row with ppt packs each; narrow rows get several blocks per SM. The grid (and
// so the number of partial rows) depends only on the shape and the SM count, never on timing.
BackwardPlan plan_backward(int64_t rows, int C, bool accumulate_dx) {
  BackwardPlan plan{};
  const int packs = C / 8;
  plan.ppt = packs_per_thread(packs);
  plan.threads = ceil_div(ceil_div(packs, plan.ppt), 32) * 32;
  const int blocks_per_sm = std::max(1, kMaxRowThreads / plan.threads);
  plan.blocks = static_cast<int>(std::min<int64_t>(
      rows,
      static_cast<int64_t>(device_attribute(cudaDevAttrMultiProcessorCount)) * blocks_per_sm));

  // Enough stages to keep ~kBwdInflightBytes per SM in flight, within the shared memory of one SM.
  const size_t stage = bwd_stage_bytes(C, accumulate_dx);
  // (1 KiB is left for the kernel's static shared memory.)
  const size_t smem_per_block =
      (static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)) - 1024) /
      blocks_per_sm;
  REPLAY_REQUIRE(stage <= smem_per_block, "norm backward row does not fit in shared memory");
  plan.stages = static_cast<int>(1 + ceil_div(kBwdInflightBytes / blocks_per_sm, stage));
  plan.stages = std::min({plan.stages, kBwdMaxStages, static_cast<int>(smem_per_block / stage)});
  plan.smem = plan.stages * stage;
  return plan;
}

size_t backward_workspace_bytes(int64_t rows, int C, int outputs) {
  check_shape(rows, C);
  return static_cast<size_t>(outputs) * plan_backward(rows, C, false).blocks * C * sizeof(float);
}

template <bool kLayerNorm>
void norm_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* gamma,
                  const bf16* beta, int64_t rows, int C, float eps, cudaStream_t stream) {
  check_shape(rows, C);
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(gamma) && aligned16(beta),
                 "norm tensors must be 16-byte aligned");
  REPLAY_REQUIRE(rstd != nullptr && (!kLayerNorm || mean != nullptr), "norm statistics missing");
  const int packs = C / 8;
  int ppt, tpr, threads;
  int64_t blocks;
  if (packs <= kWarpRowMaxPacks) {  // one warp per row
    ppt = packs <= 32 ? 1 : packs <= 64 ? 2 : 4;
    tpr = 32;
    threads = 32 * kWarpRowsPerBlock;
    blocks = ceil_div<int64_t>(rows, kWarpRowsPerBlock);
  } else {  // one block per row
    ppt = packs_per_thread(packs);
    tpr = ceil_div(ceil_div(packs, ppt), 32) * 32;
    threads = tpr;
    blocks = rows;
  }
  auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(out, mean, rstd, x, gamma, beta,
                                                                  rows, C, tpr, eps);
    REPLAY_LAUNCH_CHECK();
  };
  switch (ppt) {
    case 1:
      launch(norm_forward_kernel<kLayerNorm, 1>);
      break;
    case 2:
      launch(norm_forward_kernel<kLayerNorm, 2>);
      break;
    case 4:
      launch(norm_forward_kernel<kLayerNorm, 4>);
      break;
    default:
      launch(norm_forward_kernel<kLayerNorm, 8>);
      break;
  }
}

template <bool kLayerNorm>
void norm_backward(bf16* dx, float* dgamma, float* dbeta, const bf16* dout, const bf16* x,
                   const bf16* gamma, const float* mean, const float* rstd, int64_t rows, int C,
                   bool accumulate_dx, bool accumulate_param_grads, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  check_shape(rows, C);
  REPLAY_REQUIRE(
      aligned16(dx) && aligned16(dout) && aligned16(x) && aligned16(gamma) && aligned16(workspace),
      "norm backward tensors and workspace must be 16-byte aligned");
  REPLAY_REQUIRE(rstd != nullptr && dgamma != nullptr &&
                     (!kLayerNorm || (mean != nullptr && dbeta != nullptr)),
                 "norm backward input or output missing");
  constexpr int kOutputs = kLayerNorm ? 2 : 1;
  const BackwardPlan plan = plan_backward(rows, C, accumulate_dx);
  const size_t needed = static_cast<size_t>(kOutputs) * plan.blocks * C * sizeof(float);
  REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= needed,
                 "norm backward workspace too small: " + std::to_string(workspace_bytes) + " < " +
                     std::to_string(needed));
  float* partials = static_cast<float*>(workspace);

  auto launch = [&](auto kernel) {
    REPLAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(plan.smem)));
    kernel<<<plan.blocks, plan.threads, plan.smem, stream>>>(
        dx, partials, dout, x, gamma, mean, rstd, rows, C, plan.stages, accumulate_dx);
    REPLAY_LAUNCH_CHECK();
  };
  switch (plan.ppt) {
    case 1:
      launch(norm_backward_kernel<kLayerNorm, 1>);
      break;
    case 2:
      launch(norm_backward_kernel<kLayerNorm, 2>);
      break;
    case 4:
      launch(norm_backward_kernel<kLayerNorm, 4>);
      break;
    default:
      launch(norm_backward_kernel<kLayerNorm, 8>);
      break;
  }
  column_sums<kOutputs>(dgamma, dbeta, partials, plan.blocks, C, accumulate_param_grads, stream);
}

}  // namespace

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* gamma,
                       const bf16* beta, int64_t rows, int C, float eps, cudaStream_t stream) {
  norm_forward<true>(out, mean, rstd, x, gamma, beta, rows, C, eps, stream);
}

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* gamma, int64_t rows, int C,
                     float eps, cudaStream_t stream) {
  norm_forward<false>(out, nullptr, rstd, x, gamma, nullptr, rows, C, eps, stream);
}

size_t layernorm_backward_workspace_bytes(int64_t rows, int C) {
  return backward_workspace_bytes(rows, C, 2);
}

size_t rmsnorm_backward_workspace_bytes(int64_t rows, int C) {
  return backward_workspace_bytes(rows, C, 1);
}

void layernorm_backward(bf16* dx, float* dgamma, float* dbeta, const bf16* dout, const bf16* x,
                        const bf16* gamma, const float* mean, const float* rstd, int64_t rows,
                        int C, bool accumulate_dx, bool accumulate_param_grads, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  norm_backward<true>(dx, dgamma, dbeta, dout, x, gamma, mean, rstd, rows, C, accumulate_dx,
                      accumulate_param_grads, workspace, workspace_bytes, stream);
}

void rmsnorm_backward(bf16* dx, float* dgamma, const bf16* dout, const bf16* x, const bf16* gamma,
                      const float* rstd, int64_t rows, int C, bool accumulate_dx,
                      bool accumulate_param_grads, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  norm_backward<false>(dx, dgamma, nullptr, dout, x, gamma, nullptr, rstd, rows, C, accumulate_dx,
                       accumulate_param_grads, workspace, workspace_bytes, stream);
}

}  // namespace replay
