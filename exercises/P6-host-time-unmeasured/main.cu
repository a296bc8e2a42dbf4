// P6: where the host time goes. A step of 500 short kernels (about 5 us each), eagerly and as one
// graph. Timed only on the GPU with events, as P1 and P2 do, and with the GPU kept busy ahead of
// the region (the host has enqueued everything before the GPU reaches it), the two take about the
// same GPU time: "graphs don't help". What the events cannot see is the host: eagerly it spends
// about 500 launch calls' worth of time per step enqueueing, as a graph one launch call. Broken:
// the GPU- only measurement and its conclusion. Fixed: the host side measured too: the enqueue time
// of each form, cudaGraphInstantiate, cudaGraphUpload and the first launch with and without the
// upload, and the spread (percentiles) of the launch calls.
#include "common.h"

#include <algorithm>
#include <vector>

constexpr int kKernels = 500;
constexpr long long kSpinCycles = 10000;  // about 5 us at 1.8-2 GHz
constexpr int kGpuSteps = 10;             // broken: steps timed with events
constexpr int kHostSteps = 30;            // fixed: eager steps whose enqueue is timed
constexpr int kLaunches = 200;            // fixed: graph launches whose host call is timed
constexpr float kGpuOnlyBound = 1.5f;     // broken: the GPU-only speedup stays under it
constexpr float kHostRatio = 5.0f;        // fixed: eager enqueue over graph launch, at least
constexpr float kUploadRatio = 1.5f;      // fixed: first launch without upload over with, at least

__global__ void short_kernel(int* counter, long long cycles) {
  ex::spin_kernel_body(cycles);
  if (threadIdx.x == 0) atomicAdd(counter, 1);
}

using Clock = std::chrono::steady_clock;
static double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}
static double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * (v.size() - 1) + 0.5))];
}

static void enqueue_step(cudaStream_t stream, int* counter) {
  for (int k = 0; k < kKernels; ++k) short_kernel<<<1, 32, 0, stream>>>(counter, kSpinCycles);
}

static cudaGraph_t capture_step(cudaStream_t stream, int* counter) {
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue_step(stream, counter);
  EX_CHECK(cudaStreamEndCapture(stream, &graph));
  return graph;
}

// GPU time of one step, in us, measured with events only, as P1 and P2 do: a 5 ms kernel first
// keeps the GPU busy while the host enqueues the region, so the events time the GPU alone.
template <typename F>
static double gpu_only_us(cudaStream_t stream, F enqueue) {
  cudaEvent_t start, stop;
  EX_CHECK(cudaEventCreate(&start));
  EX_CHECK(cudaEventCreate(&stop));
  double total_ms = 0;
  for (int s = 0; s < kGpuSteps; ++s) {
    ex::spin_kernel<<<1, 32, 0, stream>>>(10000000);  // about 5 ms
    EX_CHECK(cudaEventRecord(start, stream));
    enqueue();
    EX_CHECK(cudaEventRecord(stop, stream));
    EX_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    EX_CHECK(cudaEventElapsedTime(&ms, start, stop));
    total_ms += ms;
  }
  EX_CHECK(cudaEventDestroy(start));
  EX_CHECK(cudaEventDestroy(stop));
  return total_ms * 1e3 / kGpuSteps;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "P6");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  int* counter = ex::device_zeros<int>();
  long long expected = 0;

  // Warm-up: the kernels loaded, one graph instantiated, uploaded and launched, so the first-launch
  // measurements below see only their own graph's costs.
  enqueue_step(stream, counter);
  expected += kKernels;
  cudaGraph_t graph = capture_step(stream, counter);
  cudaGraphExec_t warm = ex::instantiate(graph);
  EX_CHECK(cudaGraphUpload(warm, stream));
  for (int i = 0; i < 3; ++i) EX_CHECK(cudaGraphLaunch(warm, stream));
  expected += 3 * kKernels;
  EX_CHECK(cudaStreamSynchronize(stream));

  if (args.broken()) {
    const double eager_us = gpu_only_us(stream, [&] { enqueue_step(stream, counter); });
    const double graph_us = gpu_only_us(stream, [&] { EX_CHECK(cudaGraphLaunch(warm, stream)); });
    expected += 2LL * kGpuSteps * kKernels;
    EX_CHECK(cudaStreamSynchronize(stream));
    ex::destroy_graph(warm, graph);
    const int value = ex::read_back(counter);
    const double speedup = eager_us / graph_us;
    const bool ok = value == expected && speedup < kGpuOnlyBound;
    return ex::report("P6", args, ok,
                      "%d kernels of ~5 us, GPU time only (events): eager %.0f us, graph %.0f us a "
                      "step: speedup %.2fx (under %.1fx: \"graphs don't help\"); host time not "
                      "measured",
                      kKernels, eager_us, graph_us, speedup, kGpuOnlyBound);
  }

  // The host side. Eager: the time the host spends enqueueing one step (the GPU idle at the start,
  // so no launch waits for a full queue).
  std::vector<double> eager_enqueue, graph_launch;
  for (int s = 0; s < kHostSteps; ++s) {
    const auto t0 = Clock::now();
    enqueue_step(stream, counter);
    eager_enqueue.push_back(us_since(t0));
    EX_CHECK(cudaStreamSynchronize(stream));
  }
  expected += kHostSteps * kKernels;
  // Graph: the host time of each cudaGraphLaunch call.
  for (int s = 0; s < kLaunches; ++s) {
    const auto t0 = Clock::now();
    EX_CHECK(cudaGraphLaunch(warm, stream));
    graph_launch.push_back(us_since(t0));
    EX_CHECK(cudaStreamSynchronize(stream));
  }
  expected += kLaunches * kKernels;
  // The GPU time of each form, driven by the host (no lead kernel): the host is in the loop.
  const double eager_gpu_us = 1e3 * ex::time_ms(stream, 5, [&] { enqueue_step(stream, counter); });
  const double graph_gpu_us =
      1e3 * ex::time_ms(stream, 5, [&] { EX_CHECK(cudaGraphLaunch(warm, stream)); });
  expected += 2LL * 6 * kKernels;

  // Instantiate, upload, first launch: exec A launched without an upload, exec B uploaded first.
  auto t0 = Clock::now();
  cudaGraphExec_t a = ex::instantiate(graph);
  const double instantiate_us = us_since(t0);
  t0 = Clock::now();
  EX_CHECK(cudaGraphLaunch(a, stream));
  const double first_no_upload_us = us_since(t0);
  EX_CHECK(cudaStreamSynchronize(stream));
  t0 = Clock::now();
  EX_CHECK(cudaGraphLaunch(a, stream));
  const double second_us = us_since(t0);
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaGraphExec_t b = ex::instantiate(graph);
  t0 = Clock::now();
  EX_CHECK(cudaGraphUpload(b, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const double upload_us = us_since(t0);
  t0 = Clock::now();
  EX_CHECK(cudaGraphLaunch(b, stream));
  const double first_uploaded_us = us_since(t0);
  EX_CHECK(cudaStreamSynchronize(stream));
  expected += 3LL * kKernels;
  ex::destroy_graph(a, graph);
  EX_CHECK(cudaGraphExecDestroy(b));
  EX_CHECK(cudaGraphExecDestroy(warm));

  const int value = ex::read_back(counter);
  const double eager_p50 = percentile(eager_enqueue, 0.5);
  const double launch_p50 = percentile(graph_launch, 0.5);
  const double host_ratio = eager_p50 / launch_p50;
  const double upload_ratio = first_no_upload_us / first_uploaded_us;
  const bool ok = value == expected && host_ratio >= kHostRatio && upload_ratio >= kUploadRatio;
  return ex::report(
      "P6", args, ok,
      "%d kernels of ~5 us: host enqueue eager %.0f us, graph launch %.1f us a step (%.0fx, over "
      "%.0fx); GPU time eager %.0f us, graph %.0f us; instantiate %.0f us, upload %.0f us, first "
      "launch without upload %.1f us, with upload %.1f us (%.1fx, over %.1fx), second %.1f us; "
      "launch p50 %.1f p90 %.1f p99 %.1f max %.1f us; eager enqueue p50 %.0f p99 %.0f max %.0f us",
      kKernels, eager_p50, launch_p50, host_ratio, kHostRatio, eager_gpu_us, graph_gpu_us,
      instantiate_us, upload_us, first_no_upload_us, first_uploaded_us, upload_ratio, kUploadRatio,
      second_us, launch_p50, percentile(graph_launch, 0.9), percentile(graph_launch, 0.99),
      percentile(graph_launch, 1.0), eager_p50, percentile(eager_enqueue, 0.99),
      percentile(eager_enqueue, 1.0));
}
