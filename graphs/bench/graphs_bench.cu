// replay-graphs-bench: what CUDA graphs buy on launch-bound work. Two workloads, a chain of many short
// dependent kernels and a layer-like mix of short kernels of varied sizes, each run eagerly, as one graph
// and as many small graphs. Reports the eager per-kernel launch cost, the graph launch cost, the sum of the
// kernels' own durations (per-kernel events, in a separate pass), graph replay time and its ratio to that
// sum, and a sweep over a simulated slower host (a busy-wait before every launch call) that shows where
// graphs start to pay.
//
//   replay-graphs-bench [--kernels 1000] [--kernel-us 5] [--small-graph-size 10] [--repeats 20]
//                       [--host-delay-us 0,1,2,5,10,20,50] [--json FILE] [--device 0]
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/bench/timing.h"
#include "common/check.h"
#include "common/context.h"
#include "common/device_utils.cuh"
#include "graphs/graph.h"

namespace replay {
namespace {

using graphs::CaptureStream;
using graphs::Graph;
using Clock = std::chrono::steady_clock;
using Launch = std::function<void(cudaStream_t)>;

// ---- Kernels ----

// Compute-bound: `iters` dependent FMAs per element, so the duration scales with iters, not memory.
__global__ void fma_kernel(float* x, int64_t n, int iters) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = x[i];
    for (int k = 0; k < iters; ++k) v = fmaf(v, 0.9999f, 0.0001f);
    x[i] = v;
  }
}

// Memory-bound elementwise: y = 0.5 * y + x.
__global__ void axpy_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = 0.5f * y[i] + x[i];
}

// One block per row: out[r] = mean of row r (a norm-like reduction).
__global__ void row_mean_kernel(float* out, const float* x, int cols) {
  __shared__ float scratch[32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float s = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += row[c];
  s = block_reduce_sum(s, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = s / static_cast<float>(cols);
}

// ---- Workloads: lists of launches over buffers allocated once (a benchmark, not a workload: it owns
// plain device allocations made before anything is timed) ----

class DeviceArray {
 public:
  explicit DeviceArray(size_t n) {
    REPLAY_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(float)));
    REPLAY_CUDA_CHECK(cudaMemset(p_, 0, n * sizeof(float)));
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  float* get() const { return p_; }

 private:
  float* p_ = nullptr;
};

Launch fma_launch(float* x, int64_t n, int iters, int max_blocks) {
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(n, 256), max_blocks));
  return [=](cudaStream_t s) {
    fma_kernel<<<blocks, 256, 0, s>>>(x, n, iters);
    REPLAY_LAUNCH_CHECK();
  };
}

Launch axpy_launch(float* y, const float* x, int64_t n, int max_blocks) {
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(n, 256), max_blocks));
  return [=](cudaStream_t s) {
    axpy_kernel<<<blocks, 256, 0, s>>>(y, x, n);
    REPLAY_LAUNCH_CHECK();
  };
}

Launch row_mean_launch(float* out, const float* x, int rows, int cols) {
  return [=](cudaStream_t s) {
    row_mean_kernel<<<rows, 256, 0, s>>>(out, x, cols);
    REPLAY_LAUNCH_CHECK();
  };
}

// Mean device time of one launch, from per-launch events (used to calibrate the chain kernel).
double kernel_us(cudaStream_t stream, const Launch& launch) {
  const std::vector<double> ms = bench::time_repeats(stream, 3, 20, launch);
  return bench::summarize(ms).median * 1e3;
}

// ---- Measurements ----

void busy_wait_us(double us) {
  if (us <= 0) return;
  const auto until = Clock::now() + std::chrono::duration<double, std::micro>(us);
  while (Clock::now() < until) {
  }
}

struct Measured {
  int kernels = 0;
  double sum_kernel_us = 0;
  double eager_us = 0;
  double eager_launch_us_per_kernel = 0;
  double graph_us = 0;
  double graph_launch_us = 0;
  double small_graphs_us = 0;
  int small_graph_size = 0;
};

class Runner {
 public:
  Runner(cudaStream_t stream, std::vector<Launch> launches, int small_graph_size, int repeats)
      : stream_(stream), launches_(std::move(launches)), small_size_(small_graph_size), repeats_(repeats) {
    CaptureStream cap;
    whole_ = std::make_unique<Graph>("bench.whole");
    whole_->build(cap.get(), [&](cudaStream_t s) { for (const Launch& l : launches_) l(s); }, stream_);
    for (size_t first = 0; first < launches_.size(); first += static_cast<size_t>(small_size_)) {
      const size_t last = std::min(launches_.size(), first + static_cast<size_t>(small_size_));
      small_.emplace_back("bench.small." + std::to_string(small_.size()));
      small_.back().build(cap.get(), [&](cudaStream_t s) {
        for (size_t i = first; i < last; ++i) launches_[i](s);
      }, stream_);
    }
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // The sum of the kernels' own durations: one pair of events around every kernel, run apart from the
  // timed passes (the events themselves add gaps that must not count against eager or graph runs).
  double sum_kernel_us() const {
    const size_t n = launches_.size();
    std::vector<cudaEvent_t> ev(2 * n);
    for (cudaEvent_t& e : ev) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
    std::vector<double> sums;
    for (int r = 0; r < repeats_ + 2; ++r) {
      for (size_t i = 0; i < n; ++i) {
        REPLAY_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream_));
        launches_[i](stream_);
        REPLAY_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream_));
      }
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream_));
      double sum = 0;
      for (size_t i = 0; i < n; ++i) {
        float ms = 0;
        REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        sum += ms * 1e3;
      }
      if (r >= 2) sums.push_back(sum);  // the first two passes warm caches and clocks
    }
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    return bench::summarize(sums).median;
  }

  // Host cost of one eager launch: batches of launches, each followed by a synchronization so the launch
  // queue never fills and blocks the host.
  double eager_launch_us_per_kernel() const {
    constexpr size_t kBatch = 128;
    std::vector<double> per_launch;
    for (int r = 0; r < repeats_ + 2; ++r) {
      double host_us = 0;
      for (size_t first = 0; first < launches_.size(); first += kBatch) {
        const size_t last = std::min(launches_.size(), first + kBatch);
        const auto t0 = Clock::now();
        for (size_t i = first; i < last; ++i) launches_[i](stream_);
        host_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream_));
      }
      if (r >= 2) per_launch.push_back(host_us / static_cast<double>(launches_.size()));
    }
    return bench::summarize(per_launch).median;
  }

  double eager_us(double delay_us) const {
    return device_us([&](cudaStream_t s) {
      for (const Launch& l : launches_) {
        busy_wait_us(delay_us);
        l(s);
      }
    });
  }

  double graph_us(double delay_us) const {
    return device_us([&](cudaStream_t s) {
      busy_wait_us(delay_us);
      whole_->launch(s);
    });
  }

  double small_graphs_us(double delay_us) const {
    return device_us([&](cudaStream_t s) {
      for (const Graph& g : small_) {
        busy_wait_us(delay_us);
        g.launch(s);
      }
    });
  }

  // Host time of the cudaGraphLaunch call for the whole graph.
  double graph_launch_us() const {
    std::vector<double> us;
    for (int r = 0; r < repeats_ + 2; ++r) {
      const auto t0 = Clock::now();
      whole_->launch(stream_);
      const double t = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (r >= 2) us.push_back(t);
    }
    return bench::summarize(us).median;
  }

  Measured measure() const {
    Measured m;
    m.kernels = static_cast<int>(launches_.size());
    m.sum_kernel_us = sum_kernel_us();
    m.eager_us = eager_us(0);
    m.eager_launch_us_per_kernel = eager_launch_us_per_kernel();
    m.graph_us = graph_us(0);
    m.graph_launch_us = graph_launch_us();
    m.small_graphs_us = small_graphs_us(0);
    m.small_graph_size = small_size_;
    return m;
  }

 private:
  double device_us(const Launch& enqueue) const {
    return bench::summarize(bench::time_repeats(stream_, 2, repeats_, enqueue)).median * 1e3;
  }

  cudaStream_t stream_;
  std::vector<Launch> launches_;
  int small_size_;
  int repeats_;
  std::unique_ptr<Graph> whole_;
  std::vector<Graph> small_;
};

nlohmann::json to_json(const Measured& m) {
  return {{"kernels", m.kernels},
          {"sum_kernel_us", m.sum_kernel_us},
          {"eager_us", m.eager_us},
          {"eager_launch_us_per_kernel", m.eager_launch_us_per_kernel},
          {"graph_us", m.graph_us},
          {"graph_launch_us", m.graph_launch_us},
          {"graph_over_sum", m.graph_us / m.sum_kernel_us},
          {"small_graphs_us", m.small_graphs_us},
          {"small_graph_size", m.small_graph_size}};
}

void print_row(const char* name, const Measured& m) {
  std::printf("%-6s %7d %12.1f %10.1f %12.2f %10.1f %12.2f %10.3f %12.1f (%d)\n", name, m.kernels, m.sum_kernel_us,
              m.eager_us, m.eager_launch_us_per_kernel, m.graph_us, m.graph_launch_us, m.graph_us / m.sum_kernel_us,
              m.small_graphs_us, m.small_graph_size);
}

int run(int argc, char** argv) {
  CLI::App app{"replay-graphs-bench: eager launches, one graph and many small graphs on launch-bound work"};
  int kernels = 1000, small_size = 10, repeats = 20, device = 0;
  double target_us = 5.0;
  std::vector<double> delays{0, 1, 2, 5, 10, 20, 50};
  std::string json_path;
  app.add_option("--kernels", kernels, "kernels in the chain and in the mix")->check(CLI::Range(8, 100000));
  app.add_option("--kernel-us", target_us, "target duration of one chain kernel")->check(CLI::Range(0.5, 1000.0));
  app.add_option("--small-graph-size", small_size, "kernels per small graph")->check(CLI::Range(1, 100000));
  app.add_option("--repeats", repeats, "timed repeats of every measurement (median reported)")->check(CLI::Range(3, 10000));
  app.add_option("--host-delay-us", delays, "comma-separated busy-waits before every launch call")->delimiter(',');
  app.add_option("--json", json_path, "write the results as JSON to this file");
  app.add_option("--device", device, "CUDA device");
  CLI11_PARSE(app, argc, argv);

  Context ctx(device);
  const cudaStream_t stream = ctx.stream();
  const int sms = ctx.sm_count();
  const EnvironmentReport env = ctx.environment();
  std::printf("%s", env.to_text().c_str());
  std::printf("# kernels %d, chain kernel target %.1f us, small graphs of %d, %d repeats\n", kernels, target_us,
              small_size, repeats);

  // Chain: `kernels` dependent launches of one FMA kernel over one wave (sms x 256 threads), its
  // iteration count calibrated so that one kernel takes about target_us.
  const int64_t chain_n = static_cast<int64_t>(sms) * 256;
  DeviceArray chain_buf(static_cast<size_t>(chain_n));
  int iters = 1000;
  const double measured = kernel_us(stream, fma_launch(chain_buf.get(), chain_n, iters, sms));
  iters = std::max(1, static_cast<int>(iters * target_us / std::max(measured, 0.1)));
  const double chain_kernel = kernel_us(stream, fma_launch(chain_buf.get(), chain_n, iters, sms));
  std::printf("# chain kernel: %d FMA iterations, %.2f us\n", iters, chain_kernel);
  std::vector<Launch> chain(static_cast<size_t>(kernels), fma_launch(chain_buf.get(), chain_n, iters, sms));

  // Mix: a "layer" of eight kernels (norm-like row reductions, elementwise ops of 4 K to 1 M elements,
  // compute loops on small and full-wave grids), repeated to `kernels` launches.
  const int64_t big = int64_t{1} << 20;
  DeviceArray a(static_cast<size_t>(big)), b(static_cast<size_t>(big)), rows(4096);
  const std::vector<Launch> layer = {
      row_mean_launch(rows.get(), a.get(), 512, 1024),
      axpy_launch(b.get(), a.get(), big, 4 * sms),
      fma_launch(a.get(), 4096, 64, sms),
      axpy_launch(a.get(), b.get(), int64_t{1} << 16, 4 * sms),
      fma_launch(b.get(), static_cast<int64_t>(sms) * 256, iters / 4, sms),
      row_mean_launch(rows.get(), b.get(), 64, 4096),
      axpy_launch(b.get(), a.get(), int64_t{1} << 18, 4 * sms),
      fma_launch(rows.get(), 128, 16, 1),
  };
  std::vector<Launch> mix;
  for (int i = 0; i < kernels; ++i) mix.push_back(layer[static_cast<size_t>(i) % layer.size()]);

  const Runner chain_runner(stream, chain, small_size, repeats);
  const Runner mix_runner(stream, mix, small_size, repeats);
  const Measured chain_m = chain_runner.measure();
  const Measured mix_m = mix_runner.measure();

  std::printf("\n%-6s %7s %12s %10s %12s %10s %12s %10s %12s\n", "work", "kernels", "sum_kern_us", "eager_us",
              "launch_us/k", "graph_us", "g.launch_us", "graph/sum", "small_gr_us");
  print_row("chain", chain_m);
  print_row("mix", mix_m);

  std::printf("\nhost-delay sweep (chain; the delay precedes every launch call)\n%10s %12s %12s %14s %9s\n",
              "delay_us", "eager_us", "graph_us", "small_graphs_us", "speedup");
  nlohmann::json sweep = nlohmann::json::array();
  for (double d : delays) {
    const double e = chain_runner.eager_us(d), g = chain_runner.graph_us(d), s = chain_runner.small_graphs_us(d);
    std::printf("%10.1f %12.1f %12.1f %14.1f %8.2fx\n", d, e, g, s, e / g);
    sweep.push_back({{"host_delay_us", d}, {"eager_us", e}, {"graph_us", g}, {"small_graphs_us", s}, {"speedup", e / g}});
  }

  if (!json_path.empty()) {
    nlohmann::json environment = nlohmann::json::object();
    for (const auto& [k, v] : env.fields) environment[k] = v;
    const nlohmann::json out = {{"tool", "replay-graphs-bench"},
                                {"environment", environment},
                                {"chain", to_json(chain_m)},
                                {"mix", to_json(mix_m)},
                                {"sweep", sweep}};
    std::ofstream f(json_path);
    REPLAY_REQUIRE(f.good(), "cannot write " + json_path);
    f << out.dump(2) << "\n";
    std::printf("\nwrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace replay

int main(int argc, char** argv) {
  try {
    return replay::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replay-graphs-bench: %s\n", e.what());
    return 1;
  }
}
