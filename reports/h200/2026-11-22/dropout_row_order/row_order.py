# row_order.py SRC OUT: dropout.cu (6300d1b's) with the rows of each block's lanes chosen by -DROW_ORDER:
#   0  as in SRC: groups of ceil(rows / (groups x lanes)) x lanes contiguous rows, each lane a contiguous run
#      (2048 rows, 22 groups: 21 groups of 96 rows and one of 32)
#   1  even contiguous runs: run q of Q = groups x lanes takes rows [q rows / Q, (q + 1) rows / Q)
#   2  interleaved: run q takes rows q, q + Q, q + 2Q, ...; at any moment the grid works on a window of
#      Q x batch rows, and the runs differ by at most one row
# and -DWAVES=N sizing the grid to N waves of resident blocks (N x 22 groups at 2048 x 12288 on 132 SMs) instead
# of one. -DTICKET=1 sums dbias in the backward kernel instead of by column_sums: each block
# writes its partial row, fences, and takes a ticket from its column tile's counter (a __device__ array, zero at
# load); the tile's last block reads the tile's partials (lane l adds groups l, l + 4, ... in order, then the lanes
# in lane order), writes dbias and puts the counter back to 0. The forward (one lane a block) gets the same row orders. Every order walks its rows in batches and
# finishes with one batch of the rest, so no row is loaded alone unless one is left. The mask and dx do not
# change; dbias is summed in another order, so its bits do.
import sys
s = open(sys.argv[1]).read()
def sub(old, new, count=1):
    global s
    assert s.count(old) == count, (s.count(old), old[:70])
    s = s.replace(old, new)
sub("""template <int kBatch, typename Batch>
__device__ __forceinline__ void for_row_batches(int64_t r_begin, int64_t r_end, Batch&& batch) {
  int64_t r0 = r_begin;
  for (; r0 + kBatch <= r_end; r0 += kBatch) batch(std::integral_constant<int, kBatch>{}, r0);
  for (; r0 < r_end; ++r0) batch(std::integral_constant<int, 1>{}, r0);
}""",
"""template <int N, typename Batch>
__device__ __forceinline__ void rest_batch(int64_t left, int64_t r0, Batch& batch) {
  if constexpr (N > 0) {
    if (left == N) batch(std::integral_constant<int, N>{}, r0);
    else rest_batch<N - 1>(left, r0, batch);
  }
}
// Rows first, first + stride, ... (count of them), kBatch at a time, then one batch of the rest.
template <int kBatch, typename Batch>
__device__ __forceinline__ void walk_rows(int64_t first, int64_t count, int64_t stride, Batch&& batch) {
  int64_t k = 0;
  for (; k + kBatch <= count; k += kBatch) batch(std::integral_constant<int, kBatch>{}, first + k * stride);
  rest_batch<kBatch - 1>(count - k, first + k * stride, batch);
}
// Run q of Q: its first row, row count and stride.
struct Run { int64_t first, count, stride; };
__device__ __forceinline__ Run run_of(int64_t q, int64_t Q, int64_t rows, int64_t rows_per_group, int lanes) {
#if ROW_ORDER == 1
  const int64_t first = q * rows / Q;
  return {first, (q + 1) * rows / Q - first, 1};
#elif ROW_ORDER == 2
  return {q, q < rows ? (rows - q + Q - 1) / Q : 0, Q};
#else
  const int64_t group = q / lanes, lane = q % lanes;
  const int64_t group_end = min(rows, (group + 1) * rows_per_group);
  const int64_t run = rows_per_group / lanes;
  const int64_t r_begin = min(group_end, group * rows_per_group + lane * run);
  return {r_begin, min(group_end, r_begin + run) - r_begin, 1};
#endif
}""")
# forward
sub("""  const int64_t r_begin = blockIdx.y * rows_per_group;
  const int64_t r_end = min(rows, r_begin + rows_per_group);
  for_row_batches<kFwdRowBatch>(r_begin, r_end, [&](auto batch, int64_t r0) {""",
"""  const Run run = run_of(blockIdx.y, gridDim.y, rows, rows_per_group, 1);
  const int64_t stride = run.stride;
  walk_rows<kFwdRowBatch>(run.first, run.count, stride, [&](auto batch, int64_t r0) {""")
# backward
sub("""    const int64_t group_end = min(rows, (blockIdx.y + int64_t{1}) * rows_per_group);
    const int64_t run = rows_per_group / kBwdLanes;
    const int64_t r_begin = min(group_end, blockIdx.y * rows_per_group + lane * run);
    const int64_t r_end = min(group_end, r_begin + run);
    for_row_batches<kBwdRowBatch>(r_begin, r_end, [&](auto batch, int64_t r0) {""",
"""    const Run run = run_of(blockIdx.y * int64_t{kBwdLanes} + lane, int64_t{gridDim.y} * kBwdLanes, rows,
                           rows_per_group, kBwdLanes);
    const int64_t stride = run.stride;
    walk_rows<kBwdRowBatch>(run.first, run.count, stride, [&](auto batch, int64_t r0) {""")
# rows u of a batch are r0 + u * stride
sub("(r0 + u) * C", "(r0 + u * stride) * C", 7)
# grid: N waves; with orders 1 and 2 every wave group is used (no rounding of rows to groups)
sub("""  const int64_t groups = std::min(wave_groups, max_groups);
  plan.rows_per_group = ceil_div<int64_t>(rows, groups * lanes) * lanes;
  plan.groups = static_cast<int>(ceil_div<int64_t>(rows, plan.rows_per_group));""",
"""  const int64_t groups = std::min(wave_groups * WAVES, max_groups);
  plan.rows_per_group = ceil_div<int64_t>(rows, groups * lanes) * lanes;
  plan.groups = ROW_ORDER == 0 ? static_cast<int>(ceil_div<int64_t>(rows, plan.rows_per_group))
                               : static_cast<int>(groups);""")
sub("constexpr int kBwdMaxBlocks = 256;", "constexpr int kBwdMaxBlocks = 256 * WAVES;")
s = "#ifndef ROW_ORDER\n#define ROW_ORDER 0\n#endif\n#ifndef WAVES\n#define WAVES 1\n#endif\n" + s
# the ticket
sub("""                                     uint32_t threshold, float scale, RngArgs rng) {
  __shared__ float4 lane_sums[kBwdLanes - 1][kThreads][2];""",
"""                                     uint32_t threshold, float scale, RngArgs rng, float* dbias,
                                     bool accumulate) {
  __shared__ float4 lane_sums[kBwdLanes - 1][kThreads][2];""")
sub("""  __syncthreads();
  if (lane > 0 || !owns) return;
#pragma unroll
  for (int l = 0; l < kBwdLanes - 1; ++l) {
    const float4 lo = lane_sums[l][threadIdx.x][0], hi = lane_sums[l][threadIdx.x][1];
    acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
    acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
  }
  float4* dst = reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * C + p * 8);
  dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}""",
"""  __syncthreads();
#if TICKET
  if (lane == 0 && owns) {
#else
  if (lane > 0 || !owns) return;
  {
#endif
#pragma unroll
    for (int l = 0; l < kBwdLanes - 1; ++l) {
      const float4 lo = lane_sums[l][threadIdx.x][0], hi = lane_sums[l][threadIdx.x][1];
      acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
      acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
    }
    float4* dst = reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * C + p * 8);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
#if TICKET
    __threadfence();
#endif
  }
#if TICKET
  __shared__ unsigned int ticket;
  __syncthreads();
  if (threadIdx.x == 0 && lane == 0) ticket = atomicAdd(&g_tickets[blockIdx.x], 1u);
  __syncthreads();
  if (ticket != gridDim.y - 1) return;
  __threadfence();
  float s[8] = {};
  if (owns) {
#pragma unroll 6
    for (int g = lane; g < static_cast<int>(gridDim.y); g += kBwdLanes) {
      const float4* src = reinterpret_cast<const float4*>(partials + static_cast<int64_t>(g) * C + p * 8);
      const float4 lo = __ldcg(src), hi = __ldcg(src + 1);
      s[0] += lo.x, s[1] += lo.y, s[2] += lo.z, s[3] += lo.w;
      s[4] += hi.x, s[5] += hi.y, s[6] += hi.z, s[7] += hi.w;
    }
  }
  if (lane > 0) {
    lane_sums[lane - 1][threadIdx.x][0] = make_float4(s[0], s[1], s[2], s[3]);
    lane_sums[lane - 1][threadIdx.x][1] = make_float4(s[4], s[5], s[6], s[7]);
  }
  __syncthreads();
  if (lane > 0) return;
  if (threadIdx.x == 0) g_tickets[blockIdx.x] = 0;
  if (!owns) return;
#pragma unroll
  for (int l = 0; l < kBwdLanes - 1; ++l) {
    const float4 lo = lane_sums[l][threadIdx.x][0], hi = lane_sums[l][threadIdx.x][1];
    s[0] += lo.x, s[1] += lo.y, s[2] += lo.z, s[3] += lo.w;
    s[4] += hi.x, s[5] += hi.y, s[6] += hi.z, s[7] += hi.w;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) dbias[p * 8 + j] = accumulate ? dbias[p * 8 + j] + s[j] : s[j];
#endif
}""")
sub("""// Block (x, y) covers packs [x * blockDim.x, ...) of rows [y * rows_per_group, ...), which its""",
"""__device__ unsigned int g_tickets[256];  // TICKET: one counter a column tile

// Block (x, y) covers packs [x * blockDim.x, ...) of rows [y * rows_per_group, ...), which its""")
sub("""                   plan.rows_per_group, dropout_threshold(p), 1.0f / (1.0f - p), rng);
  REPLAY_LAUNCH_CHECK();
  if (dbias) column_sums(1, dbias, nullptr, partials, plan.groups, C, accumulate_dbias, stream);""",
"""                   plan.rows_per_group, dropout_threshold(p), 1.0f / (1.0f - p), rng, dbias,
                   accumulate_dbias);
  REPLAY_LAUNCH_CHECK();
  if (dbias && !TICKET) column_sums(1, dbias, nullptr, partials, plan.groups, C, accumulate_dbias, stream);""")
s = "#ifndef TICKET\n#define TICKET 0\n#endif\n" + s
open(sys.argv[2], "w").write(s)
