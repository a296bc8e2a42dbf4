# grid_barrier.py SRC OUT: dropout.cu (83d9b60's) with the backward's dbias finished inside the kernel instead of by
# column_sums: a cooperative launch (the grid is one wave of resident blocks), a grid barrier after the partial rows,
# then each thread of the grid sums one column's partials in row-group order. -DCOOP_ATTRS=2 launches it cooperative
# and as a programmatic dependent, -DCOOP_ATTRS=1 cooperative only.
import sys
s = open(sys.argv[1]).read()
def sub(old, new):
    global s
    assert old in s, old[:60]
    s = s.replace(old, new, 1)
sub('#include "common/kernels/dependent_launch.cuh"\n', '#include "common/kernels/dependent_launch.cuh"\n#include <cooperative_groups.h>\n')
sub("""                                     uint32_t threshold, float scale, RngArgs rng) {
  __shared__ float4 lane_sums[kBwdLanes - 1][kThreads][2];""",
"""                                     uint32_t threshold, float scale, RngArgs rng, float* dbias,
                                     int accumulate) {
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
  if (lane == 0 && owns) {
#pragma unroll
    for (int l = 0; l < kBwdLanes - 1; ++l) {
      const float4 lo = lane_sums[l][threadIdx.x][0], hi = lane_sums[l][threadIdx.x][1];
      acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
      acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
    }
    float4* dst = reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * C + p * 8);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  cooperative_groups::this_grid().sync();
  const int64_t b = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t c = b * (blockDim.x * blockDim.y) + threadIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int groups = gridDim.y;
  float v[32];
#pragma unroll
  for (int g = 0; g < 32; ++g) v[g] = g < groups ? __ldcg(partials + int64_t(g) * C + c) : 0.0f;
  float total = 0.0f;
#pragma unroll
  for (int g = 0; g < 32; ++g)
    if (g < groups) total += v[g];
  dbias[c] = accumulate ? dbias[c] + total : total;
}""")
sub("""  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),
                   dim3(plan.threads, plan.lanes), stream, dx, partials, dout, rows, C,
                   plan.rows_per_group, dropout_threshold(p), 1.0f / (1.0f - p), rng);
  REPLAY_LAUNCH_CHECK();
  if (dbias) column_sums(1, dbias, nullptr, partials, plan.groups, C, accumulate_dbias, stream);""",
"""  REPLAY_REQUIRE(plan.groups <= 32, "probe: at most 32 row groups");
  cudaLaunchAttribute attrs[2] = {{}, dependent_launch_attribute()};
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.col_tiles, plan.groups);
  config.blockDim = dim3(plan.threads, plan.lanes);
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = COOP_ATTRS;
  const float inv_keep = 1.0f / (1.0f - p);
  REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, dropout_residual_backward_kernel, dx, partials, dout, rows, C,
                                       plan.rows_per_group, dropout_threshold(p), inv_keep, rng, dbias,
                                       int(accumulate_dbias)));
  REPLAY_LAUNCH_CHECK();""")
open(sys.argv[2], "w").write(s)
