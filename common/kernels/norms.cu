// norms.cu: LayerNorm and RMSNorm forward and backward (see norms.h).
//
// Every kernel holds a thread's share of a row as raw bf16 pairs in 16-byte packs: thread t of a
// row owns packs t, t + T, ..., so a warp's accesses are contiguous. A bf16 is the upper half of
// an fp32, so a pair becomes two floats with one shift and one mask, and two floats go back with
// one cvt.rn.bf16x2: what is left per element is the arithmetic itself. Row offsets are formed
// once per row in 64 bits, pack offsets in 32; 1/C is passed in, so no division is left on the
// device.
//
// Forward: one row per block (one warp per row for C <= 1024), no persistence. The row is loaded
// once, straight into registers, evict-first (so it does not push gamma and beta out of L1); mean
// and variance are two exact passes over those registers (no E[x^2] - E[x]^2), each reduction
// one barrier with its own scratch; out = (x * rstd - mean * rstd) * gamma + beta is two FMAs an
// element. At 40 registers a thread, 4 blocks of 384 threads (C = 12288) or 3 of 512
// (C = 16384) share an SM, so while one block reduces and writes, the others' loads are in
// flight: up to 96 KB an SM, against the ~25 KB an SM that the reads need (Little's law: ~2 TB/s
// of reads at ~1.5 us of loaded latency is ~3 MB over 132 SMs). Shared memory holds only the
// scratch, so L1 keeps its full size for gamma and beta, which every block re-reads.
//
// Backward: a persistent grid (one block of up to 768 threads per SM for wide rows) walks rows b,
// b + gridDim.x, ... Every thread owns the same columns in every row, so its gamma stays in
// registers and the dgamma/dbeta contributions accumulate in registers. The accumulators
// (2 * C / T a thread for LayerNorm) rule out several blocks per SM, so the rows are streamed into
// a ring of shared-memory stages with cp.async, `stages - 1` rows ahead (at least 48 KB in flight
// per SM: one row ahead for wide rows, because deeper rings were slower), and loads stay in flight
// while the block reduces and writes. A thread reads back only the packs it copied itself, so
// the ring needs no barrier; a row's LayerNorm statistics come with it (see ring_issue). Pass 1
// reads x and dout from the ring and forms the two row sums and the parameter gradients; pass 2
// re-reads them (recomputing costs less than holding them in registers) and writes
// dx = rstd * g + x * k1 + k0, the two row sums folded into k0 and k1. At the end, the blocks of a
// cluster (two, where every pair fits on the device at once) add their sums through
// distributed shared memory and write one partial row, which column_sums adds in a fixed order as
// a programmatic dependent launch: half the bytes of a partial row a block (13 MB at C = 12288),
// written when nothing is left to overlap them (measured: reports/RESULTS.md, The LayerNorm
// backward).
#include "common/kernels/norms.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include <cooperative_groups.h>

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
constexpr size_t kInflightBytesPerSM = 48 << 10;  // bytes each SM keeps in flight (backward ring)
constexpr int kMaxStages = 8;
constexpr int kMaxDevices = 64;
static_assert(kMaxRowThreads * kMaxPacksPerThread * 8 == kNormMaxChannels, "limits disagree");

// Forward blocks per SM the register allocation must allow: 3 blocks of 512 threads (so 4 of 384)
// cap a thread at 40 registers, which four packs of x fit; eight packs need more.
__host__ __device__ constexpr int fwd_min_blocks(int ppt) {
  return ppt <= 4 ? 3 : 2;
}

// Backward threads per row, at most. 512 threads may use 128 registers, which hold four packs' 64
// LayerNorm accumulators. With up to two packs a thread (32 accumulators), 768 threads fit in 85
// registers: with one block an SM, the warps are what hides the latency of a row's two passes and
// its reduction, so C = 12288 runs 768 threads of 2 packs rather than 384 of 4, whose fewer warps
// issue fewer instructions a cycle (measured: reports/RESULTS.md, The LayerNorm backward).
constexpr int kMaxBwdThreads = 512;
constexpr int kMaxBwdThreadsNarrow = 768;
__host__ __device__ constexpr int bwd_max_threads(int ppt) {
  return ppt <= 2 ? kMaxBwdThreadsNarrow : kMaxBwdThreads;
}

// ---------------------------------------------------------------------------------------------------
// bf16 pairs.

// Eight bf16 as four pairs, moved with one 16-byte access.
struct alignas(16) Pairs {
  uint32_t w[4];
};

__device__ __forceinline__ float lo_float(uint32_t pair) {
  return __uint_as_float(pair << 16);
}

__device__ __forceinline__ float hi_float(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

__device__ __forceinline__ uint32_t to_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Pack p of a row: Pairs are 16-byte aligned because every tensor and C * 2 bytes are.
__device__ __forceinline__ Pairs load_stream(const bf16* row, int p) {  // read once, evict first
  Pairs r;
  *reinterpret_cast<uint4*>(r.w) = __ldcs(reinterpret_cast<const uint4*>(row) + p);
  return r;
}

__device__ __forceinline__ Pairs load_param(const bf16* v, int p) {  // gamma/beta: stay in L1
  Pairs r;
  *reinterpret_cast<uint4*>(r.w) = reinterpret_cast<const uint4*>(v)[p];
  return r;
}

// The forward streams its output rows out as it streams its input rows in (device_utils.cuh,
// Pack128), because streaming loads with plain stores are the slowest pairing. The backward keeps
// plain stores: streamed, they slowed the LayerNorm backward, which is just at its target, though
// they sped up the RMSNorm backward (measured: reports/RESULTS.md, Cache hints for the streaming
// kernels).
__device__ __forceinline__ void store_stream(bf16* row, int p, const Pairs& v) {  // write once
  __stcs(reinterpret_cast<uint4*>(row) + p, *reinterpret_cast<const uint4*>(v.w));
}

__device__ __forceinline__ void store_pairs(bf16* row, int p, const Pairs& v) {
  reinterpret_cast<uint4*>(row)[p] = *reinterpret_cast<const uint4*>(v.w);
}

// Eight fp32 values to 32 bytes at a 16-byte boundary.
__device__ __forceinline__ void store_floats8(float* dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Whether pack p exists: always, when the threads tile the row exactly.
template <bool kFull>
__device__ __forceinline__ bool owns(int p, int packs) {
  return kFull || p < packs;
}

// ---------------------------------------------------------------------------------------------------
// Reductions. Every thread receives the sum; every warp adds the same partials in the same order,
// so all threads hold the same bits. One sum is device_utils' block_sum_once: the caller gives each
// call its own scratch (32 floats) that no other call in flight uses, so one barrier suffices.

// Two sums over the block at once, same contract; scratch holds 64 floats.
__device__ __forceinline__ float2 block_sum2(float2 v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v.x = warp_reduce_sum(v.x);
  v.y = warp_reduce_sum(v.y);
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
// Forward.

// Loads this thread's packs p = t + i * tpr of a row. The forward keeps the bounds checks even
// where the threads tile the row: without them the compiler issues every pack's gamma and beta
// loads at once and spills past the 40 registers that four blocks per SM allow.
template <int kPpt>
__device__ __forceinline__ void load_row(Pairs (&xv)[kPpt], const bf16* xr, int t, int tpr,
                                         int packs) {
#pragma unroll
  for (int i = 0; i < kPpt; ++i)
    if (t + i * tpr < packs) xv[i] = load_stream(xr, t + i * tpr);
}

// Statistics and output of one row whose packs this thread holds in xv (raw: each pass converts
// afresh, one instruction an element, rather than holding twice the registers as floats).
// row_sum(v, k) sums v over the row's threads; k (0 or 1) tells the two reductions apart.
// Per element, LayerNorm: sum 2 (convert, add), variance 3 (convert, subtract, FMA), output 5.5
// (convert x, gamma, beta; two FMAs; half a cvt.bf16x2); RMSNorm: 2 + 4.5.
template <bool kLayerNorm, int kPpt, typename RowSum>
__device__ __forceinline__ void normalize_row(bf16* outr, float* mean_out, float* rstd_out,
                                              const Pairs (&xv)[kPpt],
                                              const bf16* __restrict__ gamma,
                                              const bf16* __restrict__ beta, int64_t row, int packs,
                                              int t, int tpr, float inv_c, float eps,
                                              RowSum row_sum) {
  float mean = 0.0f;
  if constexpr (kLayerNorm) {
    float s0 = 0.0f, s1 = 0.0f;  // two chains: half the dependent-add latency
#pragma unroll
    for (int i = 0; i < kPpt; ++i) {
      if (t + i * tpr < packs) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          s0 += lo_float(xv[i].w[w]);
          s1 += hi_float(xv[i].w[w]);
        }
      }
    }
    mean = row_sum(s0 + s1, 0) * inv_c;
  }
  float q0 = 0.0f, q1 = 0.0f;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (t + i * tpr < packs) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float x0 = lo_float(xv[i].w[w]), x1 = hi_float(xv[i].w[w]);
        const float d0 = kLayerNorm ? x0 - mean : x0;
        const float d1 = kLayerNorm ? x1 - mean : x1;
        q0 = fmaf(d0, d0, q0);
        q1 = fmaf(d1, d1, q1);
      }
    }
  }
  const float rstd = rsqrtf(row_sum(q0 + q1, 1) * inv_c + eps);
  if (t == 0) {
    if (kLayerNorm) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  // xhat = x * rstd + shift, out = xhat * gamma + beta.
  const float shift = -mean * rstd;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * tpr;
    if (p < packs) {
      const Pairs g = load_param(gamma, p);
      Pairs b;
      if (kLayerNorm) b = load_param(beta, p);
      Pairs o;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t xw = xv[i].w[w], gw = g.w[w];
        float y0, y1;
        if (kLayerNorm) {
          y0 = fmaf(fmaf(lo_float(xw), rstd, shift), lo_float(gw), lo_float(b.w[w]));
          y1 = fmaf(fmaf(hi_float(xw), rstd, shift), hi_float(gw), hi_float(b.w[w]));
        } else {
          y0 = lo_float(xw) * rstd * lo_float(gw);
          y1 = hi_float(xw) * rstd * hi_float(gw);
        }
        o.w[w] = to_pair(y0, y1);
      }
      store_stream(outr, p, o);
    }
  }
}

// Narrow rows: one warp per row.
template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(32 * kWarpRowsPerBlock)
    norm_forward_warp_kernel(bf16* out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                             const bf16* x, const bf16* __restrict__ gamma,
                             const bf16* __restrict__ beta, int64_t rows, int C, float inv_c,
                             float eps) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / 32;
  const int t = threadIdx.x % 32, packs = C / 8;
  if (row >= rows) return;  // whole warps only
  const int64_t base = row * C;
  Pairs xv[kPpt];
  load_row(xv, x + base, t, 32, packs);
  normalize_row<kLayerNorm>(out + base, mean_out, rstd_out, xv, gamma, beta, row, packs, t, 32,
                            inv_c, eps, [](float v, int) { return warp_reduce_sum(v); });
}

// Wide rows: one block per row (see the top of the file). Each thread reads all its packs before
// it writes any, and writes only those: that is what lets out alias x.
template <bool kLayerNorm, int kPpt>
__global__ void __launch_bounds__(kMaxRowThreads, fwd_min_blocks(kPpt))
    norm_forward_block_kernel(bf16* out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                              const bf16* x, const bf16* __restrict__ gamma,
                              const bf16* __restrict__ beta, int C, float inv_c, float eps) {
  allow_dependent_launch();
  wait_for_previous_grid();
  __shared__ float scratch[2][32];
  const int64_t row = blockIdx.x;
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  const int64_t base = row * C;
  Pairs xv[kPpt];
  load_row(xv, x + base, t, T, packs);
  normalize_row<kLayerNorm>(out + base, mean_out, rstd_out, xv, gamma, beta, row, packs, t, T,
                            inv_c, eps,
                            [&](float v, int k) { return block_sum_once(v, scratch[k]); });
}

// ---------------------------------------------------------------------------------------------------
// Backward.

// A ring slot's statistics: one (mean, rstd) pair a warp for LayerNorm (see ring_issue), rounded up
// to keep slots 16-byte aligned.
__host__ __device__ constexpr int ring_stats_bytes(bool layer_norm, int threads) {
  return layer_norm ? (threads / 32 * 8 + 15) / 16 * 16 : 0;
}

// Asynchronous global -> shared copies (sm_80+), L1 bypassed; smem is a shared-window address.
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

// Four bytes, through L1.
__device__ __forceinline__ void cp_async_4(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem) : "memory");
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

// Starts copying this thread's packs of `row` (if it exists) of the first n tensors into a ring
// slot, and always commits a group, so that the block's k-th group belongs to its k-th row.
// src_t[s] is tensor s advanced to this thread's first pack, slot_t the slot's shared address
// advanced likewise (tensor s at pack offset s * packs): per pack, one address add on each side.
// For LayerNorm, lane 0 also copies the row's mean and rstd to its warp's pair of floats at
// stat_w, which the warp reads after the wait and a __syncwarp. (Loaded into registers, even a
// row ahead, they are waited for where the compiler moves them, to uniform registers at once:
// every warp stalled on a DRAM round trip at the start of every row. For RMSNorm, whose warps have
// twice the work a row, the copy was no faster, so it loads its rstd. Measured: reports/RESULTS.md,
// The LayerNorm backward.)
template <bool kLayerNorm, int kPpt, bool kFull>
__device__ __forceinline__ void ring_issue(uint32_t slot_t, uint32_t stat_w, int64_t row,
                                           int64_t rows, int C, const bf16* const (&src_t)[3],
                                           int n, const float* mean, const float* rstd) {
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  if (row < rows) {
    if (kLayerNorm && t % 32 == 0) {
      cp_async_4(stat_w, mean + row);
      cp_async_4(stat_w + 4, rstd + row);
    }
    const int64_t offset = row * C;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      if (s < n) {
        const bf16* r = src_t[s] + offset;
#pragma unroll
        for (int i = 0; i < kPpt; ++i)
          if (owns<kFull>(t + i * T, packs))
            cp_async_16(slot_t + (s * packs + i * T) * 16, r + i * T * 8);
      }
    }
  }
  cp_async_commit();
}

// Pass 2 of a row: dx = rs * g + (x * k1 + k0) (+ the dx already there), from the packs in the
// ring slot (x at xs, dout at xs + packs, the old dx at xs + 2 * packs).
template <int kPpt, bool kFull, bool kAccumulate>
__device__ __forceinline__ void write_dx(bf16* dxr, const Pairs* xs, const Pairs (&g)[kPpt],
                                         float rs, float k0, float k1, int packs) {
  const int t = threadIdx.x, T = blockDim.x;
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * T;
    if (owns<kFull>(p, packs)) {
      const Pairs xv = xs[p], dv = xs[packs + p];
      Pairs prev;
      if (kAccumulate) prev = xs[2 * packs + p];
      Pairs o;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t xw = xv.w[w], dw = dv.w[w], gw = g[i].w[w];
        float d0 = fmaf(rs, lo_float(dw) * lo_float(gw), fmaf(lo_float(xw), k1, k0));
        float d1 = fmaf(rs, hi_float(dw) * hi_float(gw), fmaf(hi_float(xw), k1, k0));
        if (kAccumulate) {
          d0 += lo_float(prev.w[w]);
          d1 += hi_float(prev.w[w]);
        }
        o.w[w] = to_pair(d0, d1);
      }
      store_pairs(dxr, p, o);
    }
  }
}

// Per element (LayerNorm): pass 1 nine instructions (three conversions, xhat, g, two row sums,
// two parameter gradients), pass 2 six and a half (three conversions, g, two FMAs, half a
// cvt.bf16x2), a quarter each for the ring's copy and the two shared-memory reads; per row and
// thread ~200 more (copy addresses, the wait, the reduction), ~6 an element at 4 packs.
template <bool kLayerNorm, int kPpt, bool kFull>
__global__ void __launch_bounds__(bwd_max_threads(kPpt), 1)
    norm_backward_kernel(bf16* dx, float* __restrict__ partials, const bf16* dout, const bf16* x,
                         const bf16* __restrict__ gamma, const float* __restrict__ mean,
                         const float* __restrict__ rstd, int64_t rows, int C, float inv_c,
                         int stages, int cluster, bool accumulate_dx) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float scratch[2][64];  // alternate rows: one barrier per reduction
  allow_dependent_launch();
  wait_for_previous_grid();
  const int t = threadIdx.x, T = blockDim.x, packs = C / 8;
  const int64_t G = gridDim.x;
  const int tensors = accumulate_dx ? 3 : 2;
  // A slot: the tensors' packs of a row, then (LayerNorm) every warp's (mean, rstd) of that row.
  const int stats_offset = tensors * packs * 16, warp = t / 32;
  const int slot_bytes = stats_offset + ring_stats_bytes(kLayerNorm, T);
  const bf16* const src_t[3] = {x + t * 8, dout + t * 8, dx + t * 8};
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t ring_t = ring_base + t * 16, stat_w = ring_base + stats_offset + warp * 8;
  auto issue = [&](int slot, int64_t row) {
    ring_issue<kLayerNorm, kPpt, kFull>(ring_t + slot * slot_bytes, stat_w + slot * slot_bytes, row,
                                        rows, C, src_t, tensors, mean, rstd);
  };

  Pairs g[kPpt];
  float dgamma[kPpt][8], dbeta[kPpt][8];
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    if (owns<kFull>(t + i * T, packs)) g[i] = load_param(gamma, t + i * T);
#pragma unroll
    for (int j = 0; j < 8; ++j) dgamma[i][j] = dbeta[i][j] = 0.0f;
  }

  // The block's k-th row lands in slot k % stages; the slot refilled while row k is processed
  // is the one row k - 1 was read from, by the same threads, whose reads were used (complete).
  for (int s = 0; s < stages - 1; ++s) issue(s, blockIdx.x + s * G);
  int read_slot = 0, write_slot = stages - 1, parity = 0;
  const int64_t ahead = (stages - 1) * G;  // rows between the one read and the one issued
  for (int64_t row = blockIdx.x; row < rows; row += G) {
    issue(write_slot, row + ahead);
    write_slot = write_slot + 1 == stages ? 0 : write_slot + 1;
    const unsigned char* slot = smem + read_slot * slot_bytes;
    read_slot = read_slot + 1 == stages ? 0 : read_slot + 1;
    const Pairs* xs = reinterpret_cast<const Pairs*>(slot);
    float mu = 0.0f, rs;
    if constexpr (kLayerNorm) {
      cp_async_wait(stages - 1);  // row k has landed
      __syncwarp();               // with lane 0's copy of its statistics, for the whole warp
      const float2 st = reinterpret_cast<const float2*>(slot + stats_offset)[warp];
      mu = st.x;
      rs = st.y;
    } else {
      rs = rstd[row];
      cp_async_wait(stages - 1);
    }
    const float shift = -mu * rs;  // xhat = x * rs + shift

    // Pass 1: sum(g) and sum(g * xhat) with g = dout * gamma, and this row's share of the
    // parameter gradients.
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < kPpt; ++i) {
      const int p = t + i * T;
      if (owns<kFull>(p, packs)) {
        const Pairs xv = xs[p], dv = xs[packs + p];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float xf = h ? hi_float(xv.w[w]) : lo_float(xv.w[w]);
            const float dy = h ? hi_float(dv.w[w]) : lo_float(dv.w[w]);
            const float gm = h ? hi_float(g[i].w[w]) : lo_float(g[i].w[w]);
            const float xhat = fmaf(xf, rs, shift);
            const float gj = dy * gm;
            sg += gj;
            sgx = fmaf(gj, xhat, sgx);
            dgamma[i][2 * w + h] = fmaf(dy, xhat, dgamma[i][2 * w + h]);
            if (kLayerNorm) dbeta[i][2 * w + h] += dy;
          }
        }
      }
    }
    const float2 sums = block_sum2(make_float2(sg, sgx), scratch[parity]);
    parity ^= 1;

    // Pass 2: dx = rs * (g - mean(g) - xhat * mean(g * xhat)), which with xhat = x * rs + shift
    // is rs * g + x * k1 + k0: two FMAs an element. (Folding shift into k0 loses no more to
    // cancellation than xhat's own rounding of mean * rs does.)
    const float mean_g = kLayerNorm ? sums.x * inv_c : 0.0f;
    const float mean_gx = sums.y * inv_c;
    const float k1 = -rs * rs * mean_gx;
    const float k0 = -rs * fmaf(shift, mean_gx, mean_g);
    bf16* dxr = dx + row * C;
    if (accumulate_dx)
      write_dx<kPpt, kFull, true>(dxr, xs, g, rs, k0, k1, packs);
    else
      write_dx<kPpt, kFull, false>(dxr, xs, g, rs, k0, k1, packs);
  }

  if (cluster == 1) {
    // This block's partial sums: partials[0][block][:] = dgamma, partials[1][block][:] = dbeta.
    float* pg = partials + static_cast<int64_t>(blockIdx.x) * C;
    float* pb = partials + (G + blockIdx.x) * C;
#pragma unroll
    for (int i = 0; i < kPpt; ++i) {
      const int p = t + i * T;
      if (owns<kFull>(p, packs)) {
        store_floats8(pg + p * 8, dgamma[i]);
        if (kLayerNorm) store_floats8(pb + p * 8, dbeta[i]);
      }
    }
    return;
  }

  // A cluster's blocks add their sums through distributed shared memory and write one partial row
  // between them (partials[k][cluster][:]): cluster-size times fewer partial bytes written at the
  // end, when nothing else is left to overlap them, and read back by column_sums. Each block
  // leaves its sums in its own ring (no copy is in flight any more), then block r adds columns
  // r * T * 4 + ..., stride cluster * T * 4, over the cluster's blocks in rank order.
  cp_async_wait(0);
  __syncthreads();                               // every thread's ring reads are done
  float* sums = reinterpret_cast<float*>(smem);  // [outputs][C]
#pragma unroll
  for (int i = 0; i < kPpt; ++i) {
    const int p = t + i * T;
    if (owns<kFull>(p, packs)) {
      store_floats8(sums + p * 8, dgamma[i]);
      if (kLayerNorm) store_floats8(sums + C + p * 8, dbeta[i]);
    }
  }
  namespace cg = cooperative_groups;
  const cg::cluster_group group = cg::this_cluster();
  group.sync();  // every block's sums are visible to the cluster
  const int rank = static_cast<int>(group.block_rank());
  const int64_t parts = G / cluster, part = blockIdx.x / cluster;
  constexpr int kOutputs = kLayerNorm ? 2 : 1;
  for (int q = rank * T + t; q < kOutputs * C / 4; q += cluster * T) {
    float4 total = reinterpret_cast<const float4*>(group.map_shared_rank(sums, 0))[q];
    for (int k = 1; k < cluster; ++k) {
      const float4 v = reinterpret_cast<const float4*>(group.map_shared_rank(sums, k))[q];
      total.x += v.x;
      total.y += v.y;
      total.z += v.z;
      total.w += v.w;
    }
    const int output = q / (C / 4), column = q % (C / 4);
    reinterpret_cast<float4*>(partials + (output * parts + part) * C)[column] = total;
  }
  group.sync();  // no block leaves while another still reads its shared memory
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

// How a row is spread over threads: ppt packs per thread in {1, 2, 4, 8}, `threads` on the row
// (whole warps), full when they tile the row's packs exactly.
struct RowSplit {
  int ppt = 1, threads = 32;
  bool full = false;
};

// Smallest ppt that keeps a row on at most max_threads threads.
RowSplit split_row(int packs, int max_threads) {
  RowSplit s;
  while (ceil_div(packs, s.ppt) > max_threads) s.ppt *= 2;
  s.threads = ceil_div(ceil_div(packs, s.ppt), 32) * 32;
  s.full = s.threads * s.ppt == packs;
  return s;
}

// Calls f(std::integral_constant<int, ppt>{}) for a run-time ppt in {1, 2, 4, 8}, ppt <= kMaxPpt.
template <int kMaxPpt = kMaxPacksPerThread, typename F>
decltype(auto) with_ppt(int ppt, F&& f) {
  if constexpr (kMaxPpt > 1) {
    if (ppt <= kMaxPpt / 2) return with_ppt<kMaxPpt / 2>(ppt, f);
  }
  return f(std::integral_constant<int, kMaxPpt>{});
}

// Calls f(std::integral_constant<int, ppt>{}, std::bool_constant<full>{}) for a run-time split.
template <typename F>
decltype(auto) with_split(const RowSplit& s, F&& f) {
  return with_ppt(s.ppt, [&](auto P) {
    if (s.full) return f(P, std::true_type{});
    return f(P, std::false_type{});
  });
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

// Lets the backward use the device's whole opt-in shared memory, once per device: set-up that
// stays out of the launch path (and out of graph capture). Each instantiation owns its flags.
template <bool kLayerNorm, int kPpt, bool kFull>
auto backward_kernel(int device) {
  static std::once_flag done[kMaxDevices];
  const auto kernel = norm_backward_kernel<kLayerNorm, kPpt, kFull>;
  std::call_once(done[device], [&] {
    cudaFuncAttributes attr{};
    REPLAY_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    REPLAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           optin - static_cast<int>(attr.sharedSizeBytes)));
  });
  return kernel;
}

// Launch shape of the backward: `threads` per block, `blocks_per_sm` resident blocks on every SM
// (the grid is one wave of them), `stages` ring slots, clusters of `cluster` blocks that add their
// parameter-gradient sums before writing them (blocks / cluster partial rows an output).
struct RingPlan {
  RowSplit split;
  int blocks_per_sm = 0, blocks = 0, stages = 0, cluster = 1;
  size_t smem = 0;

  int parts() const { return blocks / cluster; }
};

// The launch configuration of the backward kernel: a programmatic dependent of the kernel before
// it, in clusters of plan.cluster blocks (the attributes' storage is `attrs`).
cudaLaunchConfig_t ring_config(const RingPlan& plan, cudaStream_t stream,
                               cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.blocks);
  config.blockDim = dim3(plan.split.threads);
  config.dynamicSmemBytes = plan.smem;
  config.stream = stream;
  attrs[0] = dependent_launch_attribute();
  attrs[1] = cudaLaunchAttribute{};
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = plan.cluster;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  config.attrs = attrs;
  config.numAttrs = plan.cluster > 1 ? 2 : 1;  // a cluster of one: no cluster attribute
  return config;
}

// The largest cluster (4 or 2 blocks) whose blocks' rings can hold their sums (`sums_bytes`) and
// whose clusters all fit on the device at once, with plan.blocks rounded up to a multiple of it
// (at most `resident` blocks); the plan unchanged (a cluster of 1) when none does.
template <typename Kernel>
RingPlan pick_cluster(Kernel kernel, const RingPlan& plan, int64_t resident, size_t sums_bytes) {
  if (plan.smem < sums_bytes) return plan;
  for (int cluster : {4, 2}) {
    RingPlan trial = plan;
    trial.cluster = cluster;
    trial.blocks = static_cast<int>(ceil_div(plan.blocks, cluster)) * cluster;
    if (trial.blocks > resident) continue;
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t config = ring_config(trial, nullptr, attrs);
    int clusters = 0;
    REPLAY_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
    if (static_cast<int64_t>(clusters) * cluster >= trial.blocks) return trial;
  }
  return plan;
}

// As many blocks per SM as registers and threads allow, each with enough slots to keep
// kInflightBytesPerSM in flight across the SM, within its share of the SM's shared memory; fewer
// blocks per SM when that is what gives each block two slots (a prefetched row). `sizing_bytes`
// sizes the blocks per SM (the grid, hence the workspace, must not depend on accumulate_dx);
// `slot_bytes` is the slot actually used; `sums_bytes` is what a block's parameter-gradient sums
// take in its ring when a cluster adds them. Depends only on the shape and the device, never on
// timing.
template <typename Kernel>
RingPlan plan_ring(Kernel kernel, int device, int64_t rows, const RowSplit& split,
                   size_t sizing_bytes, size_t slot_bytes, size_t sums_bytes) {
  RingPlan plan;
  plan.split = split;
  int by_registers = 0;
  REPLAY_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&by_registers, kernel, split.threads, 0));
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
  // The fewest blocks that walk no more rows each than `resident` blocks (one wave) would: 2048
  // rows on 132 SMs run 128 blocks of 16 rows, not 68 of 16 and 64 of 15, whose last row would
  // stream on 68 SMs, short of the device's bandwidth (measured: reports/RESULTS.md, The LayerNorm
  // backward).
  const int64_t resident = device_attribute(cudaDevAttrMultiProcessorCount, device) * int64_t{b};
  plan.blocks = static_cast<int>(ceil_div(rows, ceil_div(rows, resident)));
  return pick_cluster(kernel, plan, resident, sums_bytes);
}

template <bool kLayerNorm>
RingPlan plan_backward(int device, int64_t rows, int C, bool accumulate_dx) {
  RowSplit split = split_row(C / 8, kMaxBwdThreadsNarrow);
  if (split.threads > bwd_max_threads(split.ppt)) split = split_row(C / 8, kMaxBwdThreads);
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(bf16);
  const size_t stats_bytes = ring_stats_bytes(kLayerNorm, split.threads);
  return with_split(split, [&](auto P, auto full) {
    return plan_ring(backward_kernel<kLayerNorm, P.value, full.value>(device), device, rows, split,
                     2 * row_bytes + stats_bytes, (accumulate_dx ? 3 : 2) * row_bytes + stats_bytes,
                     (kLayerNorm ? 2 : 1) * static_cast<size_t>(C) * sizeof(float));
  });
}

template <bool kLayerNorm>
size_t backward_workspace_bytes(int64_t rows, int C) {
  check_shape(rows, C);
  // Sized for one partial row a block: enough whether or not a cluster adds them (which depends on
  // accumulate_dx through the ring's size).
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
  const float inv_c = 1.0f / static_cast<float>(C);
  if (packs <= kWarpRowMaxPacks) {  // one warp per row
    const int ppt = packs <= 32 ? 1 : packs <= 64 ? 2 : 4;
    const int64_t blocks = ceil_div<int64_t>(rows, kWarpRowsPerBlock);
    with_ppt<4>(ppt, [&](auto P) {
      launch_dependent(norm_forward_warp_kernel<kLayerNorm, P.value>,
                       dim3(static_cast<unsigned>(blocks)), dim3(32 * kWarpRowsPerBlock), stream,
                       out, mean, rstd, x, gamma, beta, rows, C, inv_c, eps);
      REPLAY_LAUNCH_CHECK();
    });
    return;
  }
  const RowSplit split = split_row(packs, kMaxRowThreads);
  with_ppt(split.ppt, [&](auto P) {
    launch_dependent(norm_forward_block_kernel<kLayerNorm, P.value>,
                     dim3(static_cast<unsigned>(rows)), dim3(split.threads), stream, out, mean,
                     rstd, x, gamma, beta, C, inv_c, eps);
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
  const size_t needed = static_cast<size_t>(kOutputs) * plan.parts() * C * sizeof(float);
  REPLAY_REQUIRE(workspace != nullptr && workspace_bytes >= needed,
                 "norm backward workspace too small: " + std::to_string(workspace_bytes) + " < " +
                     std::to_string(needed));
  float* partials = static_cast<float*>(workspace);
  const float inv_c = 1.0f / static_cast<float>(C);
  with_split(plan.split, [&](auto P, auto full) {
    const auto kernel = backward_kernel<kLayerNorm, P.value, full.value>(device);
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t config = ring_config(plan, stream, attrs);
    REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, dx, partials, dout, x, gamma, mean, rstd,
                                         rows, C, inv_c, plan.stages, plan.cluster, accumulate_dx));
    REPLAY_LAUNCH_CHECK();
  });
  column_sums(kOutputs, dgamma, dbeta, partials, plan.parts(), C, accumulate_param_grads, stream);
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
