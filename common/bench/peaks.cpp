// peaks.cpp: start-up measurement of the bf16 GEMM rate and the device copy bandwidth.
#include "common/bench/peaks.h"

#include "common/bench/timing.h"
#include "common/gemm.h"
#include "common/kernels/init.h"

namespace replay::bench {

PeakBuffers plan_peak_buffers(ArenaPlan& plan, bool with_copy, Lifetime life) {
  PeakBuffers b;
  const int64_t n = kPeakGemmSize * kPeakGemmSize;
  b.a = plan.add("peak.gemm.a", DType::kBF16, n, "setup", life);
  b.b = plan.add("peak.gemm.b", DType::kBF16, n, "setup", life);
  b.d = plan.add("peak.gemm.d", DType::kBF16, n, "setup", life);
  b.workspace = plan.add("peak.gemm.workspace", GemmOptions{}.workspace_limit, "setup", life);
  if (with_copy) {
    b.copy_src = plan.add("peak.copy.src", kPeakCopyBytes, "setup", life);
    b.copy_dst = plan.add("peak.copy.dst", kPeakCopyBytes, "setup", life);
  }
  return b;
}

Peaks measure_peaks(const Context& ctx, const Arena& arena, const PeakBuffers& buf, int warmup,
                    int repeats, double lead_ms) {
  Peaks p;
  cudaStream_t s = ctx.stream();
  const int64_t n = kPeakGemmSize;
  init_normal(arena.view(buf.a, DType::kBF16, {n, n}), 1, 0, 0.0f, 1.0f, s);
  init_normal(arena.view(buf.b, DType::kBF16, {n, n}), 1, 1, 0.0f, 1.0f, s);

  // Y = X W^T, the forward form of a linear layer (what torch's x @ w.t() runs).
  GemmDesc desc;
  desc.m = desc.n = desc.k = n;
  desc.trans_b = true;
  GemmPlan plan(ctx.cublaslt(), desc);
  GemmArgs args;
  args.a = arena.data(buf.a);
  args.b = arena.data(buf.b);
  args.d = arena.data(buf.d);
  args.workspace = arena.data(buf.workspace);
  args.workspace_bytes = arena.bytes(buf.workspace);
  const Stats g = summarize(time_repeats(
      s, warmup, repeats, [&](cudaStream_t st) { plan.run(st, args); }, lead_ms));
  p.bf16_gemm_tflops = 2.0 * double(n) * n * n / (g.median * 1e-3) / 1e12;

  if (buf.copy_src >= 0) {
    const size_t bytes = arena.bytes(buf.copy_src);
    init_normal(TensorView(arena.data(buf.copy_src), DType::kFP32, {int64_t(bytes / 4)}), 1, 2, 0,
                1, s);
    const Stats c = summarize(time_repeats(
        s, warmup, repeats,
        [&](cudaStream_t st) {
          REPLAY_CUDA_CHECK(cudaMemcpyAsync(arena.data(buf.copy_dst), arena.data(buf.copy_src),
                                            bytes, cudaMemcpyDeviceToDevice, st));
        },
        lead_ms));
    p.copy_gbps = 2.0 * double(bytes) / (c.median * 1e-3) / 1e9;
  }
  return p;
}

}  // namespace replay::bench
