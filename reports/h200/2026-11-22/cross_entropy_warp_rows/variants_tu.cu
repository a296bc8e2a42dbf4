// Experiment: cross-entropy statistics with one warp a row, persistent warps, loads of later chunks
// in flight while a chunk is used: kBuf register buffers, or a per-warp ring of bulk (TMA) copies.
#include <map>
#include "common/kernels/cross_entropy.cu"
namespace replay {
namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  const uint32_t bar = smem_addr(b);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n\t.reg .pred done;\nWAIT_%=:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t@!done bra WAIT_%=;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}

__device__ __forceinline__ uint4 ld_cs_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Per-warp row state and the work on one chunk of kC packs a lane.
template <int kC>
struct RowState {
  float m = -INFINITY, s = 0.0f, target_logit = 0.0f;
  int32_t target = 0, next_target = 0;
  __device__ __forceinline__ void consume(const uint4 (&x)[kC], int64_t r, int c, int chunks, int lane, int64_t warps,
                                          float* stats, float* row_loss, const __nv_bfloat16* logits,
                                          const int32_t* targets, int64_t rows, int64_t width, int64_t vocab_start) {
    if (c == 0) {
      const int64_t local = static_cast<int64_t>(target) - vocab_start;
      const bool held = target != kCrossEntropyIgnoreIndex && local >= 0 && local < width;
      target_logit = held ? __bfloat162float(logits[r * width + local]) : 0.0f;
      next_target = r + warps < rows ? targets[r + warps] : 0;
    }
    uint32_t pair = kNegInfPair;
#pragma unroll
    for (int i = 0; i < kC; ++i)
      pair = max_bf16x2(pair, max_bf16x2(max_bf16x2(x[i].x, x[i].y), max_bf16x2(x[i].z, x[i].w)));
    const float chunk_max = fmaxf(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
    const float m_new = fmaxf(m, chunk_max);
    if (m_new != m) s *= exp2_approx((m - m_new) * kLog2e);
    m = m_new;
    const float m_log2 = m == -INFINITY ? 0.0f : m * kLog2e;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float v[8];
      unpack(x[i], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sums[k % 4] += exp2_approx(fmaf(v[k], kLog2e, -m_log2));
    }
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
    if (c == chunks - 1) {
      const float2 st = warp_merge_stats(m, s);
      if (lane == 0) {
        stats[r] = st.x;
        stats[rows + r] = st.y;
        stats[2 * rows + r] = target_logit;
        if (row_loss != nullptr)
          row_loss[r] = target == kCrossEntropyIgnoreIndex ? 0.0f : row_loss_of(st.x, st.y, target_logit);
      }
      m = -INFINITY, s = 0.0f;
      target = next_target;
    }
  }
};

template <int kC, int kBuf, int kWarps, int kMinBlocks, bool kVolatile>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    ce_stats_warp(float* __restrict__ stats, float* __restrict__ row_loss,
                  const __nv_bfloat16* __restrict__ logits, const int32_t* __restrict__ targets,
                  int64_t rows, int64_t width, int64_t vocab_start) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (first >= rows) return;
  const int packs = static_cast<int>(width / 8);
  constexpr int kChunkPacks = 32 * kC;
  const int chunks = (packs + kChunkPacks - 1) / kChunkPacks;
  auto load = [&](uint4 (&x)[kC], int64_t r, int c) {
    const uint4* p = reinterpret_cast<const uint4*>(logits + r * width) + c * kChunkPacks + lane;
    const int left = packs - c * kChunkPacks - lane;
#pragma unroll
    for (int i = 0; i < kC; ++i)
      x[i] = i * 32 < left ? (kVolatile ? ld_cs_volatile(p + i * 32) : __ldcs(p + i * 32)) : make_uint4(kNegInfPair, kNegInfPair, kNegInfPair, kNegInfPair);
  };
  auto advance = [&](int64_t& r, int& c) {
    if (++c == chunks) c = 0, r += warps;
  };
  RowState<kC> st;
  st.target = targets[first];
  uint4 buf[kBuf][kC];
  int64_t lr = first, cr = first;
  int lc = 0, cc = 0;
#pragma unroll
  for (int u = 0; u < kBuf - 1; ++u) {
    if (lr < rows) load(buf[u], lr, lc);
    advance(lr, lc);
  }
  for (;;) {
#pragma unroll
    for (int u = 0; u < kBuf; ++u) {
      if (lr < rows) load(buf[(u + kBuf - 1) % kBuf], lr, lc);
      advance(lr, lc);
      st.consume(buf[u], cr, cc, chunks, lane, warps, stats, row_loss, logits, targets, rows, width, vocab_start);
      advance(cr, cc);
      if (cr >= rows) return;
    }
  }
}


template <int kC, int kWarps, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    ce_stats_simple(float* __restrict__ stats, float* __restrict__ row_loss,
                    const __nv_bfloat16* __restrict__ logits, const int32_t* __restrict__ targets,
                    int64_t rows, int64_t width, int64_t vocab_start) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int packs = static_cast<int>(width / 8);
  constexpr int kChunkPacks = 32 * kC;
  const int chunks = (packs + kChunkPacks - 1) / kChunkPacks;
  auto load = [&](uint4 (&x)[kC], int64_t r, int c) {
    const uint4* p = reinterpret_cast<const uint4*>(logits + r * width) + c * kChunkPacks + lane;
    const int left = packs - c * kChunkPacks - lane;
#pragma unroll
    for (int i = 0; i < kC; ++i)
      x[i] = i * 32 < left ? __ldcs(p + i * 32) : make_uint4(kNegInfPair, kNegInfPair, kNegInfPair, kNegInfPair);
  };
  RowState<kC> st;
  st.target = targets[row];
  auto advance = [&](int64_t& r, int& c) {
    if (++c == chunks) c = 0, r += warps;
  };
  uint4 a[kC], b[kC];
  int c = 0;
  load(a, row, c);
  for (;;) {
    int64_t nr = row; int nc = c; advance(nr, nc);
    if (nr < rows) load(b, nr, nc);
    st.consume(a, row, c, chunks, lane, warps, stats, row_loss, logits, targets, rows, width, vocab_start);
    if (nr >= rows) break;
    row = nr, c = nc;
    nr = row, nc = c; advance(nr, nc);
    if (nr < rows) load(a, nr, nc);
    st.consume(b, row, c, chunks, lane, warps, stats, row_loss, logits, targets, rows, width, vocab_start);
    if (nr >= rows) break;
    row = nr, c = nc;
  }
}

template <int kC, int kStages, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    ce_stats_ring(float* __restrict__ stats, float* __restrict__ row_loss,
                  const __nv_bfloat16* __restrict__ logits, const int32_t* __restrict__ targets,
                  int64_t rows, int64_t width, int64_t vocab_start) {
  extern __shared__ uint4 ring_all[];
  __shared__ uint64_t bars_all[kWarps][kStages];
  allow_dependent_launch();
  wait_for_previous_grid();
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  constexpr int kChunkPacks = 32 * kC;
  uint4* ring = ring_all + w * kStages * kChunkPacks;
  uint64_t* bars = bars_all[w];
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first = int64_t{blockIdx.x} * kWarps + w;
  if (first >= rows) return;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) bar_init(&bars[s], 1);
    bar_fence_init();
  }
  __syncwarp();
  const int packs = static_cast<int>(width / 8);
  const int chunks = (packs + kChunkPacks - 1) / kChunkPacks;
  auto advance = [&](int64_t& r, int& c) {
    if (++c == chunks) c = 0, r += warps;
  };
  auto issue = [&](int s, int64_t r, int c) {
    const int n = min(kChunkPacks, packs - c * kChunkPacks);
    bulk_load(ring + s * kChunkPacks, reinterpret_cast<const uint4*>(logits + r * width) + c * kChunkPacks, n * 16, &bars[s]);
  };
  int64_t lr = first, cr = first;
  int lc = 0, cc = 0;
  if (lane == 0)
    for (int s = 0; s < kStages; ++s) {
      if (lr < rows) issue(s, lr, lc);
      advance(lr, lc);
    }
  RowState<kC> st;
  st.target = targets[first];
  for (uint32_t j = 0;; ++j) {
    const int s = j % kStages;
    bar_wait(&bars[s], (j / kStages) & 1);
    uint4 x[kC];
    const int left = packs - cc * kChunkPacks - lane;
#pragma unroll
    for (int i = 0; i < kC; ++i)
      x[i] = i * 32 < left ? ring[s * kChunkPacks + lane + i * 32] : make_uint4(kNegInfPair, kNegInfPair, kNegInfPair, kNegInfPair);
    __syncwarp();
    if (lane == 0 && lr < rows) issue(s, lr, lc);
    advance(lr, lc);
    st.consume(x, cr, cc, chunks, lane, warps, stats, row_loss, logits, targets, rows, width, vocab_start);
    advance(cr, cc);
    if (cr >= rows) return;
  }
}

template <typename Kernel>
void launch_persistent(Kernel kernel, int warps_per_block, size_t smem, const char* name, float* stats, float* row_loss,
                       const __nv_bfloat16* logits, const int32_t* targets, const CrossEntropyShape& shape,
                       cudaStream_t stream) {
  static std::map<const void*, int> blocks_of;
  int& blocks = blocks_of[reinterpret_cast<const void*>(kernel)];
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    if (smem > 48 * 1024) REPLAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    REPLAY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    REPLAY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps_per_block * 32, smem));
    blocks = sms * per_sm;
    printf("      [%s: %d blocks/SM, %d warps/SM]\n", name, per_sm, per_sm * warps_per_block);
  }
  const int64_t grid = std::min<int64_t>(blocks, (shape.rows + warps_per_block - 1) / warps_per_block);
  cudaLaunchAttribute attr = dependent_launch_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(warps_per_block * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, stats, row_loss, logits, targets, shape.rows,
                                       shape.vocab_shard, shape.vocab_start));
  REPLAY_LAUNCH_CHECK();
}
#define SIMPLE(C, W, M) launch_persistent(ce_stats_simple<C, W, M>, W, 0, "simple C" #C " x" #W "w min" #M, stats, row_loss, logits, targets, shape, stream)
#define WARP(C, B, W, M) launch_persistent(ce_stats_warp<C, B, W, M, true>, W, 0, "volatile C" #C " buf" #B " x" #W "w min" #M, stats, row_loss, logits, targets, shape, stream)
#define RING(C, S, W) launch_persistent(ce_stats_ring<C, S, W>, W, size_t(W) * S * C * 32 * 16, "ring C" #C " stages" #S " x" #W "w", stats, row_loss, logits, targets, shape, stream)
}  // namespace
int exp_variants() { return 8; }
const char* exp_name(int v) {
  static const char* n[] = {"simple C8 x2w m8", "simple C8 x4w m4", "simple C8 x2w m10", "volatile C8 buf2 x2w", "volatile C8 buf3 x2w",
                            "volatile C6 buf3 x2w", "volatile C4 buf4 x2w", "ring C4 S6 x2w"};
  return n[v];
}
void exp_forward(int v, float* stats, float* row_loss, float* mean_loss, int32_t* count,
                 const __nv_bfloat16* logits, const int32_t* targets, const CrossEntropyShape& shape,
                 cudaStream_t stream) {
  switch (v) {
    case 0: SIMPLE(8, 2, 8); break;
    case 1: SIMPLE(8, 4, 4); break;
    case 2: SIMPLE(8, 2, 10); break;
    case 3: WARP(8, 2, 2, 8); break;
    case 4: WARP(8, 3, 2, 8); break;
    case 5: WARP(6, 3, 2, 8); break;
    case 6: WARP(4, 4, 2, 8); break;
    default: RING(4, 6, 2); break;
  }
  if (mean_loss == nullptr) return;
  launch_dependent(cross_entropy_mean_kernel, dim3(1), dim3(kMeanThreads), stream, mean_loss, count,
                   row_loss, targets, shape.rows);
  REPLAY_LAUNCH_CHECK();
}
}  // namespace replay
