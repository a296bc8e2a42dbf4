// norms.cu: LayerNorm and RMSNorm forward and backward (see norms.h).
//
// Narrow rows (C <= 1024), forward: one warp per row, eight rows per block, the row held in
// registers.
//
// Wide rows, forward and backward: a persistent grid (as many blocks as fit on the SMs at once)
// walks the rows: block b takes rows b, b + gridDim.x, ... and thread t owns the 16-byte packs
// t, t + T, ... of every row. Rows are streamed into a ring of shared-memory stages with cp.async,
// `stages - 1` rows ahead, so every SM keeps loads in flight while it reduces and writes the
// current row. Little's law sets the depth: at ~4 TB/s and ~1-2 us of loaded latency the GPU
// needs several MB in flight, tens of KB per SM, which a row-at-a-time block cannot supply (the
// 2048 x 12288 GPT-3 LayerNorm: 24 KB rows). A thread reads back only the packs it copied itself,
// so the ring needs no barrier; the only barriers are the row reductions'. Mean and variance are
// two exact passes over the row in registers (no E[x^2] - E[x]^2).
//
// Backward: every thread owns the same columns in every row, so the dgamma/dbeta contributions
// accumulate in registers and each block writes one partial row; column_sums then adds the
// partials in a fixed order, as a programmatic dependent launch. The accumulators cost registers
// (2 * C / T per thread for LayerNorm), so the backward runs one block of up to 768 threads per
// SM: 24 warps give the per-row arithmetic enough parallelism to hide under the memory stream.
#include "common/kernels/norms.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxRowThreads = 512;    // threads on one row, forward
constexpr int kMaxPacksPerThread = 8;  // 16-byte packs per thread: C <= 512 * 8 * 8
constexpr int kWarpRowMaxPacks = 128;  // warp-per-row forward up to C = 1024
constexpr int kWarpRowsPerBlock = 8;
constexpr size_t kInflightBytesPerSM = 96 << 10;  // rows each SM keeps in flight (ring depth)
constexpr int kMaxStages = 8;
constexpr int kMaxDevices = 64;
static_assert(kMaxRowThreads * kMaxPacksPerThread * 8 == kNormMaxChannels, "limits disagree");

// Backward threads per row: up to 768 while a thread holds at most two packs (32 LayerNorm
// accumulators fit the 85 registers a 768-thread block may use), 512 beyond.
__host__ __device__ constexpr int bwd_max_threads(int ppt) {
  return ppt <= 2 ? 768 : 512;
}

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
// it copied itself, so waiting on its own groups suffices.

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
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

// The ring: `stages` slots, each holding one row of each of the first n of the tensors in src
// (tensor i at pack offset i * packs). ring_issue(k) starts copying the block's k-th row (global
// row blockIdx.x + k * gridDim.x, if it exists) into slot k % stages; it always commits a group,
// so that group k belongs to row k. A slot is refilled one iteration after it was read, by the
// same threads that read it, and their reads have completed: their values were used.
template <int kPpt, int kMaxTensors>
__device__ __forceinline__ void ring_issue(PackBF16* ring, int stages, int64_t k, int64_t rows,
                                           int C, const bf16* const (&src)[kMaxTensors], int n) {
  const int64_t row = blockIdx.x + k * gridDim.x;
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  if (row < rows) {
    PackBF16* slot = ring + (k % stages) * n * packs;
#pragma unroll
    for (int s = 0; s < kMaxTensors; ++s) {
      if (s < n) {
#pragma unroll
        for (int i = 0; i < kPpt; ++i) {
          const int p = t + i * T;
          if (p < packs) cp_async_16(slot + s * packs + p, src[s] + row * C + p * 8);
        }
      }
    }
  }
  cp_async_commit();
}

// ---------------------------------------------------------------------------------------------------
// Forward. Thread t of a row owns packs t, t + tpr, ..., so a warp's accesses are contiguous.

// Statistics and output of one row whose packs this thread holds in xv.
template <bool kLayerNorm, int kPpt>
__device__ __forceinline__ void normalize_row(bf16* out, float* mean_out, float* rstd_out,
                                              const PackBF16 (&xv)[kPpt],
                                              const bf16* __restrict__ gamma,
                                              const bf16* __restrict__ beta, int64_t row, int C,
                                              int t, int tpr, float eps, float* scratch) {
  const int packs = C / 8;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (t + i * tpr < packs) {
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

  // gamma and beta are re-read for every row: they stay in L1, and holding them in registers
  // would cost the occupancy that keeps the ring's loads in flight.
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

// Narrow rows: one warp per row, loaded straight into registers.
template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(32 * kWarpRowsPerBlock)
    norm_forward_warp_kernel(bf16* out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                             const bf16* x, const bf16* __restrict__ gamma,
                             const bf16* __restrict__ beta, int64_t rows, int C, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / 32;
  const int t = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps only
  const int packs = C / 8;
  PackBF16 xv[kPpt];
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * 32;
    if (p < packs) xv[i] = PackBF16::load_cs(x + row * C + p * 8);
  }
  normalize_row<kLayerNorm, kPpt>(out, mean_out, rstd_out, xv, gamma, beta, row, C, t, 32, eps,
                                  nullptr);
}

// Wide rows: the persistent ring (see the top of the file); one row per block at a time.
template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_forward_rows_kernel(bf16* out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                             const bf16* x, const bf16* __restrict__ gamma,
                             const bf16* __restrict__ beta, int64_t rows, int C, int stages,
                             float eps) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[32];
  PackBF16* ring = reinterpret_cast<PackBF16*>(smem);
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  const bf16* const src[1] = {x};  // out may alias x: a row is written only after it is read

  for (int s = 0; s < stages - 1; ++s) ring_issue<kPpt>(ring, stages, s, rows, C, src, 1);
  int64_t row = blockIdx.x;
  for (int64_t k = 0; row < rows; ++k, row += gridDim.x) {
    ring_issue<kPpt>(ring, stages, k + stages - 1, rows, C, src, 1);
    cp_async_wait(stages - 1);  // row k has landed
    const PackBF16* slot = ring + (k % stages) * packs;
    PackBF16 xv[kPpt];
#pragma unroll
    for (int i = 0; i < kPpt; ++i)
      if (t + i * T < packs) xv[i] = slot[t + i * T];
    normalize_row<kLayerNorm, kPpt>(out, mean_out, rstd_out, xv, gamma, beta, row, C, t, T, eps,
                                    scratch);
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward. A ring slot holds the row's x, dout and (accumulate_dx) the dx to add to, in that
// order; mean and rstd are read by every thread straight from global memory (one broadcast load,
// issued before the wait so that its latency hides under it).

template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(bwd_max_threads(kPpt), 1)
    norm_backward_kernel(bf16* dx, float* __restrict__ partials, const bf16* dout, const bf16* x,
                         const bf16* __restrict__ gamma, const float* __restrict__ mean,
                         const float* __restrict__ rstd, int64_t rows, int C, int stages,
                         bool accumulate_dx) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[64];
  allow_dependent_launch();  // column_sums may be placed while this grid runs
  PackBF16* ring = reinterpret_cast<PackBF16*>(smem);
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  const int tensors = accumulate_dx ? 3 : 2;
  const bf16* const src[3] = {x, dout, dx};

  PackBF16 g[kPpt];
  float dgamma[kPpt][8], dbeta[kPpt][8];
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (t + i * T < packs) g[i] = PackBF16::load(gamma + (t + i * T) * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) dgamma[i][j] = dbeta[i][j] = 0.0f;
  }

  for (int s = 0; s < stages - 1; ++s) ring_issue<kPpt>(ring, stages, s, rows, C, src, tensors);
  int64_t row = blockIdx.x;
  for (int64_t k = 0; row < rows; ++k, row += gridDim.x) {
    ring_issue<kPpt>(ring, stages, k + stages - 1, rows, C, src, tensors);
    const float mu = kLayerNorm ? mean[row] : 0.0f;
    const float rs = rstd[row];
    cp_async_wait(stages - 1);  // row k has landed
    const PackBF16* xs = ring + (k % stages) * tensors * packs;
    const PackBF16* dys = xs + packs;
    const PackBF16* dxs = dys + packs;

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

// Smallest packs-per-thread in {1, 2, 4, 8} that keeps a row on at most max_threads(ppt) threads.
template <typename MaxThreads>
int packs_per_thread(int packs, MaxThreads max_threads) {
  int ppt = 1;
  while (ceil_div(packs, ppt) > max_threads(ppt)) ppt *= 2;
  return ppt;
}

// Calls f(std::integral_constant<int, ppt>) for a run-time ppt in {1, 2, 4, 8}, ppt <= kMaxPpt.
template <int kMaxPpt = kMaxPacksPerThread, typename F>
decltype(auto) with_ppt(int ppt, F&& f) {
  if constexpr (kMaxPpt > 1) {
    if (ppt > kMaxPpt / 2) return f(std::integral_constant<int, kMaxPpt>{});
    return with_ppt<kMaxPpt / 2>(ppt, f);
  } else {
    return f(std::integral_constant<int, 1>{});
  }
}

int current_device() {
  int device = 0;
  REPLAY_CUDA_CHECK(cudaGetDevice(&device));
  REPLAY_REQUIRE(device < kMaxDevices, "norms support device ordinals below 64");
  return device;
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  REPLAY_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// Lets `kernel` use the device's whole opt-in shared memory, once per device: set-up that stays
// out of the launch path (and out of graph capture). Each kernel instantiation owns its flags.
template <typename Kernel>
void allow_large_smem(Kernel kernel, std::once_flag (&done)[kMaxDevices], int device) {
  std::call_once(done[device], [&] {
    cudaFuncAttributes attr{};
    REPLAY_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    REPLAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           optin - static_cast<int>(attr.sharedSizeBytes)));
  });
}

template <bool kLayerNorm, int kPpt>
auto forward_rows_kernel(int device) {
  static std::once_flag done[kMaxDevices];
  allow_large_smem(norm_forward_rows_kernel<kLayerNorm, kPpt>, done, device);
  return norm_forward_rows_kernel<kLayerNorm, kPpt>;
}

template <bool kLayerNorm, int kPpt>
auto backward_kernel(int device) {
  static std::once_flag done[kMaxDevices];
  allow_large_smem(norm_backward_kernel<kLayerNorm, kPpt>, done, device);
  return norm_backward_kernel<kLayerNorm, kPpt>;
}

// Launch shape of a ring kernel: `threads` per block, `blocks_per_sm` resident blocks on every SM
// (the grid is one wave of them), `stages` ring slots of slot_bytes each.
struct RingPlan {
  int ppt = 0, threads = 0, blocks_per_sm = 0, blocks = 0, stages = 0;
  size_t smem = 0;
};

// As many blocks per SM as registers and threads allow, each with enough slots to keep
// kInflightBytesPerSM in flight across the SM, within its share of the SM's shared memory; fewer
// blocks per SM when that is what gives each block two slots (a prefetched row). `sizing_bytes`
// sizes the blocks per SM (the grid, hence the backward's workspace, must not depend on
// accumulate_dx); `slot_bytes` is the slot actually used. Depends only on the shape and the
// device, never on timing.
template <typename Kernel>
RingPlan plan_ring(Kernel kernel, int device, int64_t rows, int ppt, int threads,
                   size_t sizing_bytes, size_t slot_bytes) {
  RingPlan plan;
  plan.ppt = ppt;
  plan.threads = threads;
  int by_registers = 0;
  REPLAY_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&by_registers, kernel, threads, 0));
  REPLAY_REQUIRE(by_registers >= 1, "norm kernel does not fit on an SM");
  cudaFuncAttributes attr{};
  REPLAY_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  // A block takes its dynamic and static shared memory plus the system's reservation.
  const int64_t per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  const int64_t overhead = device_attribute(cudaDevAttrReservedSharedMemoryPerBlock, device) +
                           static_cast<int64_t>(attr.sharedSizeBytes);
  auto budget = [&](int b) {
    return std::max<int64_t>(
        0, std::min<int64_t>(attr.maxDynamicSharedSizeBytes, per_sm / b - overhead));
  };
  auto slots = [&](int b, size_t bytes) {
    const size_t want = 1 + ceil_div(kInflightBytesPerSM, b * bytes);
    return static_cast<int>(
        std::min({want, static_cast<size_t>(kMaxStages), static_cast<size_t>(budget(b)) / bytes}));
  };
  int b = by_registers;
  while (b > 1 && slots(b, sizing_bytes) < 2) --b;
  plan.blocks_per_sm = b;
  plan.stages = slots(b, slot_bytes);
  REPLAY_REQUIRE(plan.stages >= 1, "norm row does not fit in shared memory");
  plan.smem = plan.stages * slot_bytes;
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  plan.blocks = static_cast<int>(std::min<int64_t>(rows, sms * b));
  return plan;
}

template <bool kLayerNorm>
RingPlan plan_backward(int device, int64_t rows, int C, bool accumulate_dx) {
  const int packs = C / 8;
  const int ppt = packs_per_thread(packs, bwd_max_threads);
  const int threads = ceil_div(ceil_div(packs, ppt), 32) * 32;
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(bf16);
  return with_ppt(ppt, [&](auto P) {
    return plan_ring(backward_kernel<kLayerNorm, P.value>(device), device, rows, ppt, threads,
                     2 * row_bytes, (accumulate_dx ? 3 : 2) * row_bytes);
  });
}

template <bool kLayerNorm>
size_t backward_workspace_bytes(int64_t rows, int C) {
  check_shape(rows, C);
  const RingPlan plan = plan_backward<kLayerNorm>(current_device(), rows, C, false);
  return static_cast<size_t>(kLayerNorm ? 2 : 1) * plan.blocks * C * sizeof(float);
}

template <bool kLayerNorm>
void norm_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* gamma,
                  const bf16* beta, int64_t rows, int C, float eps, cudaStream_t stream) {
  check_shape(rows, C);
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(gamma) && aligned16(beta),
                 "norm tensors must be 16-byte aligned");
  REPLAY_REQUIRE(rstd != nullptr && (!kLayerNorm || mean != nullptr), "norm statistics missing");
  const int packs = C / 8;
  if (packs <= kWarpRowMaxPacks) {  // one warp per row
    const int ppt = packs <= 32 ? 1 : packs <= 64 ? 2 : 4;
    const int64_t blocks = ceil_div<int64_t>(rows, kWarpRowsPerBlock);
    with_ppt<4>(ppt, [&](auto P) {
      norm_forward_warp_kernel<kLayerNorm, P.value>
          <<<static_cast<unsigned>(blocks), 32 * kWarpRowsPerBlock, 0, stream>>>(
              out, mean, rstd, x, gamma, beta, rows, C, eps);
      REPLAY_LAUNCH_CHECK();
    });
    return;
  }
  // One block per row at a time, a ring of rows in flight per block.
  const int device = current_device();
  const int ppt = packs_per_thread(packs, [](int) { return kMaxRowThreads; });
  const int threads = ceil_div(ceil_div(packs, ppt), 32) * 32;
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(bf16);
  with_ppt(ppt, [&](auto P) {
    const auto kernel = forward_rows_kernel<kLayerNorm, P.value>(device);
    const RingPlan plan = plan_ring(kernel, device, rows, ppt, threads, row_bytes, row_bytes);
    kernel<<<plan.blocks, plan.threads, plan.smem, stream>>>(out, mean, rstd, x, gamma, beta, rows,
                                                             C, plan.stages, eps);
    REPLAY_LAUNCH_CHECK();
  });
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
  const int device = current_device();
  const RingPlan plan = plan_backward<kLayerNorm>(device, rows, C, accumulate_dx);
  const size_t needed = static_cast<size_t>(kOutputs) * plan.blocks * C * sizeof(float);
  REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= needed,
                 "norm backward workspace too small: " + std::to_string(workspace_bytes) + " < " +
                     std::to_string(needed));
  float* partials = static_cast<float*>(workspace);
  with_ppt(plan.ppt, [&](auto P) {
    backward_kernel<kLayerNorm, P.value>(device)<<<plan.blocks, plan.threads, plan.smem, stream>>>(
        dx, partials, dout, x, gamma, mean, rstd, rows, C, plan.stages, accumulate_dx);
    REPLAY_LAUNCH_CHECK();
  });
  column_sums(kOutputs, dgamma, dbeta, partials, plan.blocks, C, accumulate_param_grads, stream);
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
  return backward_workspace_bytes<true>(rows, C);
}

size_t rmsnorm_backward_workspace_bytes(int64_t rows, int C) {
  return backward_workspace_bytes<false>(rows, C);
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
