// peaks.h: the two ceilings every benchmark is judged against, measured on the device at start-up:
// the bf16 GEMM rate (an 8192^3 cuBLASLt GEMM, fp32 accumulation) and the device copy bandwidth
// (a 2 GiB buffer copied device to device, counting bytes read plus bytes written). Buffers come
// from the run's arena, planned with a set-up lifetime so they share memory with later buffers.
#pragma once

#include "common/arena.h"
#include "common/context.h"

namespace replay::bench {

struct PeakBuffers {
  BufferId a = -1, b = -1, d = -1, workspace = -1;
  BufferId copy_src = -1, copy_dst = -1;  // only when the copy peak is planned
};

struct Peaks {
  double bf16_gemm_tflops = 0;  // 0 when not measured
  double copy_gbps = 0;
};

constexpr int64_t kPeakGemmSize = 8192;
constexpr size_t kPeakCopyBytes = size_t{2} << 30;

// Adds the buffers to `plan` with lifetime `life` (choose one that ends before the run's own
// buffers begin, so the memory is shared).
PeakBuffers plan_peak_buffers(ArenaPlan& plan, bool with_copy, Lifetime life);

// Measures what was planned: median over `repeats` timed calls after `warmup` calls, each series
// after `lead_ms` of idle (time_repeats). Synchronizes: set-up only. Inputs are Philox normal
// values, never zeros.
Peaks measure_peaks(const Context& ctx, const Arena& arena, const PeakBuffers& buffers,
                    int warmup = 5, int repeats = 20, double lead_ms = 0);

}  // namespace replay::bench
