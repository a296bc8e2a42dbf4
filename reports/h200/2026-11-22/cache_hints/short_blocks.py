# Replaces the tree's dropout backward (one wave of persistent blocks walking row runs) with short blocks:
# 32 packs x KL lanes, each thread KR rows in one batch (loads, then masks, then stores), a block's dbias
# partial summed over its lanes in shared memory; many blocks, scheduled as they free up.
# usage: short_blocks.py SRC OUT [late|byval]: "late" builds the Philox stream after the batch's loads; "byval" is a
# diagnostic that never reads the RNG slot (seed 1234, offset 0: not a valid replay kernel).
import sys
src = open(sys.argv[1]).read()
a = src.index("// Block (x, y) covers packs [x * blockDim.x, ...) of rows [y * rows_per_group, ...), which its")
b = src.index("bool aligned16")
kernel = r'''
#ifndef KR
#define KR 4
#endif
#ifndef KL
#define KL 8
#endif
#ifndef KST
#define KST 0
#endif
constexpr int kShortR = KR, kShortL = KL;
__global__ void __launch_bounds__(32 * kShortL, (1024 + 32 * kShortL - 1) / (32 * kShortL))
    short_backward_kernel(bf16* dx, float* __restrict__ partials, const bf16* dout, int64_t rows, int C,
                          uint32_t threshold, float scale, RngArgs rng) {
  __shared__ float4 sums[kShortL][32][2];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int p = blockIdx.x * 32 + threadIdx.x, lane = threadIdx.y;
  const bool owns = p < C / 8;
  const int64_t r_begin = int64_t(blockIdx.y) * (kShortR * kShortL) + lane * kShortR;
  const int64_t r_end = min(rows, r_begin + kShortR);
  const Philox philox = launch_philox(rng, threshold);
  float acc[8] = {};
  if (owns && r_begin < rows) {
    for_row_batches<kShortR>(r_begin, r_end, [&](auto batch, int64_t r0) {
      constexpr int kRows = decltype(batch)::value;
      PackBF16 d[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) d[u] = PackBF16::load_cs(dout + (r0 + u) * C + p * 8);
      uint32_t keep[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u)
        keep[u] = threshold != 0 ? philox.keep_bits((r0 + u) * C + p * 8, threshold) : ~0u;
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        PackBF16 o;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float v = __bfloat162float(d[u].v[j]);
          if (threshold != 0) v = (keep[u] >> j) & 1u ? v * scale : 0.0f;
          acc[j] += v;
          o.v[j] = __float2bfloat16_rn(v);
        }
        if (KST) __stcs(reinterpret_cast<int4*>(dx + (r0 + u) * C + p * 8), *reinterpret_cast<const int4*>(o.v));
        else o.store(dx + (r0 + u) * C + p * 8);
      }
    });
  }
  if (partials == nullptr) return;
  sums[lane][threadIdx.x][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  sums[lane][threadIdx.x][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  __syncthreads();
  // Lane 0 and 1 (when there are two) add the lanes' float4 halves in lane order.
  if (lane >= 2 || !owns) return;
  float4 s = sums[0][threadIdx.x][lane];
#pragma unroll
  for (int l = 1; l < kShortL; ++l) {
    const float4 t = sums[l][threadIdx.x][lane];
    s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
  }
  reinterpret_cast<float4*>(partials + int64_t(blockIdx.y) * C + p * 8)[lane] = s;
}

'''
src = src[:a] + kernel + src[b:]
# workspace and launcher
a = src.index("size_t dropout_residual_backward_workspace_bytes")
src = src[:a] + r'''size_t dropout_residual_backward_workspace_bytes(int64_t rows, int C) {
  return static_cast<size_t>(ceil_div<int64_t>(rows, kShortR * kShortL)) * C * sizeof(float);
}

void dropout_residual_backward(bf16* dx, float* dbias, const bf16* dout, int64_t rows, int C,
                               float p, RngArgs rng, bool accumulate_dbias, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  check_args(rows, C, p, rng);
  const int groups = static_cast<int>(ceil_div<int64_t>(rows, kShortR * kShortL));
  float* partials = dbias ? static_cast<float*>(workspace) : nullptr;
  launch_dependent(short_backward_kernel, dim3(ceil_div(C / 8, 32), groups), dim3(32, kShortL), stream, dx,
                   partials, dout, rows, C, dropout_threshold(p), 1.0f / (1.0f - p), rng);
  REPLAY_LAUNCH_CHECK();
  if (dbias) column_sums(1, dbias, nullptr, partials, groups, C, accumulate_dbias, stream);
}

}  // namespace replay
'''
mode = sys.argv[3] if len(sys.argv) > 3 else ""
a = """  const Philox philox = launch_philox(rng, threshold);
  float acc[8] = {};
  if (owns && r_begin < rows) {
    for_row_batches<kShortR>(r_begin, r_end, [&](auto batch, int64_t r0) {
      constexpr int kRows = decltype(batch)::value;
      PackBF16 d[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) d[u] = PackBF16::load_cs(dout + (r0 + u) * C + p * 8);
"""
assert a in src
if mode == "late":
    src = src.replace(a, a.replace("  const Philox philox = launch_philox(rng, threshold);\n", "", 1)
                      + "      const Philox philox = launch_philox(rng, threshold);\n")
elif mode == "byval":
    src = src.replace(a, a.replace("launch_philox(rng, threshold)", "threshold == 0 ? Philox(0, 0) : Philox(1234, 0)"))
open(sys.argv[2], "w").write(src)
