# slabs.py SRC OUT: row_order.py's output with the dropout backward in column slabs (-DSLAB=S, -DSLAB_THREADS=T):
# block b owns packs [b S, (b + 1) S) of every row, so no other block adds to its dbias columns. Its T threads are
# (pack j = t % S, lane l = t / S), L = T / S lanes; lane l walks rows l, l + L, l + 2L, ... in batches of 4 (the
# Philox mask and dx as before). At the end the lanes' dbias sums go to shared memory, eight groups of threads add
# lanes g, g + 8, ... in order, then lanes' groups 0..7 in order, and the block writes its dbias columns itself: no
# partial rows and no column_sums kernel. Blocks of T <= 1024 threads, 1024 / T of them an SM.
import sys
s = open(sys.argv[1]).read()
def sub(old, new, count=1):
    global s
    assert s.count(old) == count, (s.count(old), old[:70])
    s = s.replace(old, new)
kernel = r'''
template <int kSlab, int kT>
__global__ void __launch_bounds__(kT, 1024 / kT)
    dropout_slab_backward_kernel(bf16* dx, float* __restrict__ dbias, const bf16* dout, int64_t rows, int C,
                                 uint32_t threshold, float scale, RngArgs rng, bool accumulate) {
  constexpr int kLanes = kT / kSlab, kCols = kSlab * 8, kGroups = 8;
  __shared__ float lane_sums[kLanes * kCols];
  __shared__ float group_sums[kGroups * kCols];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int j = threadIdx.x % kSlab, lane = threadIdx.x / kSlab;
  const int p = blockIdx.x * kSlab + j;
  const bool owns = p < C / 8 && lane < kLanes;
  const Philox philox = launch_philox(rng, threshold);
  float acc[8] = {};
  if (owns) {
    const int64_t stride = kLanes;
    walk_rows<kBwdRowBatch>(lane, lane < rows ? (rows - lane + kLanes - 1) / kLanes : 0, stride,
                            [&](auto batch, int64_t r0) {
      constexpr int kRows = decltype(batch)::value;
      PackBF16 d[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) d[u] = PackBF16::load_cg(dout + (r0 + u * stride) * C + p * 8);
      uint32_t keep[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u)
        keep[u] = threshold != 0 ? philox.keep_bits((r0 + u * stride) * C + p * 8, threshold) : ~0u;
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        PackBF16 o;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float v = __bfloat162float(d[u].v[k]);
          if (threshold != 0) v = (keep[u] >> k) & 1u ? v * scale : 0.0f;
          acc[k] += v;
          o.v[k] = __float2bfloat16_rn(v);
        }
        o.store(dx + (r0 + u * stride) * C + p * 8);
      }
    });
  }
  if (dbias == nullptr) return;
  if (lane < kLanes) {
#pragma unroll
    for (int k = 0; k < 8; ++k) lane_sums[lane * kCols + j * 8 + k] = acc[k];
  }
  __syncthreads();
  if (threadIdx.x < kGroups * kCols) {
    const int c = threadIdx.x % kCols, g = threadIdx.x / kCols;
    float s = 0.0f;
    for (int l = g; l < kLanes; l += kGroups) s += lane_sums[l * kCols + c];
    group_sums[g * kCols + c] = s;
  }
  __syncthreads();
  const int64_t col = int64_t{blockIdx.x} * kCols + threadIdx.x;
  if (threadIdx.x < kCols && col < C) {
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) s += group_sums[g * kCols + threadIdx.x];
    dbias[col] = accumulate ? dbias[col] + s : s;
  }
}
'''
sub("""bool aligned16(const void* p) {""", kernel + """
bool aligned16(const void* p) {""")
sub("""  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),""",
"""  if (SLAB > 0) {
    launch_dependent(dropout_slab_backward_kernel<SLAB, SLAB_THREADS>, dim3(ceil_div(C / 8, SLAB)),
                     dim3(SLAB_THREADS), stream, dx, dbias, dout, rows, C, dropout_threshold(p),
                     1.0f / (1.0f - p), rng, accumulate_dbias);
    REPLAY_LAUNCH_CHECK();
    return;
  }
  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),""")
s = "#ifndef SLAB\n#define SLAB 0\n#define SLAB_THREADS 1024\n#endif\n" + s
open(sys.argv[2], "w").write(s)
