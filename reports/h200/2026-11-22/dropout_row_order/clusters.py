# clusters.py SRC OUT: row_order.py's output with the dropout backward in column slabs shared by a cluster
# (-DCL=K -DCL_S=S -DCL_T=T): the grid is (slabs of S packs) x K, cluster (1, K, 1); every block of a cluster takes
# the same S packs of 1/K of the rows. Its T threads are (pack j = t % S, lane l = t / S), L = T / S lanes; run
# q = rank x L + l of the cluster's Q = K x L walks rows q, q + Q, ... in batches of 4 (mask and dx as before). At the
# end each block adds its lanes' dbias sums in shared memory (fixed groups of lanes, then the groups in order), the
# cluster syncs, and rank r adds the K blocks' sums of its 1/K of the slab's columns in rank order through
# distributed shared memory and writes dbias: no partial rows in global memory and no column_sums kernel.
import sys
s = open(sys.argv[1]).read()
def sub(old, new, count=1):
    global s
    assert s.count(old) == count, (s.count(old), old[:70])
    s = s.replace(old, new)
kernel = r'''
template <int kK, int kS, int kT>
__global__ void __launch_bounds__(kT, 1)
    dropout_cluster_backward_kernel(bf16* dx, float* __restrict__ dbias, const bf16* dout, int64_t rows, int C,
                                    uint32_t threshold, float scale, RngArgs rng, bool accumulate) {
  constexpr int kLanes = kT / kS, kCols = kS * 8;
  constexpr int kGroups = kT / kCols < 8 ? kT / kCols : 8;
  static_assert(kGroups >= 1 && kCols % kK == 0, "cluster shape");
  __shared__ float lane_sums[kLanes * kCols];
  __shared__ float group_sums[kGroups * kCols];
  __shared__ float block_sums[kCols];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int j = threadIdx.x % kS, lane = threadIdx.x / kS;
  const int p = blockIdx.x * kS + j;
  const bool owns = p < C / 8 && lane < kLanes;
  const Philox philox = launch_philox(rng, threshold);
  float acc[8] = {};
  if (owns) {
    constexpr int64_t stride = int64_t{kK} * kLanes;
    const int64_t q = int64_t{blockIdx.y} * kLanes + lane;
    walk_rows<kBwdRowBatch>(q, q < rows ? (rows - q + stride - 1) / stride : 0, stride,
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
  if (threadIdx.x < kCols) {
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) s += group_sums[g * kCols + threadIdx.x];
    block_sums[threadIdx.x] = s;
  }
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  constexpr int kMine = kCols / kK;
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t col = int64_t{blockIdx.x} * kCols + rank * kMine + threadIdx.x;
  if (threadIdx.x < kMine && col < C) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kK; ++k) s += *cluster.map_shared_rank(&block_sums[rank * kMine + threadIdx.x], k);
    dbias[col] = accumulate ? dbias[col] + s : s;
  }
  cluster.sync();
}
'''
sub('#include "common/kernels/dependent_launch.cuh"\n', '#include "common/kernels/dependent_launch.cuh"\n#include <cooperative_groups.h>\n')
sub("""bool aligned16(const void* p) {""", kernel + """
bool aligned16(const void* p) {""")
sub("""  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),""",
"""  {
    auto kernel = dropout_cluster_backward_kernel<CL, CL_S, CL_T>;
    cudaLaunchAttribute attrs[2] = {dependent_launch_attribute(), cudaLaunchAttribute{}};
    attrs[1].id = cudaLaunchAttributeClusterDimension;
    attrs[1].val.clusterDim.x = 1;
    attrs[1].val.clusterDim.y = CL;
    attrs[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(ceil_div(C / 8, CL_S), CL);
    config.blockDim = dim3(CL_T);
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = CL > 1 ? 2 : 1;
    static bool told = false;
    if (!told) {
      int clusters = 0;
      REPLAY_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
      std::printf("cluster probe: %d x %d blocks of %d threads, clusters of %d, %d clusters fit at once\\n",
                  config.gridDim.x, config.gridDim.y, CL_T, CL, clusters);
      told = true;
    }
    REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, dx, dbias, dout, rows, C, dropout_threshold(p),
                                         1.0f / (1.0f - p), rng, accumulate_dbias));
    REPLAY_LAUNCH_CHECK();
    return;
  }
  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),""")
s = "#include <cstdio>\n" + s
open(sys.argv[2], "w").write(s)
