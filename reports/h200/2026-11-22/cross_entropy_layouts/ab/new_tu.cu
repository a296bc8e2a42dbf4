// The tree's cross_entropy.cu as of 3a0fc0c ("new") and variants next to it: rows.cu's aligned-rows
// kernel at 128 threads of 2 packs, and 3a0fc0c's kernel template at 256 threads of 2, 4 and 8 packs.
// The H200 run (output.txt) had variant 0 only; the H100 run (output_h100.txt) all four.
#include "common/kernels/cross_entropy.cu"
namespace replay {
namespace {
__device__ __forceinline__ float pack_el(uint4 w, int k) { return pack_element(w, k); }
// The probe's kernel: aligned rows, no head or tail, T threads of U packs walking the row.
template <int U>
__global__ void __launch_bounds__(256) probe_rows_k(float* __restrict__ stats, float* __restrict__ row_loss,
    const __nv_bfloat16* __restrict__ logits, const int32_t* __restrict__ targets, long rows, long width) {
  __shared__ float2 wst[8]; __shared__ float tl;
  allow_dependent_launch(); wait_for_previous_grid();
  const long r = blockIdx.x; const int t = threadIdx.x, T = blockDim.x, lane = t % 32, warp = t / 32;
  const uint4* body = reinterpret_cast<const uint4*>(logits + r * width);
  const long packs = width / 8;
  const int32_t target = targets[r];
  const long local = target;
  const bool held = target >= 0 && local < width;
  const long tp = held ? local / 8 : -1; const int tk = int(local % 8);
  float m = -INFINITY, s = 0.f;
  for (long base = t; base < packs; base += long(U) * T) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { const long p = base + u * T; x[u] = p < packs ? __ldcs(body + p) : make_uint4(kNegInfPair, kNegInfPair, kNegInfPair, kNegInfPair); }
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * T == tp) tl = pack_el(x[u], tk);
    uint32_t pr = kNegInfPair;
#pragma unroll
    for (int u = 0; u < U; ++u) pr = max_bf16x2(pr, max_bf16x2(max_bf16x2(x[u].x, x[u].y), max_bf16x2(x[u].z, x[u].w)));
    const float cm = fmaxf(__uint_as_float(pr << 16), __uint_as_float(pr & 0xffff0000u));
    const float mn = fmaxf(m, cm);
    if (mn != m) s *= exp2_approx((m - mn) * kLog2e);
    m = mn;
    const float ml = m == -INFINITY ? 0.f : m * kLog2e;
    float sums[4] = {0, 0, 0, 0};
#pragma unroll
    for (int u = 0; u < U; ++u) { float v[8]; unpack(x[u], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sums[k % 4] += exp2_approx(fmaf(v[k], kLog2e, -ml)); }
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
  const float2 ws = warp_merge_stats(m, s);
  if (lane == 0) wst[warp] = ws;
  __syncthreads();
  if (warp != 0) return;
  const float2 w = lane < T / 32 ? wst[lane] : make_float2(-INFINITY, 0.f);
  const float2 rs = warp_merge_stats(w.x, w.y);
  if (lane == 0) {
    const float tlg = held ? tl : 0.f;
    stats[r] = rs.x; stats[rows + r] = rs.y; stats[2 * rows + r] = tlg;
    if (row_loss) row_loss[r] = target < 0 ? 0.f : row_loss_of(rs.x, rs.y, tlg);
  }
}
}  // namespace
int exp_variants() { return 4; }
const char* exp_name(int v) {
  static const char* n[] = {"probe kernel T128 U2", "tree 256 x 2 aligned", "tree 256 x 4 aligned", "tree 256 x 8 aligned"};
  return n[v];
}
void exp_forward(int v, float* stats, float* row_loss, float* mean, int32_t* count, const __nv_bfloat16* logits, const int32_t* targets, const CrossEntropyShape& shape, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(shape.rows));
  float* rl = row_loss;
  switch (v) {
    case 0: launch_dependent(probe_rows_k<2>, grid, dim3(128), stream, stats, rl, logits, targets, shape.rows, shape.vocab_shard); break;
    case 1: launch_dependent(cross_entropy_stats_kernel<2, 256, 8, true>, grid, dim3(256), stream, stats, rl, logits, targets, shape.rows, shape.vocab_shard, shape.vocab_start); break;
    case 2: launch_dependent(cross_entropy_stats_kernel<4, 256, 6, true>, grid, dim3(256), stream, stats, rl, logits, targets, shape.rows, shape.vocab_shard, shape.vocab_start); break;
    case 3: launch_dependent(cross_entropy_stats_kernel<8, 256, 4, true>, grid, dim3(256), stream, stats, rl, logits, targets, shape.rows, shape.vocab_shard, shape.vocab_start); break;
  }
  REPLAY_LAUNCH_CHECK();
  if (mean != nullptr) {
    launch_dependent(cross_entropy_mean_kernel, dim3(1), dim3(kMeanThreads), stream, mean, count, (const float*)row_loss, targets, shape.rows);
    REPLAY_LAUNCH_CHECK();
  }
}
}  // namespace replay
