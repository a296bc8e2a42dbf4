// rows_kernels.cuh: rows.cu's kernels, shared with rows2.cu: a block a row walking it with U
// packs a thread (MEAN 1: the last block to finish sums the row losses), and the one-block mean.
#pragma once
#include "probe.cuh"

// MEAN: 0 none (row losses only), 1 last block sums the row losses (ticket)
template <int U, int MEAN>
__global__ void __launch_bounds__(256) rows_k(float* __restrict__ stats, float* __restrict__ row_loss, float* mean, int* count, unsigned* ticket,
    const bf16* __restrict__ logits, const int32_t* __restrict__ targets, long rows, long width) {
  __shared__ float2 wst[8]; __shared__ float tl; __shared__ bool last; __shared__ float scratch[32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const long r = blockIdx.x; const int t = threadIdx.x, T = blockDim.x;
  const uint4* body = reinterpret_cast<const uint4*>(logits + r * width);  // aligned rows only (probe)
  const long packs = width / 8;
  const int32_t target = targets[r];
  const long local = target;  // vocab_start 0
  const bool held = target >= 0 && local < width;
  const long tp = held ? local / 8 : -1; const int tk = int(local % 8);
  float m = -INFINITY, s = 0.f;
  for (long base = t; base < packs; base += long(U) * T) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { const long p = base + u * T; x[u] = p < packs ? __ldcs(body + p) : make_uint4(kNI, kNI, kNI, kNI); }
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * T == tp) tl = pack_el(x[u], tk);
    add_chunk(x, m, s);
  }
  const float2 rs = block_stats(m, s, wst);
  if (t == 0) {
    const float tlg = held ? tl : 0.f;
    stats[r] = rs.x; stats[rows + r] = rs.y; stats[2 * rows + r] = tlg;
    row_loss[r] = target < 0 ? 0.f : (rs.x - tlg) + logf(rs.y);
    if (MEAN == 1) { __threadfence(); last = atomicAdd(ticket, 1u) == unsigned(rows - 1); }
  }
  if (MEAN == 0) return;
  __syncthreads();
  if (!last) return;
  __threadfence();
  float sum = 0.f, counted = 0.f;
  for (long b = t; b < rows; b += 4L * T) {
    float l[4], c[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { const long q = b + u * T; const bool in = q < rows; const bool cnt = in && targets[q] >= 0; l[u] = in ? __ldcg(row_loss + q) : 0.f; c[u] = cnt ? 1.f : 0.f; }
    sum += (l[0] + l[1]) + (l[2] + l[3]); counted += (c[0] + c[1]) + (c[2] + c[3]);
  }
  sum = block_reduce_sum(sum, scratch); counted = block_reduce_sum(counted, scratch);
  if (t == 0) { *count = int(counted); *mean = counted > 0 ? sum / counted : 0.f; *ticket = 0u; }
}
// The one-block dependent mean (as the tree's, 512 threads).
__global__ void __launch_bounds__(512) mean_k(float* mean, int* count, const float* row_loss, const int32_t* targets, long rows) {
  __shared__ float scratch[32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory");
  const int T = 512; float sum = 0.f, counted = 0.f;
  for (long b = threadIdx.x; b < rows; b += 4L * T) {
    float l[4], c[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { const long q = b + u * T; const bool in = q < rows; const bool cnt = in && targets[q] >= 0; l[u] = in ? row_loss[q] : 0.f; c[u] = cnt ? 1.f : 0.f; }
    sum += (l[0] + l[1]) + (l[2] + l[3]); counted += (c[0] + c[1]) + (c[2] + c[3]);
  }
  sum = block_reduce_sum(sum, scratch); counted = block_reduce_sum(counted, scratch);
  if (threadIdx.x == 0) { *count = int(counted); *mean = counted > 0 ? sum / counted : 0.f; }
}
