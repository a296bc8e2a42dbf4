// layer_norm.cu: LayerNorm over rows in fp16 or bf16 (layer_norm.h).
//
// A lane owns packs lane, lane + 32, ... of its warp's row (16 bytes: 8 values each), so a warp's
// accesses are contiguous; kPacks = ceil(C / 8 / 32) packs a lane at most (2 at C = 320, 3 at 640,
// 5 at 1280), a template parameter so that a lane's values and sums stay in registers.
#include "workloads/unet/layer_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"
#include "common/kernels/dependent_launch.cuh"
#include "workloads/unet/half_pairs.cuh"

namespace replay::unet {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kPack = 8;   // 16-bit values in 16 bytes
constexpr int kWarps = 8;  // warps (rows at a time) a block
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxPacks = kLayerNormMaxChannels / kPack / 32;
// The backward's grid: a warp takes at least kMinRowsPerWarp rows (its dgamma and dbeta sums are
// written once per block, not per row), and at most kMaxBackwardBlocks blocks (4 an SM on an H100's
// 132 SMs; a fixed number, so that the sums' order is the shape's alone).
constexpr int kMinRowsPerWarp = 4;
constexpr int kMaxBackwardBlocks = 528;
static_assert(kMaxPacks == 6, "limits disagree");

template <typename T>
__device__ __forceinline__ void to_floats(const uint4& v, float (&f)[kPack]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = to_float2<T>(w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 to_pack(const float (&f)[kPack]) {
  return make_uint4(to_word<T>(f[0], f[1]), to_word<T>(f[2], f[3]), to_word<T>(f[4], f[5]),
                    to_word<T>(f[6], f[7]));
}

template <typename T, int kPacks>
__global__ void __launch_bounds__(kThreads)
    ln_forward_kernel(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                      const T* __restrict__ x, const T* __restrict__ gamma,
                      const T* __restrict__ beta, int rows, int packs, float inv_c, float eps) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + static_cast<int64_t>(row) * packs;
  uint4 v[kPacks];
#pragma unroll
  for (int i = 0; i < kPacks; ++i)
    if (lane + 32 * i < packs) v[i] = __ldcs(xr + lane + 32 * i);
  float s = 0;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    if (lane + 32 * i >= packs) continue;
    float f[kPack];
    to_floats<T>(v[i], f);
#pragma unroll
    for (int j = 0; j < kPack; ++j) s += f[j];
  }
  const float mu = warp_reduce_sum(s) * inv_c;
  float q = 0;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    if (lane + 32 * i >= packs) continue;
    float f[kPack];
    to_floats<T>(v[i], f);
#pragma unroll
    for (int j = 0; j < kPack; ++j) q += (f[j] - mu) * (f[j] - mu);
  }
  const float rs = rsqrtf(warp_reduce_sum(q) * inv_c + eps);
  uint4* yr = reinterpret_cast<uint4*>(out) + static_cast<int64_t>(row) * packs;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int p = lane + 32 * i;
    if (p >= packs) continue;
    float f[kPack], g[kPack], b[kPack];
    to_floats<T>(v[i], f);
    to_floats<T>(__ldg(reinterpret_cast<const uint4*>(gamma) + p), g);
    to_floats<T>(__ldg(reinterpret_cast<const uint4*>(beta) + p), b);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float a = rs * g[j];
      f[j] = f[j] * a + (b[j] - mu * a);
    }
    __stcs(yr + p, to_pack<T>(f));
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// partials: [2][gridDim.x][C] (dgamma's rows, then dbeta's).
template <typename T, int kPacks>
__global__ void __launch_bounds__(kThreads)
    ln_backward_kernel(T* dx, float* __restrict__ partials, const T* dout, const T* __restrict__ x,
                       const T* __restrict__ gamma, const float* __restrict__ mean,
                       const float* __restrict__ rstd, int rows, int packs, int C, float inv_c,
                       bool accumulate_dx) {
  __shared__ float sums[2][kLayerNormMaxChannels];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float dg[kPacks][kPack], db[kPacks][kPack];
  uint4 gm[kPacks];
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    if (lane + 32 * i < packs) gm[i] = __ldg(reinterpret_cast<const uint4*>(gamma) + lane + 32 * i);
#pragma unroll
    for (int j = 0; j < kPack; ++j) dg[i][j] = db[i][j] = 0;
  }
  for (int row = blockIdx.x * kWarps + warp; row < rows; row += gridDim.x * kWarps) {
    const int64_t base = static_cast<int64_t>(row) * packs;
    const uint4* xr = reinterpret_cast<const uint4*>(x) + base;
    const uint4* dr = reinterpret_cast<const uint4*>(dout) + base;
    uint4 xv[kPacks], dv[kPacks];
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      if (lane + 32 * i >= packs) continue;
      xv[i] = __ldcs(xr + lane + 32 * i);
      dv[i] = __ldcs(dr + lane + 32 * i);
    }
    const float mu = mean[row], rs = rstd[row];
    float s1 = 0, s2 = 0;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      if (lane + 32 * i >= packs) continue;
      float fx[kPack], fd[kPack], fg[kPack];
      to_floats<T>(xv[i], fx);
      to_floats<T>(dv[i], fd);
      to_floats<T>(gm[i], fg);
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float xh = (fx[j] - mu) * rs, g = fd[j] * fg[j];
        s1 += g;
        s2 += g * xh;
        dg[i][j] += fd[j] * xh;
        db[i][j] += fd[j];
      }
    }
    const float m1 = warp_reduce_sum(s1) * inv_c, m2 = warp_reduce_sum(s2) * inv_c;
    uint4* xo = reinterpret_cast<uint4*>(dx) + base;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int p = lane + 32 * i;
      if (p >= packs) continue;
      float fx[kPack], fd[kPack], fg[kPack], old[kPack];
      to_floats<T>(xv[i], fx);
      to_floats<T>(dv[i], fd);
      to_floats<T>(gm[i], fg);
      if (accumulate_dx) to_floats<T>(xo[p], old);
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float xh = (fx[j] - mu) * rs;
        fx[j] = rs * (fd[j] * fg[j] - m1 - xh * m2);
        if (accumulate_dx) fx[j] += old[j];
      }
      xo[p] = to_pack<T>(fx);
    }
  }
  // The block's sums, warp after warp (a fixed order), then one partial row of each.
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < kPacks; ++i) {
        const int p = lane + 32 * i;
        if (p >= packs) continue;
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
          const int c = p * kPack + j;
          sums[0][c] = w == 0 ? dg[i][j] : sums[0][c] + dg[i][j];
          sums[1][c] = w == 0 ? db[i][j] : sums[1][c] + db[i][j];
        }
      }
    }
    __syncthreads();
  }
  float* row0 = partials + static_cast<int64_t>(blockIdx.x) * C;
  float* row1 = partials + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += kThreads) {
    row0[c] = sums[0][c];
    row1[c] = sums[1][c];
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

std::string describe(int64_t rows, int C) {
  return " (LayerNorm rows=" + std::to_string(rows) + " C=" + std::to_string(C) + ")";
}

// Calls f(T{}, kPacks constant) with T the storage type of dtype.
template <typename F>
void dispatch(DType dtype, int packs_per_lane, F&& f) {
  auto by_packs = [&](auto tag) {
    switch (packs_per_lane) {
      case 1:
        return f(tag, std::integral_constant<int, 1>{});
      case 2:
        return f(tag, std::integral_constant<int, 2>{});
      case 3:
        return f(tag, std::integral_constant<int, 3>{});
      case 4:
        return f(tag, std::integral_constant<int, 4>{});
      case 5:
        return f(tag, std::integral_constant<int, 5>{});
      default:
        return f(tag, std::integral_constant<int, 6>{});
    }
  };
  if (dtype == DType::kFP16) return by_packs(__half{});
  if (dtype == DType::kBF16) return by_packs(bf16{});
  REPLAY_REQUIRE(false,
                 std::string("LayerNorm takes fp16 or bf16 storage, got ") + dtype_name(dtype));
}

}  // namespace

void check_layer_norm_shape(int64_t rows, int C) {
  REPLAY_REQUIRE(rows >= 1 && rows <= INT32_MAX,
                 "LayerNorm needs 1 <= rows < 2^31" + describe(rows, C));
  REPLAY_REQUIRE(C >= kPack && C % kPack == 0 && C <= kLayerNormMaxChannels,
                 "LayerNorm needs C a multiple of 8 in [8, " +
                     std::to_string(kLayerNormMaxChannels) + "]" + describe(rows, C));
}

int layer_norm_backward_blocks(int64_t rows) {
  return static_cast<int>(
      std::min<int64_t>(ceil_div<int64_t>(rows, kWarps * kMinRowsPerWarp), kMaxBackwardBlocks));
}

size_t layer_norm_backward_workspace_bytes(int64_t rows, int C) {
  check_layer_norm_shape(rows, C);
  return 2 * static_cast<size_t>(layer_norm_backward_blocks(rows)) * static_cast<size_t>(C) *
         sizeof(float);
}

void layer_norm_forward(DType dtype, void* out, float* mean, float* rstd, const void* x,
                        const void* gamma, const void* beta, int64_t rows, int C, float eps,
                        cudaStream_t stream) {
  check_layer_norm_shape(rows, C);
  REPLAY_REQUIRE(
      out != nullptr && x != nullptr && gamma != nullptr && beta != nullptr && aligned16(out) &&
          aligned16(x) && aligned16(gamma) && aligned16(beta),
      "LayerNorm forward tensors must be non-null and 16-byte aligned" + describe(rows, C));
  REPLAY_REQUIRE(mean != nullptr && rstd != nullptr, "LayerNorm forward statistics missing");
  const int packs = C / kPack;
  const auto grid = static_cast<unsigned>(ceil_div<int64_t>(rows, kWarps));
  dispatch(dtype, ceil_div(packs, 32), [&](auto tag, auto k) {
    using T = decltype(tag);
    launch_dependent(ln_forward_kernel<T, decltype(k)::value>, dim3(grid), dim3(kThreads), stream,
                     static_cast<T*>(out), mean, rstd, static_cast<const T*>(x),
                     static_cast<const T*>(gamma), static_cast<const T*>(beta),
                     static_cast<int>(rows), packs, 1.0f / static_cast<float>(C), eps);
    REPLAY_LAUNCH_CHECK();
  });
}

void layer_norm_backward(DType dtype, void* dx, float* dgamma, float* dbeta, const void* dout,
                         const void* x, const void* gamma, const float* mean, const float* rstd,
                         int64_t rows, int C, bool accumulate_dx, bool accumulate_param_grads,
                         void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_layer_norm_shape(rows, C);
  REPLAY_REQUIRE(
      dx != nullptr && dout != nullptr && x != nullptr && gamma != nullptr && aligned16(dx) &&
          aligned16(dout) && aligned16(x) && aligned16(gamma),
      "LayerNorm backward tensors must be non-null and 16-byte aligned" + describe(rows, C));
  REPLAY_REQUIRE(mean != nullptr && rstd != nullptr && dgamma != nullptr && dbeta != nullptr,
                 "LayerNorm backward statistics or parameter gradients missing");
  REPLAY_REQUIRE(!accumulate_dx || dx != dout, "LayerNorm backward: dx aliases dout while adding");
  const size_t need = layer_norm_backward_workspace_bytes(rows, C);
  REPLAY_REQUIRE(workspace != nullptr && aligned16(workspace),
                 "LayerNorm backward: the workspace must be 16-byte aligned");
  REPLAY_REQUIRE(workspace_bytes >= need,
                 "LayerNorm backward workspace too small: " + std::to_string(workspace_bytes) +
                     " < " + std::to_string(need));
  const int packs = C / kPack, blocks = layer_norm_backward_blocks(rows);
  auto* partials = static_cast<float*>(workspace);
  dispatch(dtype, ceil_div(packs, 32), [&](auto tag, auto k) {
    using T = decltype(tag);
    launch_dependent(ln_backward_kernel<T, decltype(k)::value>, dim3(blocks), dim3(kThreads),
                     stream, static_cast<T*>(dx), partials, static_cast<const T*>(dout),
                     static_cast<const T*>(x), static_cast<const T*>(gamma), mean, rstd,
                     static_cast<int>(rows), packs, C, 1.0f / static_cast<float>(C), accumulate_dx);
    REPLAY_LAUNCH_CHECK();
  });
  column_sums(2, dgamma, dbeta, partials, blocks, C, accumulate_param_grads, stream);
}

}  // namespace replay::unet
