// group_norm.cu: GroupNorm(+SiLU) over NHWC, forward and backward (group_norm.h), and the
// convolutions' bias gradient and bias add over NHWC rows (conv.h), which use the same tiling.
//
// Tiling. A block covers one tile: pixels [p0, p1) of one sample, all C channels. Thread t owns
// column t % cols (16 bytes: 8 channels) and lane t / cols of `lanes`; lane l walks the pixels
// p0 + l, p0 + l + lanes, ... a step of 2 or 4 pixels at a time, the next step's 16-byte loads
// issued before the current step is used (walk_rows), so a thread keeps two steps in flight. The
// threads of a warp read consecutive columns of a pixel's row of C channels, so every access is
// coalesced whatever C is, and a group's channels never need to be 16-byte aligned (C / G is 20
// at C = 320, G = 16). A thread keeps its columns for the whole tile, so its per-channel constants
// (gamma, beta, the statistics of each channel's group) stay in registers and its per-channel
// sums accumulate in registers; one pass through shared memory at the end adds the lanes of a
// column in lane order, and one warp per group adds the group's channels with the butterfly of
// device_utils.cuh. Every order is fixed by the shape.
//
// Split. The UNet's groups hold up to a quarter of a million elements and N can be 1, so a group's
// reduction is spread over blocks_per_sample tiles (about a thousand blocks in all: several per
// SM), merged by a small kernel with a warp per (sample, group), so that the kernels that stream
// the tensor start streaming at once instead of each merging partials first.
//
// Forward. gn_forward_stats: per tile and channel, sums of d = x - s and d^2 with s the tile's
// first pixel (shifted data: no cancellation when |mean| >> stddev), turned into the channel's
// (mean, M2) and merged into the group's (mean, M2) with Chan's formula, written as a partial.
// gn_forward_finalize merges a sample's partials (Chan again) into mean and rstd.
// gn_forward_apply normalizes: y = x * a[c] + b[c], a = rstd * gamma, b = beta - mean * a, then
// SiLU. x is read twice: the UNet's activations (84 MB at N = 32, 64x64, C = 320) do not fit on
// the chip, so a read-once scheme would have to hold a sample's tiles on resident blocks (a 2.6 MB
// sample is most of the H100's shared memory). Instead the apply kernel walks the tiles in
// reverse: its first tiles are the stats kernel's last, still in L2.
//
// Backward. gn_backward_reduce: per tile and channel, S1 = sum dy and S2 = sum dy * xhat (dy
// through SiLU's derivative, y recomputed from x and the statistics); written as the tile's
// dbeta and dgamma partial rows, and, weighted by gamma, summed per group: sum(g) and
// sum(g * xhat) of the tile. gn_backward_finalize adds a sample's group sums into the
// coefficients of dx; gn_backward_apply (tiles in reverse, as above) writes
// dx = rstd * gamma * dy - rstd * mean(g) - rstd * xhat * mean(g * xhat). column_sums
// (common/kernels/column_sums.cuh) adds the partial rows in a fixed order. All kernels are
// programmatic dependent launches (dependent_launch.cuh).
#include "workloads/unet/group_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/column_sums.cuh"
#include "common/kernels/dependent_launch.cuh"
#include "workloads/unet/half_pairs.cuh"
#include "workloads/unet/conv.h"

namespace replay::unet {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kPack = 8;  // 16-bit values in a thread's 16-byte column
// Threads of a block: at most 512 columns (C <= 4096). The kernels are declared for 512 threads
// and one block per SM so that ptxas may use up to 128 registers: for 512 threads it otherwise
// aims at 64 and spills. The UNet's blocks have 160 to 480 threads, several per SM.
constexpr int kMaxThreads = 512;
constexpr int kMinThreads = 128;         // lanes double until a block has at least this many
constexpr int kUnroll = 4;               // pixels a lane of the bias sums loads before it uses one
constexpr int64_t kTargetBlocks = 1024;  // tiles over the whole tensor (about 8 per H100 SM)
static_assert(kMaxThreads * kPack == kGroupNormMaxChannels, "limits disagree");

// ---------------------------------------------------------------------------------------------------
// 16-bit storage.

// kWords 32-bit words (2 * kWords values), moved with one 8- or 16-byte access.
template <int kWords>
struct alignas(4 * kWords) Words {
  uint32_t w[kWords];
};
using Pack = Words<4>;

template <typename T, int kWords>
__device__ __forceinline__ void to_floats(const Words<kWords>& v, float (&f)[2 * kWords]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    const float2 p = to_float2<T>(v.w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T, int kWords>
__device__ __forceinline__ Words<kWords> to_words(const float (&f)[2 * kWords]) {
  Words<kWords> v;
#pragma unroll
  for (int i = 0; i < kWords; ++i) v.w[i] = to_word<T>(f[2 * i], f[2 * i + 1]);
  return v;
}

// Loads that stay in L2 (the stats and reduce kernels: the apply kernels read the tail again).
template <int kWords>
__device__ __forceinline__ Words<kWords> load_keep(const void* p) {
  Words<kWords> r;
  if constexpr (kWords == 4)
    *reinterpret_cast<uint4*>(r.w) = *reinterpret_cast<const uint4*>(p);
  else
    *reinterpret_cast<uint2*>(r.w) = *reinterpret_cast<const uint2*>(p);
  return r;
}

// Last reads and writes, evicted first, as a pair (device_utils.cuh, Pack128).
__device__ __forceinline__ Pack load_stream(const void* p) {
  Pack r;
  *reinterpret_cast<uint4*>(r.w) = __ldcs(reinterpret_cast<const uint4*>(p));
  return r;
}

__device__ __forceinline__ void store_stream(void* p, const Pack& v) {
  __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(v.w));
}

// gamma and beta, read by every block: cached.
template <typename T>
__device__ __forceinline__ void load_params(const T* v, int col, float (&f)[kPack]) {
  to_floats<T>(load_keep<4>(v + col * kPack), f);
}

__device__ __forceinline__ float sigmoid(float y) {
  // __frcp_rn(inf) is 0, so a very negative y gives 0, not NaN.
  return __frcp_rn(1.0f + __expf(-y));
}

// ---------------------------------------------------------------------------------------------------
// Tiles.

struct Tile {
  int cols = 1;           // 16-byte columns: C / 8
  int lanes = 1;          // pixels walked at once
  int blocks = 1;         // tiles per sample
  int64_t pixels = 1;     // HW
  int64_t per_block = 1;  // pixels per tile (the last tile may have fewer)
};

// Where this block and thread are. `reversed` walks the tiles from the last (see the top).
struct Place {
  int n, b, col, lane;
  bool active;  // the block's threads are rounded up to whole warps; the extra ones only reduce
  int64_t p0, p1;
};

__device__ __forceinline__ Place place(const Tile& tile, bool reversed) {
  Place pl;
  int linear = blockIdx.y * gridDim.x + blockIdx.x;
  if (reversed) linear = gridDim.x * gridDim.y - 1 - linear;
  pl.n = linear / tile.blocks;
  pl.b = linear % tile.blocks;
  pl.col = threadIdx.x % tile.cols;
  pl.lane = threadIdx.x / tile.cols;
  pl.active = pl.lane < tile.lanes;
  pl.p0 = pl.b * tile.per_block;
  pl.p1 = min(pl.p0 + tile.per_block, tile.pixels);
  return pl;
}

// Pixels in tile j.
__device__ __forceinline__ float tile_pixels(const Tile& tile, int j) {
  return static_cast<float>(min(tile.per_block, tile.pixels - j * tile.per_block));
}

// A lane's pixels of its tile, kRows at a time. The buffers of one step: one pack per pixel and
// tensor.
template <int kRows>
struct Rows1 {
  Pack x[kRows];
};
template <int kRows>
struct Rows2 {
  Pack x[kRows], d[kRows];
};
template <int kRows>
struct Rows3 {
  Pack x[kRows], d[kRows], o[kRows];
};

// Walks p, p + step, ... below end with two buffers: the loads of the next step are issued before
// the current step is used, so two steps' loads are in flight while one is consumed. `a` holds
// step p, loaded by the caller (who may form its constants meanwhile); load(v, q) loads step q
// (pixels q, q + lanes, ... below the tile's end), use(v, q) consumes it. The buffers are named,
// not indexed: an indexed pair would live in local memory.
template <typename Buf, typename Load, typename Use>
__device__ __forceinline__ void walk_rows(Buf& a, int64_t p, int64_t end, int64_t step, Load&& load,
                                          Use&& use) {
  Buf b;
  while (p < end) {
    load(b, p + step);
    use(a, p);
    p += step;
    if (p >= end) break;
    load(a, p + step);
    use(b, p);
    p += step;
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward.

constexpr int kStatsRows = 4;  // pixels a lane loads per step (two steps in flight)
constexpr int kApplyRows = 4;

template <typename T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    gn_forward_stats_kernel(float2* __restrict__ partials, const T* __restrict__ x, Tile tile,
                            int C, int G) {
  allow_dependent_launch();
  wait_for_previous_grid();
  __shared__ float red[2][kMaxThreads * kPack];
  const Place pl = place(tile, false);
  float shift[kPack], s1[kPack], s2[kPack];
#pragma unroll
  for (int e = 0; e < kPack; ++e) shift[e] = s1[e] = s2[e] = 0.0f;
  if (pl.active) {
    const T* xs = x + pl.n * tile.pixels * C + pl.col * kPack;
    auto load = [&](Rows1<kStatsRows>& v, int64_t p) {
#pragma unroll
      for (int u = 0; u < kStatsRows; ++u) {
        const int64_t q = p + u * tile.lanes;
        if (q < pl.p1) v.x[u] = load_keep<4>(xs + q * C);
      }
    };
    auto use = [&](const Rows1<kStatsRows>& v, int64_t p) {
#pragma unroll
      for (int u = 0; u < kStatsRows; ++u) {
        if (p + u * tile.lanes < pl.p1) {
          float f[kPack];
          to_floats<T>(v.x[u], f);
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            const float d = f[e] - shift[e];
            s1[e] += d;
            s2[e] = fmaf(d, d, s2[e]);
          }
        }
      }
    };
    Rows1<kStatsRows> first;
    load(first, pl.p0 + pl.lane);
    to_floats<T>(load_keep<4>(xs + pl.p0 * C), shift);
    walk_rows(first, pl.p0 + pl.lane, pl.p1, int64_t{tile.lanes} * kStatsRows, load, use);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      red[0][pl.lane * C + pl.col * kPack + e] = s1[e];
      red[1][pl.lane * C + pl.col * kPack + e] = s2[e];
    }
  }
  __syncthreads();
  // Lane 0 of a column adds the lanes in order and turns the shifted sums into the channel's
  // (mean, M2), in place of its own slots (nobody else reads them).
  const float count = static_cast<float>(pl.p1 - pl.p0);
  if (pl.active && pl.lane == 0) {
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      const int c = pl.col * kPack + e;
      float a = s1[e], q = s2[e];
      for (int l = 1; l < tile.lanes; ++l) {
        a += red[0][l * C + c];
        q += red[1][l * C + c];
      }
      red[0][c] = shift[e] + a / count;
      red[1][c] = fmaxf(q - a * (a / count), 0.0f);
    }
  }
  __syncthreads();
  // A warp per group: mean of the channel means (equal counts), then
  // M2 = sum of M2_c + count * (mean_c - mean)^2.
  const int Cg = C / G, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int g = threadIdx.x / 32; g < G; g += warps) {
    const float* means = red[0] + g * Cg;
    const float* m2s = red[1] + g * Cg;
    float a = 0.0f;
    for (int j = lane; j < Cg; j += 32) a += means[j];
    const float mean = warp_reduce_sum(a) / static_cast<float>(Cg);
    float q = 0.0f;
    for (int j = lane; j < Cg; j += 32) {
      const float d = means[j] - mean;
      q += fmaf(count * d, d, m2s[j]);
    }
    q = warp_reduce_sum(q);
    if (lane == 0)
      partials[(static_cast<int64_t>(pl.n) * tile.blocks + pl.b) * G + g] = make_float2(mean, q);
  }
}

// A warp per (sample, group): merges the sample's tile partials in a fixed order (lanes over
// tiles, then the butterfly) with Chan's formula and writes mean and rstd. kFinalizeThreads / 32
// pairs a block.
constexpr int kFinalizeThreads = 256;

__global__ void __launch_bounds__(kFinalizeThreads)
    gn_forward_finalize_kernel(float* __restrict__ mean_out, float* __restrict__ rstd_out,
                               const float2* __restrict__ partials, Tile tile, int G, int64_t pairs,
                               float eps) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t pair =
      static_cast<int64_t>(blockIdx.x) * (kFinalizeThreads / 32) + threadIdx.x / 32;
  if (pair >= pairs) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const int64_t n = pair / G;
  const int g = static_cast<int>(pair % G);
  const float group_count = static_cast<float>(tile.cols * kPack / G);
  const float total = static_cast<float>(tile.pixels) * group_count;
  const float2* pg = partials + n * tile.blocks * G + g;
  float a = 0.0f;
#pragma unroll 4
  for (int j = lane; j < tile.blocks; j += 32)
    a += tile_pixels(tile, j) * group_count * pg[static_cast<int64_t>(j) * G].x;
  const float mean = warp_reduce_sum(a) / total;
  float q = 0.0f;
#pragma unroll 4
  for (int j = lane; j < tile.blocks; j += 32) {
    const float2 v = pg[static_cast<int64_t>(j) * G];
    const float d = v.x - mean;
    q += fmaf(tile_pixels(tile, j) * group_count * d, d, v.y);
  }
  const float rstd = rsqrtf(warp_reduce_sum(q) / total + eps);
  if (lane == 0) {
    mean_out[pair] = mean;
    rstd_out[pair] = rstd;
  }
}

template <typename T, bool kSilu>
__global__ void __launch_bounds__(kMaxThreads, 1)
    gn_forward_apply_kernel(T* out, const float* __restrict__ mean, const float* __restrict__ rstd,
                            const T* x, const T* __restrict__ gamma, const T* __restrict__ beta,
                            Tile tile, int C, int G) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const Place pl = place(tile, true);
  if (!pl.active) return;  // no barriers here
  const int64_t base = pl.n * tile.pixels * C + pl.col * kPack;
  const T* xs = x + base;
  T* os = out + base;
  auto load = [&](Rows1<kApplyRows>& v, int64_t p) {
#pragma unroll
    for (int u = 0; u < kApplyRows; ++u) {
      const int64_t q = p + u * tile.lanes;
      if (q < pl.p1) v.x[u] = load_stream(xs + q * C);
    }
  };
  Rows1<kApplyRows> first;
  load(first, pl.p0 + pl.lane);  // in flight while the constants are formed

  float scale[kPack], shift[kPack];
  {
    const int Cg = C / G;
    float gm[kPack], bt[kPack];
    load_params(gamma, pl.col, gm);
    load_params(beta, pl.col, bt);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      const int g = pl.n * G + (pl.col * kPack + e) / Cg;
      scale[e] = rstd[g] * gm[e];
      shift[e] = fmaf(-mean[g], scale[e], bt[e]);
    }
  }
  auto use = [&](const Rows1<kApplyRows>& v, int64_t p) {
#pragma unroll
    for (int u = 0; u < kApplyRows; ++u) {
      const int64_t q = p + u * tile.lanes;
      if (q < pl.p1) {
        float f[kPack];
        to_floats<T>(v.x[u], f);
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          const float y = fmaf(f[e], scale[e], shift[e]);
          f[e] = kSilu ? y * sigmoid(y) : y;
        }
        store_stream(os + q * C, to_words<T, 4>(f));
      }
    }
  };
  walk_rows(first, pl.p0 + pl.lane, pl.p1, int64_t{tile.lanes} * kApplyRows, load, use);
}

// ---------------------------------------------------------------------------------------------------
// Backward.

constexpr int kReduceRows = 2;  // two tensors a pixel, and more registers a thread: 2, not 4
constexpr int kBackRows = 2;

// Per-channel constants of one thread's column: xhat = x * xr + xs, y = xhat * gm + bt (four
// arrays, not more: the SiLU backward kernels are at the register limit).
struct Column {
  float xr[kPack], xs[kPack], gm[kPack], bt[kPack];
};

template <typename T>
__device__ __forceinline__ void load_column(Column& k, const T* gamma, const T* beta,
                                            const float* mean, const float* rstd, int n, int col,
                                            int Cg, int G) {
  load_params(gamma, col, k.gm);
  load_params(beta, col, k.bt);
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const int g = n * G + (col * kPack + e) / Cg;
    const float m = mean[g], r = rstd[g];
    k.xr[e] = r;
    k.xs[e] = -m * r;
  }
}

// dy from dout (through SiLU's derivative, y recomputed) and xhat, for one element.
template <bool kSilu>
__device__ __forceinline__ float grad_in(float d, float x, const Column& k, int e, float& xhat) {
  xhat = fmaf(x, k.xr[e], k.xs[e]);
  if (!kSilu) return d;
  const float y = fmaf(xhat, k.gm[e], k.bt[e]);
  const float s = sigmoid(y);
  return d * s * fmaf(y, 1.0f - s, 1.0f);
}

template <typename T, bool kSilu>
__global__ void __launch_bounds__(kMaxThreads, 1)
    gn_backward_reduce_kernel(float* __restrict__ channel_partials,
                              float2* __restrict__ group_partials, const T* __restrict__ dout,
                              const T* __restrict__ x, const T* __restrict__ gamma,
                              const T* __restrict__ beta, const float* __restrict__ mean,
                              const float* __restrict__ rstd, Tile tile, int C, int G) {
  allow_dependent_launch();
  wait_for_previous_grid();
  __shared__ float red[2][kMaxThreads * kPack];
  const Place pl = place(tile, false);
  const int Cg = C / G;
  float s1[kPack], s2[kPack];
#pragma unroll
  for (int e = 0; e < kPack; ++e) s1[e] = s2[e] = 0.0f;
  if (pl.active) {
    const int64_t base = pl.n * tile.pixels * C + pl.col * kPack;
    const T* xs = x + base;
    const T* ds = dout + base;
    auto load = [&](Rows2<kReduceRows>& v, int64_t p) {
#pragma unroll
      for (int u = 0; u < kReduceRows; ++u) {
        const int64_t q = p + u * tile.lanes;
        if (q < pl.p1) {
          v.x[u] = load_keep<4>(xs + q * C);
          v.d[u] = load_keep<4>(ds + q * C);
        }
      }
    };
    Rows2<kReduceRows> first;
    load(first, pl.p0 + pl.lane);
    Column k;
    load_column(k, gamma, beta, mean, rstd, pl.n, pl.col, Cg, G);
    auto use = [&](const Rows2<kReduceRows>& v, int64_t p) {
#pragma unroll
      for (int u = 0; u < kReduceRows; ++u) {
        if (p + u * tile.lanes < pl.p1) {
          float xf[kPack], df[kPack];
          to_floats<T>(v.x[u], xf);
          to_floats<T>(v.d[u], df);
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            float xhat;
            const float dy = grad_in<kSilu>(df[e], xf[e], k, e, xhat);
            s1[e] += dy;
            s2[e] = fmaf(dy, xhat, s2[e]);
          }
        }
      }
    };
    walk_rows(first, pl.p0 + pl.lane, pl.p1, int64_t{tile.lanes} * kReduceRows, load, use);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      red[0][pl.lane * C + pl.col * kPack + e] = s1[e];
      red[1][pl.lane * C + pl.col * kPack + e] = s2[e];
    }
  }
  __syncthreads();
  const int64_t part = static_cast<int64_t>(pl.n) * tile.blocks + pl.b;
  const int64_t parts = static_cast<int64_t>(gridDim.x) * gridDim.y;
  if (pl.active && pl.lane == 0) {
    float S1[kPack], S2[kPack], gm[kPack];
    load_params(gamma, pl.col, gm);  // again: not kept in registers through the walk
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      const int c = pl.col * kPack + e;
      S1[e] = s1[e];
      S2[e] = s2[e];
      for (int l = 1; l < tile.lanes; ++l) {
        S1[e] += red[0][l * C + c];
        S2[e] += red[1][l * C + c];
      }
      red[0][c] = gm[e] * S1[e];  // the tile's sum of g = dy * gamma
      red[1][c] = gm[e] * S2[e];  // and of g * xhat
    }
    // Output 0 of the column sums is dgamma, output 1 dbeta.
    float* dgamma_row = channel_partials + part * C + pl.col * kPack;
    float* dbeta_row = channel_partials + (parts + part) * C + pl.col * kPack;
    reinterpret_cast<float4*>(dgamma_row)[0] = make_float4(S2[0], S2[1], S2[2], S2[3]);
    reinterpret_cast<float4*>(dgamma_row)[1] = make_float4(S2[4], S2[5], S2[6], S2[7]);
    reinterpret_cast<float4*>(dbeta_row)[0] = make_float4(S1[0], S1[1], S1[2], S1[3]);
    reinterpret_cast<float4*>(dbeta_row)[1] = make_float4(S1[4], S1[5], S1[6], S1[7]);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int g = threadIdx.x / 32; g < G; g += warps) {
    float a = 0.0f, q = 0.0f;
    for (int j = lane; j < Cg; j += 32) {
      a += red[0][g * Cg + j];
      q += red[1][g * Cg + j];
    }
    a = warp_reduce_sum(a);
    q = warp_reduce_sum(q);
    if (lane == 0) group_partials[part * G + g] = make_float2(a, q);
  }
}

// A warp per (sample, group): adds the sample's tile sums of g and g * xhat in a fixed order and
// writes the group's dx coefficients (-rstd * mean(g), -rstd * mean(g * xhat)).
__global__ void __launch_bounds__(kFinalizeThreads)
    gn_backward_finalize_kernel(float2* __restrict__ coef,
                                const float2* __restrict__ group_partials,
                                const float* __restrict__ rstd, Tile tile, int G, int64_t pairs) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t pair =
      static_cast<int64_t>(blockIdx.x) * (kFinalizeThreads / 32) + threadIdx.x / 32;
  if (pair >= pairs) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const int64_t n = pair / G;
  const int g = static_cast<int>(pair % G);
  const float total = static_cast<float>(tile.pixels) * static_cast<float>(tile.cols * kPack / G);
  const float2* pg = group_partials + n * tile.blocks * G + g;
  float a = 0.0f, q = 0.0f;
#pragma unroll 4
  for (int j = lane; j < tile.blocks; j += 32) {
    const float2 v = pg[static_cast<int64_t>(j) * G];
    a += v.x;
    q += v.y;
  }
  a = warp_reduce_sum(a);
  q = warp_reduce_sum(q);
  const float r = rstd[pair];
  if (lane == 0) coef[pair] = make_float2(-r * (a / total), -r * (q / total));
}

template <typename T, bool kSilu, bool kAccumulate>
__global__ void __launch_bounds__(kMaxThreads, 1)
    gn_backward_apply_kernel(T* dx, const float2* __restrict__ coef, const T* dout, const T* x,
                             const T* __restrict__ gamma, const T* __restrict__ beta,
                             const float* __restrict__ mean, const float* __restrict__ rstd,
                             Tile tile, int C, int G) {
  allow_dependent_launch();
  wait_for_previous_grid();
  // Accumulating reads a third tensor: one pixel a step keeps it within the registers.
  constexpr int kRows = kAccumulate ? 1 : kBackRows;
  const Place pl = place(tile, true);
  if (!pl.active) return;  // no barriers here
  const int Cg = C / G;
  const int64_t base = pl.n * tile.pixels * C + pl.col * kPack;
  const T* xs = x + base;
  const T* ds = dout + base;
  T* gs = dx + base;
  auto load = [&](Rows3<kRows>& v, int64_t p) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t q = p + u * tile.lanes;
      if (q < pl.p1) {
        v.x[u] = load_stream(xs + q * C);
        v.d[u] = load_stream(ds + q * C);
        if (kAccumulate) v.o[u] = load_stream(gs + q * C);
      }
    }
  };
  Rows3<kRows> first;
  load(first, pl.p0 + pl.lane);  // in flight while the constants are formed

  // dx = rstd * gamma * dy + kc + kx * xhat, with (kc, kx) the channel's group coefficients.
  Column k;
  load_column(k, gamma, beta, mean, rstd, pl.n, pl.col, Cg, G);
  float kc[kPack], kx[kPack];
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const float2 cf = coef[pl.n * G + (pl.col * kPack + e) / Cg];
    kc[e] = cf.x;
    kx[e] = cf.y;
  }
  auto use = [&](const Rows3<kRows>& v, int64_t p) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t q = p + u * tile.lanes;
      if (q < pl.p1) {
        float xf[kPack], df[kPack], of[kPack];
        to_floats<T>(v.x[u], xf);
        to_floats<T>(v.d[u], df);
        if (kAccumulate) to_floats<T>(v.o[u], of);
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          float xhat;
          const float dy = grad_in<kSilu>(df[e], xf[e], k, e, xhat);
          float g = fmaf(k.xr[e] * k.gm[e], dy, fmaf(kx[e], xhat, kc[e]));
          if (kAccumulate) g += of[e];
          df[e] = g;
        }
        store_stream(gs + q * C, to_words<T, 4>(df));
      }
    }
  };
  walk_rows(first, pl.p0 + pl.lane, pl.p1, int64_t{tile.lanes} * kRows, load, use);
}

// ---------------------------------------------------------------------------------------------------
// The convolutions' bias: channel sums of dy [rows, K] per tile of rows, and y += bias.

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxThreads, 1)
    channel_sums_kernel(float* __restrict__ partials, const T* __restrict__ dy, int64_t rows, int K,
                        int cols, int lanes, int64_t per_block) {
  allow_dependent_launch();
  wait_for_previous_grid();
  constexpr int kWords = kVec / 2;
  __shared__ float red[kMaxThreads * kPack];
  const int col = threadIdx.x % cols, lane = threadIdx.x / cols;
  const bool active = lane < lanes;
  const int64_t r0 = blockIdx.x * per_block, r1 = min(r0 + per_block, rows);
  float s[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) s[e] = 0.0f;
  if (active) {
    const T* ds = dy + col * kVec;
    for (int64_t r = r0 + lane; r < r1; r += lanes * kUnroll) {
      Words<kWords> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (r + u * lanes < r1) v[u] = load_keep<kWords>(ds + (r + u * lanes) * K);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * lanes < r1) {
          float f[kVec];
          to_floats<T>(v[u], f);
#pragma unroll
          for (int e = 0; e < kVec; ++e) s[e] += f[e];
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) red[lane * K + col * kVec + e] = s[e];
  }
  __syncthreads();
  if (active && lane == 0) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int c = col * kVec + e;
      float a = s[e];
      for (int l = 1; l < lanes; ++l) a += red[l * K + c];
      partials[static_cast<int64_t>(blockIdx.x) * K + c] = a;
    }
  }
}

template <typename T, int kVec>
__global__ void bias_add_kernel(T* y, const T* __restrict__ bias, int64_t vectors, int cols) {
  allow_dependent_launch();
  wait_for_previous_grid();
  constexpr int kWords = kVec / 2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float f[kVec], b[kVec];
    to_floats<T>(load_keep<kWords>(y + i * kVec), f);
    to_floats<T>(load_keep<kWords>(bias + (i % cols) * kVec), b);
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] += b[e];
    const Words<kWords> v = to_words<T, kWords>(f);
    if constexpr (kWords == 4)
      *reinterpret_cast<uint4*>(y + i * kVec) = *reinterpret_cast<const uint4*>(v.w);
    else
      *reinterpret_cast<uint2*>(y + i * kVec) = *reinterpret_cast<const uint2*>(v.w);
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

size_t round_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

// Calls f(T{}) with T the storage type of dtype.
template <typename F>
void with_storage(DType dtype, F&& f) {
  if (dtype == DType::kFP16) return f(__half{});
  if (dtype == DType::kBF16) return f(bf16{});
  REPLAY_REQUIRE(false,
                 std::string("unet kernels take fp16 or bf16 storage, got ") + dtype_name(dtype));
}

// Lanes and threads for `cols` columns: lanes double until the block has kMinThreads threads.
void pick_lanes(int cols, int& lanes, int& threads) {
  lanes = 1;
  while (cols * lanes < kMinThreads && cols * lanes * 2 <= kMaxThreads) lanes *= 2;
  threads = static_cast<int>(ceil_div(cols * lanes, 32)) * 32;
}

// Rows (pixels) per tile: about kTargetBlocks tiles over `tiles_wanted_from` rows in all, at least
// one full unrolled step per lane, never more than the rows of one sample.
int64_t pick_per_block(int64_t rows, int64_t samples, int lanes) {
  const int64_t wanted = std::max<int64_t>(1, ceil_div(kTargetBlocks, samples));
  int64_t per = ceil_div(rows, wanted);
  per = std::max<int64_t>(per, int64_t{lanes} * kUnroll);
  per = ceil_div<int64_t>(per, lanes) * lanes;
  return std::min(per, rows);
}

Tile make_tile(const GroupNormShape& s) {
  const GroupNormSplit split = group_norm_split(s);
  Tile t;
  t.cols = s.channels / kPack;
  t.lanes = split.lanes;
  t.blocks = static_cast<int>(split.blocks_per_sample);
  t.pixels = s.pixels;
  t.per_block = split.pixels_per_block;
  return t;
}

size_t group_partials_bytes(const GroupNormShape& s) {
  const GroupNormSplit split = group_norm_split(s);
  return round_up(
      static_cast<size_t>(s.batch * split.blocks_per_sample) * s.groups * sizeof(float2), 256);
}

// The backward's dx coefficients, [N, G] float2.
size_t coef_bytes(const GroupNormShape& s) {
  return round_up(static_cast<size_t>(s.batch) * s.groups * sizeof(float2), 256);
}

unsigned finalize_blocks(const GroupNormShape& s) {
  return static_cast<unsigned>(ceil_div<int64_t>(s.batch * s.groups, kFinalizeThreads / 32));
}

size_t channel_partials_bytes(const GroupNormShape& s) {
  const GroupNormSplit split = group_norm_split(s);
  return round_up(
      static_cast<size_t>(2 * s.batch * split.blocks_per_sample) * s.channels * sizeof(float), 256);
}

void check_workspace(const void* workspace, size_t bytes, size_t needed, const char* what) {
  REPLAY_REQUIRE(workspace != nullptr && aligned16(workspace),
                 std::string(what) + ": the workspace must be 16-byte aligned");
  REPLAY_REQUIRE(bytes >= needed, std::string(what) + " workspace too small: " +
                                      std::to_string(bytes) + " < " + std::to_string(needed));
}

std::string describe(const GroupNormShape& s) {
  return "N=" + std::to_string(s.batch) + " HW=" + std::to_string(s.pixels) +
         " C=" + std::to_string(s.channels) + " G=" + std::to_string(s.groups);
}

}  // namespace

void check_group_norm_shape(const GroupNormShape& s) {
  const std::string at = " (GroupNorm " + describe(s) + ")";
  REPLAY_REQUIRE(
      s.batch >= 1 && s.pixels >= 1 && s.batch <= INT32_MAX && s.batch * s.pixels <= INT32_MAX,
      "GroupNorm needs N >= 1, HW >= 1 and N * HW < 2^31" + at);
  REPLAY_REQUIRE(
      s.channels >= kPack && s.channels % kPack == 0 && s.channels <= kGroupNormMaxChannels,
      "GroupNorm needs C a multiple of 8 in [8, 4096]" + at);
  REPLAY_REQUIRE(s.groups >= 1 && s.groups <= kGroupNormMaxGroups && s.channels % s.groups == 0,
                 "GroupNorm needs 1 <= G <= 128 dividing C" + at);
}

GroupNormSplit group_norm_split(const GroupNormShape& s) {
  check_group_norm_shape(s);
  GroupNormSplit split;
  pick_lanes(s.channels / kPack, split.lanes, split.threads);
  split.pixels_per_block = pick_per_block(s.pixels, s.batch, split.lanes);
  split.blocks_per_sample = ceil_div(s.pixels, split.pixels_per_block);
  return split;
}

size_t group_norm_forward_workspace_bytes(const GroupNormShape& s) {
  return group_partials_bytes(s);
}

size_t group_norm_backward_workspace_bytes(const GroupNormShape& s) {
  return channel_partials_bytes(s) + group_partials_bytes(s) + coef_bytes(s);
}

void group_norm_forward(DType dtype, void* out, float* mean, float* rstd, const void* x,
                        const void* gamma, const void* beta, const GroupNormShape& s, float eps,
                        GroupNormAct act, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  const GroupNormSplit split = group_norm_split(s);
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(gamma) && aligned16(beta) &&
                     out != nullptr && x != nullptr && gamma != nullptr && beta != nullptr,
                 "GroupNorm forward tensors must be non-null and 16-byte aligned");
  REPLAY_REQUIRE(mean != nullptr && rstd != nullptr, "GroupNorm forward statistics missing");
  check_workspace(workspace, workspace_bytes, group_norm_forward_workspace_bytes(s),
                  "GroupNorm forward");
  const Tile tile = make_tile(s);
  const dim3 grid(static_cast<unsigned>(split.blocks_per_sample), static_cast<unsigned>(s.batch));
  auto* partials = static_cast<float2*>(workspace);
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_dependent(gn_forward_stats_kernel<T>, grid, dim3(split.threads), stream, partials,
                     static_cast<const T*>(x), tile, s.channels, s.groups);
    REPLAY_LAUNCH_CHECK();
    launch_dependent(gn_forward_finalize_kernel, dim3(finalize_blocks(s)), dim3(kFinalizeThreads),
                     stream, mean, rstd, static_cast<const float2*>(partials), tile, s.groups,
                     s.batch * s.groups, eps);
    REPLAY_LAUNCH_CHECK();
    auto apply = act == GroupNormAct::kSilu ? gn_forward_apply_kernel<T, true>
                                            : gn_forward_apply_kernel<T, false>;
    launch_dependent(apply, grid, dim3(split.threads), stream, static_cast<T*>(out),
                     static_cast<const float*>(mean), static_cast<const float*>(rstd),
                     static_cast<const T*>(x), static_cast<const T*>(gamma),
                     static_cast<const T*>(beta), tile, s.channels, s.groups);
    REPLAY_LAUNCH_CHECK();
  });
}

void group_norm_backward(DType dtype, void* dx, float* dgamma, float* dbeta, const void* dout,
                         const void* x, const void* gamma, const void* beta, const float* mean,
                         const float* rstd, const GroupNormShape& s, GroupNormAct act,
                         bool accumulate_dx, bool accumulate_param_grads, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  const GroupNormSplit split = group_norm_split(s);
  REPLAY_REQUIRE(aligned16(dx) && aligned16(dout) && aligned16(x) && aligned16(gamma) &&
                     aligned16(beta) && dx != nullptr && dout != nullptr && x != nullptr &&
                     gamma != nullptr && beta != nullptr,
                 "GroupNorm backward tensors must be non-null and 16-byte aligned");
  REPLAY_REQUIRE(mean != nullptr && rstd != nullptr && dgamma != nullptr && dbeta != nullptr,
                 "GroupNorm backward statistics or parameter gradients missing");
  REPLAY_REQUIRE(!(accumulate_dx && dx == dout), "GroupNorm backward: dx accumulated into dout");
  check_workspace(workspace, workspace_bytes, group_norm_backward_workspace_bytes(s),
                  "GroupNorm backward");
  const Tile tile = make_tile(s);
  const dim3 grid(static_cast<unsigned>(split.blocks_per_sample), static_cast<unsigned>(s.batch));
  const int parts = static_cast<int>(s.batch * split.blocks_per_sample);
  auto* channel_partials = static_cast<float*>(workspace);
  auto* group_partials =
      reinterpret_cast<float2*>(static_cast<char*>(workspace) + channel_partials_bytes(s));
  auto* coef = reinterpret_cast<float2*>(static_cast<char*>(workspace) + channel_partials_bytes(s) +
                                         group_partials_bytes(s));
  const bool silu = act == GroupNormAct::kSilu;
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto reduce = silu ? gn_backward_reduce_kernel<T, true> : gn_backward_reduce_kernel<T, false>;
    launch_dependent(reduce, grid, dim3(split.threads), stream, channel_partials, group_partials,
                     static_cast<const T*>(dout), static_cast<const T*>(x),
                     static_cast<const T*>(gamma), static_cast<const T*>(beta), mean, rstd, tile,
                     s.channels, s.groups);
    REPLAY_LAUNCH_CHECK();
    launch_dependent(gn_backward_finalize_kernel, dim3(finalize_blocks(s)), dim3(kFinalizeThreads),
                     stream, coef, static_cast<const float2*>(group_partials), rstd, tile, s.groups,
                     s.batch * s.groups);
    REPLAY_LAUNCH_CHECK();
    auto apply = silu ? (accumulate_dx ? gn_backward_apply_kernel<T, true, true>
                                       : gn_backward_apply_kernel<T, true, false>)
                      : (accumulate_dx ? gn_backward_apply_kernel<T, false, true>
                                       : gn_backward_apply_kernel<T, false, false>);
    launch_dependent(apply, grid, dim3(split.threads), stream, static_cast<T*>(dx),
                     static_cast<const float2*>(coef), static_cast<const T*>(dout),
                     static_cast<const T*>(x), static_cast<const T*>(gamma),
                     static_cast<const T*>(beta), mean, rstd, tile, s.channels, s.groups);
    REPLAY_LAUNCH_CHECK();
  });
  column_sums(2, dgamma, dbeta, channel_partials, parts, s.channels, accumulate_param_grads,
              stream);
}

// ---------------------------------------------------------------------------------------------------
// conv.h: the bias over NHWC rows.

namespace {

struct RowSplit {
  int vec = 8, cols = 1, lanes = 1, threads = 32;
  int64_t per_block = 1, blocks = 1;
};

RowSplit bias_split(int64_t rows, int64_t channels) {
  REPLAY_REQUIRE(rows >= 1 && rows <= INT32_MAX * int64_t{kPack},
                 "convolution bias: rows must be in [1, 2^34)");
  REPLAY_REQUIRE(channels >= 4 && channels % 4 == 0 && channels <= kGroupNormMaxChannels,
                 "convolution bias: channels must be a multiple of 4 in [4, 4096], got " +
                     std::to_string(channels));
  RowSplit s;
  s.vec = channels % 8 == 0 ? 8 : 4;
  s.cols = static_cast<int>(channels / s.vec);
  pick_lanes(s.cols, s.lanes, s.threads);
  s.per_block = pick_per_block(rows, 1, s.lanes);
  s.blocks = ceil_div(rows, s.per_block);
  return s;
}

}  // namespace

size_t conv_bias_grad_workspace_bytes(int64_t rows, int64_t channels) {
  const RowSplit s = bias_split(rows, channels);
  return static_cast<size_t>(s.blocks * channels) * sizeof(float);
}

void conv_bias_grad(DType dtype, float* dbias, const void* dy, int64_t rows, int64_t channels,
                    bool accumulate, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const RowSplit s = bias_split(rows, channels);
  REPLAY_REQUIRE(dy != nullptr && aligned16(dy) && dbias != nullptr,
                 "convolution bias gradient: dy must be 16-byte aligned, dbias non-null");
  check_workspace(workspace, workspace_bytes, conv_bias_grad_workspace_bytes(rows, channels),
                  "convolution bias gradient");
  auto* partials = static_cast<float*>(workspace);
  const int K = static_cast<int>(channels);
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = s.vec == 8 ? channel_sums_kernel<T, 8> : channel_sums_kernel<T, 4>;
    launch_dependent(kernel, dim3(static_cast<unsigned>(s.blocks)), dim3(s.threads), stream,
                     partials, static_cast<const T*>(dy), rows, K, s.cols, s.lanes, s.per_block);
    REPLAY_LAUNCH_CHECK();
  });
  column_sums(1, dbias, nullptr, partials, static_cast<int>(s.blocks), K, accumulate, stream);
}

void conv_bias_add(DType dtype, void* y, const void* bias, int64_t rows, int64_t channels,
                   cudaStream_t stream) {
  const RowSplit s = bias_split(rows, channels);
  REPLAY_REQUIRE(y != nullptr && bias != nullptr && aligned16(y) && aligned16(bias),
                 "convolution bias add: y and bias must be 16-byte aligned");
  const int64_t vectors = rows * channels / s.vec;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div<int64_t>(vectors, kThreads), int64_t{1} << 20);
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = s.vec == 8 ? bias_add_kernel<T, 8> : bias_add_kernel<T, 4>;
    launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream,
                     static_cast<T*>(y), static_cast<const T*>(bias), vectors, s.cols);
    REPLAY_LAUNCH_CHECK();
  });
}

}  // namespace replay::unet
