// dispatch.cu: the expert-sorting counting sort, gather, combine and their backward (see
// dispatch.h).
//
// The sort splits the assignments into chunks of kChunk consecutive ones, one warp each:
//   1. chunk_histogram_kernel: each warp counts its chunk per expert in its own shared-memory row
//      (integer atomics: the counts do not depend on their order) -> counts[chunk, e].
//   2. scan_kernel, one block, thread e: walks the chunks in order, replacing each count by the
//      number of e's assignments in earlier chunks, which leaves e's total; then kept counts,
//      offsets (an exclusive block scan over experts in dropless mode, e * C with a capacity) and
//      the dropped total.
//   3. rank_kernel: each warp walks its chunk again 32 assignments at a time, in order. Lanes with
//      the same expert find each other with __match_any_sync; a lane's rank is its expert's
//      running count plus its same-expert lanes below it, and the lowest of them advances the
//      count. So rank = the number of earlier assignments to that expert, exactly what the stable
//      order defines, independent of scheduling. The same grid then marks the padding rows.
// The data kernels take one warp per token (gather, combine, gather backward) or per assignment
// (combine backward), in 16-byte packs of 8 bf16 with fp32 arithmetic; a token's k rows and weights
// go through shared memory so that every lane can read them while some have run out of packs.
#include "workloads/moe/dispatch.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // ceil_div, warp_reduce_sum, block_sum_once
#include "workloads/moe/router.h"   // kMoeMaxExperts, kMoeMaxTopk

namespace replay::moe {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 512;  // assignments a warp sorts
constexpr int kWarps = 8;    // warps (chunks, rows or tokens) per block
constexpr int kThreads = 32 * kWarps;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kPadRowsPerThread = 8;  // rank_kernel's padding pass

int64_t chunk_count(const DispatchShape& s) {
  return ceil_div<int64_t>(s.assignments(), kChunk);
}

__global__ void __launch_bounds__(kThreads)
    chunk_histogram_kernel(int32_t* __restrict__ chunk_counts, const int32_t* __restrict__ indices,
                           int64_t assignments, int64_t chunks, int E) {
  __shared__ int32_t hist[kWarps][kMoeMaxExperts];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t chunk = int64_t{blockIdx.x} * kWarps + warp;
  if (chunk >= chunks) return;  // a whole warp
  int32_t* h = hist[warp];
  for (int e = lane; e < E; e += 32) h[e] = 0;
  __syncwarp();
  const int64_t a0 = chunk * kChunk, a1 = min(a0 + kChunk, assignments);
  for (int64_t a = a0 + lane; a < a1; a += 32) {
    const int32_t v = indices[a];
    if (v >= 0 && v < E) atomicAdd(&h[v], 1);
  }
  __syncwarp();
  for (int e = lane; e < E; e += 32) chunk_counts[chunk * E + e] = h[e];
}

// Exclusive scan of v over the block (blockDim.x a multiple of 32, at most 1024); `scratch`
// holds 32 ints. Returns the sum of the lower threads' values; *total receives the block's sum.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t v, int32_t* scratch,
                                                        int32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t up = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int32_t warp_base = 0, sum = 0;
  for (int w = 0; w < warps; ++w) {
    if (w == warp) warp_base = sum;
    sum += scratch[w];
  }
  *total = sum;
  return warp_base + inclusive - v;
}

__global__ void scan_kernel(DispatchIndex out, int32_t* __restrict__ chunk_counts, int64_t chunks,
                            int E, bool capacity_mode, int32_t capacity) {
  __shared__ int32_t scratch[32];
  __shared__ int32_t drop_scratch[32];
  const int e = threadIdx.x;
  int32_t routed = 0;
  if (e < E) {
#pragma unroll 8
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = chunk_counts[c * E + e];
      chunk_counts[c * E + e] = routed;
      routed += v;
    }
  }
  const int32_t kept = capacity_mode ? min(routed, capacity) : routed;
  int32_t total = 0;
  const int32_t offset = block_exclusive_scan(kept, scratch, &total);
  const int32_t dropped = block_sum_once(routed - kept, drop_scratch);
  if (e < E) {
    out.routed_counts[e] = routed;
    out.expert_counts[e] = kept;
    out.expert_offsets[e] = capacity_mode ? e * capacity : offset;
  }
  if (e == 0) {
    out.expert_offsets[E] = capacity_mode ? E * capacity : total;
    out.dropped[0] = dropped;
  }
}

__global__ void __launch_bounds__(kThreads)
    rank_kernel(DispatchIndex out, const int32_t* __restrict__ chunk_base,
                const int32_t* __restrict__ indices, int64_t assignments, int64_t chunks, int E,
                bool capacity_mode, int32_t capacity, int64_t rows) {
  __shared__ int32_t running[kWarps][kMoeMaxExperts];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t chunk = int64_t{blockIdx.x} * kWarps + warp;
  if (chunk < chunks) {
    int32_t* run = running[warp];
    for (int e = lane; e < E; e += 32) run[e] = chunk_base[chunk * E + e];
    __syncwarp();
    const uint32_t below = (1u << lane) - 1u;
    const int64_t a0 = chunk * kChunk, a1 = min(a0 + kChunk, assignments);
    for (int64_t base = a0; base < a1; base += 32) {
      const int64_t a = base + lane;
      const int32_t v = a < a1 ? indices[a] : -1;
      const bool valid = v >= 0 && v < E;
      // Out-of-range lanes get keys of their own, so that they group with nobody.
      const uint32_t peers = __match_any_sync(kFull, valid ? v : E + lane);
      const int32_t rank = valid ? run[v] + __popc(peers & below) : 0;
      __syncwarp();  // every lane has read its count before the lowest of its group moves it
      if (valid && (peers & below) == 0) run[v] += __popc(peers);
      __syncwarp();
      if (a < a1) {
        int32_t row = -1;
        if (valid) {
          if (capacity_mode)
            row = rank < capacity ? v * capacity + rank : -1;
          else
            row = out.expert_offsets[v] + rank;
        }
        out.slot_row[a] = row;
        if (row >= 0) out.row_source[row] = static_cast<int32_t>(a);
      }
    }
  }
  if (capacity_mode) {  // padding rows (disjoint from the kept rows written above)
    const int64_t stride = int64_t{gridDim.x} * blockDim.x;
    for (int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; row < rows; row += stride)
      if (row % capacity >= out.expert_counts[row / capacity]) out.row_source[row] = -1;
  }
}

// ---------------------------------------------------------------------------------------------------
// Data kernels.

__device__ __forceinline__ void unpack8(const uint4& w, float (&v)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

constexpr int kCopyUnroll = 4;  // packs a lane has in flight while copying a row

// Token-major: one warp per token reads x[t] once and stores it to each of its kept rows, so the
// tokens are read once rather than once a copy (the row-major gather, one warp per sorted row,
// read 8 copies of a 58 MB x that L2 cannot hold: 283 us at DeepSeek-V3 sizes on an H100).
// Blocks [token_blocks, ...) zero the padding rows (capacity mode).
__global__ void __launch_bounds__(kThreads)
    gather_kernel(bf16* __restrict__ x_sorted, const bf16* __restrict__ x,
                  const int32_t* __restrict__ slot_row, const int32_t* __restrict__ row_source,
                  int64_t tokens, int64_t token_blocks, int64_t rows, int topk, int64_t hidden) {
  __shared__ int32_t rows_s[kWarps][kMoeMaxTopk];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t packs = hidden / 8;
  if (blockIdx.x >= token_blocks) {
    const int64_t row = (int64_t{blockIdx.x} - token_blocks) * kWarps + warp;
    if (row >= rows || row_source[row] >= 0) return;
    uint4* dst = reinterpret_cast<uint4*>(x_sorted + row * hidden);
    for (int64_t p = lane; p < packs; p += 32) dst[p] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;
  if (lane < topk) rows_s[warp][lane] = slot_row[t * topk + lane];
  __syncwarp();
  const uint4* src = reinterpret_cast<const uint4*>(x + t * hidden);
  for (int64_t p0 = lane; p0 < packs; p0 += 32 * kCopyUnroll) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (p0 + 32 * u < packs) v[u] = src[p0 + 32 * u];
    for (int j = 0; j < topk; ++j) {
      const int32_t row = rows_s[warp][j];
      if (row < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(x_sorted + int64_t{row} * hidden);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u)
        if (p0 + 32 * u < packs) dst[p0 + 32 * u] = v[u];
    }
  }
}

// One warp per token: out[t] = base + sum over kept slots in order of w_j * src[row_j].
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(bf16* __restrict__ out, const bf16* __restrict__ src_sorted,
                   const float* __restrict__ weights, const int32_t* __restrict__ slot_row,
                   int64_t tokens, int topk, int64_t hidden, bool accumulate) {
  __shared__ int32_t rows_s[kWarps][kMoeMaxTopk];
  __shared__ float weights_s[kWarps][kMoeMaxTopk];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;
  if (lane < topk) {
    rows_s[warp][lane] = slot_row[t * topk + lane];
    weights_s[warp][lane] = kWeighted ? weights[t * topk + lane] : 1.0f;
  }
  __syncwarp();
  const int64_t packs = hidden / 8;
  uint4* o = reinterpret_cast<uint4*>(out + t * hidden);
  for (int64_t p = lane; p < packs; p += 32) {
    float acc[8];
    if (accumulate) {
      unpack8(o[p], acc);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    }
#pragma unroll 4
    for (int j = 0; j < topk; ++j) {
      const int32_t row = rows_s[warp][j];
      if (row < 0) continue;
      float v[8];
      unpack8(reinterpret_cast<const uint4*>(src_sorted + int64_t{row} * hidden)[p], v);
      const float w = weights_s[warp][j];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = kWeighted ? fmaf(w, v[i], acc[i]) : acc[i] + v[i];
    }
    o[p] = pack8(acc);
  }
}

// Blocks [0, assignment_blocks): one warp per assignment; the rest: one warp per row, zeroing the
// padding rows (capacity mode only).
__global__ void __launch_bounds__(kThreads)
    combine_backward_kernel(bf16* __restrict__ dy_sorted, float* __restrict__ dweights,
                            const bf16* __restrict__ dout, const bf16* __restrict__ y_sorted,
                            const float* __restrict__ weights, const int32_t* __restrict__ slot_row,
                            const int32_t* __restrict__ row_source, int64_t assignments,
                            int64_t assignment_blocks, int64_t rows, int topk, int64_t hidden) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t packs = hidden / 8;
  if (blockIdx.x >= assignment_blocks) {
    const int64_t row = (int64_t{blockIdx.x} - assignment_blocks) * kWarps + warp;
    if (row >= rows || row_source[row] >= 0) return;
    uint4* dst = reinterpret_cast<uint4*>(dy_sorted + row * hidden);
    for (int64_t p = lane; p < packs; p += 32) dst[p] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t a = int64_t{blockIdx.x} * kWarps + warp;
  if (a >= assignments) return;
  const int32_t row = slot_row[a];
  if (row < 0) {
    if (lane == 0) dweights[a] = 0.0f;
    return;
  }
  const float w = weights[a];
  const uint4* d = reinterpret_cast<const uint4*>(dout + (a / topk) * hidden);
  const uint4* y = reinterpret_cast<const uint4*>(y_sorted + int64_t{row} * hidden);
  uint4* dy = reinterpret_cast<uint4*>(dy_sorted + int64_t{row} * hidden);
  float dot = 0.0f;
  for (int64_t p0 = lane; p0 < packs; p0 += 32 * kCopyUnroll) {
    uint4 dv[kCopyUnroll], yv[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (p0 + 32 * u < packs) {
        dv[u] = d[p0 + 32 * u];
        yv[u] = y[p0 + 32 * u];
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (p0 + 32 * u >= packs) continue;
      float df[8], yf[8], g[8];
      unpack8(dv[u], df);
      unpack8(yv[u], yf);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        dot = fmaf(yf[i], df[i], dot);
        g[i] = w * df[i];
      }
      dy[p0 + 32 * u] = pack8(g);
    }
  }
  dot = warp_reduce_sum(dot);
  if (lane == 0) dweights[a] = dot;
}

// ---------------------------------------------------------------------------------------------------
// Host side.

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// One warp per destination row: the source row by the layout formulas, or zeros past the count.
__global__ void __launch_bounds__(kThreads)
    ep_permute_kernel(bf16* __restrict__ out, const bf16* __restrict__ in,
                      const int32_t* __restrict__ counts, int ranks, int local_experts, int64_t cap,
                      int64_t hidden, bool to_local) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = int64_t{blockIdx.x} * kWarps + warp;
  const int64_t rows = static_cast<int64_t>(ranks) * local_experts * cap;
  if (row >= rows) return;
  // Decompose the destination row into (source s, local expert l, row i).
  const int64_t i = row % cap, block = row / cap;
  int s, l;
  if (to_local) {
    l = static_cast<int>(block / ranks);
    s = static_cast<int>(block % ranks);
  } else {
    s = static_cast<int>(block / local_experts);
    l = static_cast<int>(block % local_experts);
  }
  const int64_t src =
      to_local ? ep_send_row(s, l, i, local_experts, cap) : ep_local_row(s, l, i, ranks, cap);
  const bool kept = i < counts[s * local_experts + l];
  const int64_t packs = hidden / 8;
  uint4* dst = reinterpret_cast<uint4*>(out + row * hidden);
  const uint4* from = reinterpret_cast<const uint4*>(in + src * hidden);
  for (int64_t p = lane; p < packs; p += 32) dst[p] = kept ? from[p] : make_uint4(0, 0, 0, 0);
}

void check_hidden(int64_t hidden, int64_t rows) {
  REPLAY_REQUIRE(hidden >= 8 && hidden % 8 == 0,
                 "hidden must be a positive multiple of 8, got " + std::to_string(hidden));
  REPLAY_REQUIRE(rows * hidden / 8 < (int64_t{1} << 40), "dispatch buffer too large");
}

unsigned warp_blocks(int64_t warps) {
  const int64_t blocks = ceil_div<int64_t>(warps, kWarps);
  REPLAY_REQUIRE(blocks < INT32_MAX, "dispatch grid too large");
  return static_cast<unsigned>(blocks);
}

}  // namespace

int64_t moe_capacity(double factor, int64_t tokens, int topk, int experts) {
  REPLAY_REQUIRE(std::isfinite(factor) && factor > 0.0, "the capacity factor must be positive");
  REPLAY_REQUIRE(tokens >= 1 && topk >= 1 && experts >= 1, "moe_capacity needs positive sizes");
  const double exact = factor * static_cast<double>(tokens * topk) / static_cast<double>(experts);
  const auto c = static_cast<int64_t>(std::ceil(exact - 1e-9));
  return std::min(std::max<int64_t>(c, 1), tokens);
}

void check_dispatch_shape(const DispatchShape& s) {
  REPLAY_REQUIRE(s.experts >= 1 && s.experts <= kMoeMaxExperts,
                 "experts must be in [1, 512], got " + std::to_string(s.experts));
  REPLAY_REQUIRE(s.topk >= 1 && s.topk <= kMoeMaxTopk && s.topk <= s.experts,
                 "topk must be in [1, min(32, experts)], got " + std::to_string(s.topk));
  REPLAY_REQUIRE(s.tokens >= 1 && s.assignments() < INT32_MAX,
                 "tokens * topk must be in [1, 2^31), got " + std::to_string(s.assignments()));
  if (s.mode == DispatchMode::kCapacity)
    REPLAY_REQUIRE(s.capacity >= 1 && s.rows() < INT32_MAX,
                   "the capacity must be positive with experts * capacity below 2^31, got " +
                       std::to_string(s.capacity));
}

size_t moe_dispatch_workspace_bytes(const DispatchShape& shape) {
  check_dispatch_shape(shape);
  return static_cast<size_t>(chunk_count(shape) * shape.experts) * sizeof(int32_t);
}

void moe_dispatch_index(const DispatchIndex& out, const int32_t* indices,
                        const DispatchShape& shape, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  check_dispatch_shape(shape);
  REPLAY_REQUIRE(out.routed_counts && out.expert_counts && out.expert_offsets && out.slot_row &&
                     out.row_source && out.dropped && indices != nullptr,
                 "moe_dispatch_index needs every output and the indices");
  REPLAY_REQUIRE(
      workspace != nullptr && aligned16(workspace) &&
          workspace_bytes >= moe_dispatch_workspace_bytes(shape),
      "dispatch workspace missing, misaligned or too small: " + std::to_string(workspace_bytes) +
          " < " + std::to_string(moe_dispatch_workspace_bytes(shape)));
  auto* chunk_counts = static_cast<int32_t*>(workspace);
  const int64_t chunks = chunk_count(shape);
  const bool capacity_mode = shape.mode == DispatchMode::kCapacity;
  const auto capacity = static_cast<int32_t>(capacity_mode ? shape.capacity : 0);
  const int E = shape.experts;
  chunk_histogram_kernel<<<warp_blocks(chunks), kThreads, 0, stream>>>(
      chunk_counts, indices, shape.assignments(), chunks, E);
  REPLAY_LAUNCH_CHECK();
  scan_kernel<<<1, static_cast<int>(ceil_div(E, 32)) * 32, 0, stream>>>(out, chunk_counts, chunks,
                                                                        E, capacity_mode, capacity);
  REPLAY_LAUNCH_CHECK();
  unsigned blocks = warp_blocks(chunks);
  if (capacity_mode)
    blocks = std::max<unsigned>(blocks, static_cast<unsigned>(ceil_div<int64_t>(
                                            shape.rows(), kThreads * kPadRowsPerThread)));
  rank_kernel<<<blocks, kThreads, 0, stream>>>(out, chunk_counts, indices, shape.assignments(),
                                               chunks, E, capacity_mode, capacity, shape.rows());
  REPLAY_LAUNCH_CHECK();
}

void moe_gather(bf16* x_sorted, const bf16* x, const int32_t* slot_row, const int32_t* row_source,
                const DispatchShape& shape, int64_t hidden, cudaStream_t stream) {
  check_dispatch_shape(shape);
  check_hidden(hidden, shape.rows());
  REPLAY_REQUIRE(aligned16(x_sorted) && aligned16(x) && x && x_sorted && slot_row && row_source,
                 "moe_gather needs 16-byte aligned x and x_sorted, slot_row and row_source");
  const int64_t token_blocks = warp_blocks(shape.tokens);
  const int64_t pad_blocks = shape.mode == DispatchMode::kCapacity ? warp_blocks(shape.rows()) : 0;
  gather_kernel<<<static_cast<unsigned>(token_blocks + pad_blocks), kThreads, 0, stream>>>(
      x_sorted, x, slot_row, row_source, shape.tokens, token_blocks, shape.rows(), shape.topk,
      hidden);
  REPLAY_LAUNCH_CHECK();
}

void moe_gather_backward(bf16* dx, const bf16* dx_sorted, const int32_t* slot_row,
                         const DispatchShape& shape, int64_t hidden, bool accumulate,
                         cudaStream_t stream) {
  check_dispatch_shape(shape);
  check_hidden(hidden, shape.rows());
  REPLAY_REQUIRE(aligned16(dx) && aligned16(dx_sorted) && dx && dx_sorted && slot_row,
                 "moe_gather_backward needs 16-byte aligned dx and dx_sorted and slot_row");
  combine_kernel<false><<<warp_blocks(shape.tokens), kThreads, 0, stream>>>(
      dx, dx_sorted, nullptr, slot_row, shape.tokens, shape.topk, hidden, accumulate);
  REPLAY_LAUNCH_CHECK();
}

void moe_combine(bf16* out, const bf16* y_sorted, const float* weights, const int32_t* slot_row,
                 const DispatchShape& shape, int64_t hidden, bool accumulate, cudaStream_t stream) {
  check_dispatch_shape(shape);
  check_hidden(hidden, shape.rows());
  REPLAY_REQUIRE(aligned16(out) && aligned16(y_sorted) && out && y_sorted && weights && slot_row,
                 "moe_combine needs 16-byte aligned out and y_sorted, weights and slot_row");
  combine_kernel<true><<<warp_blocks(shape.tokens), kThreads, 0, stream>>>(
      out, y_sorted, weights, slot_row, shape.tokens, shape.topk, hidden, accumulate);
  REPLAY_LAUNCH_CHECK();
}

void moe_combine_backward(bf16* dy_sorted, float* dweights, const bf16* dout, const bf16* y_sorted,
                          const float* weights, const int32_t* slot_row, const int32_t* row_source,
                          const DispatchShape& shape, int64_t hidden, cudaStream_t stream) {
  check_dispatch_shape(shape);
  check_hidden(hidden, shape.rows());
  REPLAY_REQUIRE(aligned16(dy_sorted) && aligned16(dout) && aligned16(y_sorted) && dy_sorted &&
                     dout && y_sorted && dweights && weights && slot_row && row_source,
                 "moe_combine_backward needs 16-byte aligned dy_sorted, dout and y_sorted, and "
                 "dweights, weights, slot_row and row_source");
  const int64_t assignment_blocks = warp_blocks(shape.assignments());
  const int64_t pad_blocks = shape.mode == DispatchMode::kCapacity ? warp_blocks(shape.rows()) : 0;
  combine_backward_kernel<<<static_cast<unsigned>(assignment_blocks + pad_blocks), kThreads, 0,
                            stream>>>(dy_sorted, dweights, dout, y_sorted, weights, slot_row,
                                      row_source, shape.assignments(), assignment_blocks,
                                      shape.rows(), shape.topk, hidden);
  REPLAY_LAUNCH_CHECK();
}

void moe_ep_permute(bf16* out, const bf16* in, const int32_t* counts, const EpLayout& layout,
                    int64_t hidden, bool to_local, cudaStream_t stream) {
  REPLAY_REQUIRE(layout.ranks >= 1 && layout.local_experts >= 1 && layout.capacity >= 1,
                 "moe_ep_permute needs positive ranks, local experts and capacity");
  check_hidden(hidden, layout.rows());
  REPLAY_REQUIRE(out && in && counts && aligned16(out) && aligned16(in) && out != in,
                 "moe_ep_permute needs 16-byte aligned, distinct out and in, and the counts");
  ep_permute_kernel<<<warp_blocks(layout.rows()), kThreads, 0, stream>>>(
      out, in, counts, layout.ranks, layout.local_experts, layout.capacity, hidden, to_local);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::moe
