# ring.py SRC OUT: da4f0ab's dropout.cu with the backward's row loads staged through shared memory by cp.async
# (-DSTAGES=S, -DRB=B): each thread keeps S - 1 batches of B rows in flight in its own ring slots ([S][B][threads]
# 16-byte packs, dynamic shared memory) while it works on the oldest: it issues batch b + S - 1, draws batch b's
# keep masks, waits for batch b, then reads its own packs back, stores dx and adds dbias. A thread reads only what it
# copied, so the ring needs no barrier. dx and dbias are those of da4f0ab's kernel (same rows, same order).
# -DPH=1 draws the masks after the wait instead of before it.
import sys
s = open(sys.argv[1]).read()
def sub(old, new, count=1):
    global s
    assert s.count(old) == count, (s.count(old), old[:70])
    s = s.replace(old, new)
sub("""  if (owns) {
    const int64_t Q = int64_t{gridDim.y} * kBwdLanes;
    walk_run<kBwdRowBatch>(""", """  if (owns) {
    extern __shared__ uint4 ring[];  // [STAGES][RB][blockDim.x * blockDim.y]
    const int T = blockDim.x * blockDim.y, tid = lane * blockDim.x + threadIdx.x;
    const int64_t Q = int64_t{gridDim.y} * kBwdLanes;
    const int64_t q = blockIdx.y * int64_t{kBwdLanes} + lane;
    const int64_t count = q < rows ? (rows - q + Q - 1) / Q : 0;
    const int64_t batches = (count + RB - 1) / RB;
    auto issue = [&](int64_t b) {  // batch b (if any) into slot b % STAGES; always one group
      if (b < batches) {
        uint4* slot = ring + (b % STAGES) * RB * T + tid;
#pragma unroll
        for (int u = 0; u < RB; ++u) {
          const int64_t k = b * RB + u;
          if (k < count) {
            const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(slot + u * T));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(dst),
                         "l"(dout + (q + k * Q) * C + p * 8) : "memory");
          }
        }
      }
      asm volatile("cp.async.commit_group;\\n" ::: "memory");
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) issue(st);
    for (int64_t b = 0; b < batches; ++b) {
      issue(b + STAGES - 1);
      uint32_t keep[RB];
#if PH == 1
      asm volatile("cp.async.wait_group %0;\\n" ::"n"(STAGES - 1) : "memory");
#endif
#pragma unroll
      for (int u = 0; u < RB; ++u)
        keep[u] = threshold != 0 ? philox.keep_bits((q + (b * RB + u) * Q) * C + p * 8, threshold) : ~0u;
#if PH == 0
      asm volatile("cp.async.wait_group %0;\\n" ::"n"(STAGES - 1) : "memory");
#endif
      const uint4* slot = ring + (b % STAGES) * RB * T + tid;
#pragma unroll
      for (int u = 0; u < RB; ++u) {
        const int64_t k = b * RB + u;
        if (k < count) {
          const uint4 w = slot[u * T];
          PackBF16 d;
          *reinterpret_cast<uint4*>(d.v) = w;
          PackBF16 o;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float v = __bfloat162float(d.v[j]);
            if (threshold != 0) v = (keep[u] >> j) & 1u ? v * scale : 0.0f;
            acc[j] += v;
            o.v[j] = __float2bfloat16_rn(v);
          }
          o.store(dx + (q + k * Q) * C + p * 8);
        }
      }
    }
  }
  if (false) {
    const int64_t Q = int64_t{gridDim.y} * kBwdLanes;
    walk_run<kBwdRowBatch>(""")
sub("""  launch_dependent(dropout_residual_backward_kernel, dim3(plan.col_tiles, plan.groups),
                   dim3(plan.threads, plan.lanes), stream, dx, partials, dout, rows, C,
                   dropout_threshold(p), 1.0f / (1.0f - p), rng);""",
"""  const size_t ring_bytes = size_t{STAGES} * RB * plan.threads * plan.lanes * 16;
  static bool sized = false;
  if (!sized) {
    REPLAY_CUDA_CHECK(cudaFuncSetAttribute(dropout_residual_backward_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(ring_bytes)));
    sized = true;
  }
  cudaLaunchAttribute attr = dependent_launch_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.col_tiles, plan.groups);
  config.blockDim = dim3(plan.threads, plan.lanes);
  config.dynamicSmemBytes = ring_bytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, dropout_residual_backward_kernel, dx, partials, dout, rows, C,
                                       dropout_threshold(p), 1.0f / (1.0f - p), rng));""")
s = "#ifndef PH\n#define PH 0\n#endif\n#ifndef STAGES\n#define STAGES 2\n#endif\n#ifndef RB\n#define RB 4\n#endif\n" + s
open(sys.argv[2], "w").write(s)
