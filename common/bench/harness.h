// harness.h: the benchmark protocol every workload binary shares: main()'s error handling, the
// timed step loop (events on the work stream read late, host enqueue time per step, progress lines
// fed by a late readback, evaluations between steps kept out of the step times), the final table,
// the JSON summary of reports/SCHEMA.md "Workload runs", and hashes of losses and weights. The
// flags and the run itself are train/'s (train/driver.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench/timing.h"
#include "common/context.h"
#include "common/hash.h"

namespace replay::bench {

// A command line the workload cannot run (bad flag, value out of range, unknown preset): run_main
// prints "<tool>: <message>" and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs `body` and returns its exit status; a UsageError prints "<tool>: <message>" and returns 2,
// any other exception (replay::Error included) prints "<tool>: <message>" and returns 1.
int run_main(const char* tool, const std::function<int()>& body);

// A seed for --seed 0: nanoseconds of the clock mixed by splitmix64; never 0.
uint64_t seed_from_clock();

// The shortest decimal that reads back as `v`, as a double: 0.1f prints as 0.1 in JSON rather than
// 0.10000000149011612.
double decimal(float v);

// ---- The timed step loop ----

// What the host reads back from one step, steps late (the graph layer's ReadbackRing). NaN: absent.
struct StepSample {
  double loss = NAN;
  double lr = NAN;
  double grad_norm = NAN;
  double loss_scale = NAN;  // with dynamic loss scaling only
};

struct LoopConfig {
  int64_t steps = 0;
  int64_t first_step = 0;  // steps taken before this run (a resumed run): progress lines count on
  int log_interval = 10;
  int readback_lag = 2;            // after enqueuing step s the host reads step s - lag
  int64_t untimed_steps = 0;       // leading steps left out of the statistics (a verified step)
  double units_per_step = 0;       // in the throughput unit (tokens, images, ...)
  std::string unit_short = "tok";  // in progress lines: "tok/s"
  double flops_per_step = 0;       // model FLOPs of one step
  double peak_tflops = 0;          // measured bf16 GEMM peak; 0: MFU not reported
};

struct LoopCallbacks {
  std::function<void(int64_t step)> enqueue;     // enqueues step `step`; never synchronizes
  std::function<StepSample(int64_t step)> read;  // waits for step `step` only, then reads it
  // Called with each progress line's values (e.g. MLPerf tracked_stats). Optional.
  std::function<void(int64_t step, double units_per_s, const StepSample&)> on_progress;
  // Called after step `step` was enqueued and its end event recorded, before the next step's start
  // event. Work it enqueues (an evaluation) is outside every step's time; kStop ends the loop after
  // this step (a target quality reached). Optional.
  enum class After { kNothing, kWorked, kStop };
  std::function<After(int64_t step)> after_step;
};

struct LoopResult {
  int64_t steps_run = 0;                // config.steps, or fewer when after_step stopped the loop
  std::vector<double> step_ms;          // per timed step, from events on the work stream
  std::vector<double> host_enqueue_us;  // per timed step, host clock around enqueue()
  std::vector<float> losses;            // every step's loss, in order (steps_run of them)
  Stats step_stats;                     // over step_ms
  Stats host_stats;                     // over host_enqueue_us
};

// Runs `config.steps` steps on `stream`. An event is recorded before and after each step; they are
// read only for steps the host has already read back (never the current one) and after the loop.
// Prints a progress line every log_interval steps (step, loss, mean step ms of the window, units/s,
// TFLOP/s, MFU) to `out`.
LoopResult run_steps(cudaStream_t stream, const LoopConfig& config, const LoopCallbacks& callbacks,
                     std::FILE* out = stdout);

// ---- Reports ----

// The exact float bits of every loss, hashed in order.
std::string loss_hash(const std::vector<float>& losses);
// Device memory copied to the host in pieces and hashed (synchronous: after the run only).
std::string device_hash(const void* device, size_t bytes);

// Device memory in use (total - free, cudaMemGetInfo): taken before the arena and after the run.
size_t device_used_bytes();

// One evaluation of a run: after `step` steps, over `samples` held-out samples.
struct EvalResult {
  int64_t step = 0;
  int64_t samples = 0;
  double value = NAN;
  double seconds = 0;  // the evaluation's wall time (its share of the time to train)
};

// One checkpoint a run saved (train/checkpoint.h).
struct CheckpointRecord {
  int64_t step = 0;  // steps taken when it was saved
  std::string path;
  uint64_t bytes = 0;
  double seconds = 0;  // the save's wall time, the device sync included
};

// One workload run, as SCHEMA.md "Workload runs" writes it.
struct WorkloadReport {
  std::string tool, version, workload, preset, graphs;
  EnvironmentReport environment;
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  std::string tensor_parallel_collectives;
  Stats step_ms;
  Stats host_enqueue_us;
  std::string unit = "tokens";  // the throughput unit: JSON throughput.<unit>_per_s
  double units_per_step = 0;
  double samples_per_step = 0;
  double flops_per_step = 0;
  std::string flops_formula;
  double peak_tflops = 0;  // 0: not measured (null in the JSON)
  int64_t peak_bytes = 0;  // device memory used at the end of the run minus before the arena
                           // (GPU-wide: other processes on the GPU distort it)
  int64_t arena_bytes = 0;
  int graph_count = 0;
  int64_t graph_nodes = 0;
  double capture_ms = 0;
  double instantiate_ms = 0;
  std::vector<float> losses;
  std::optional<std::string> weights_hash;
  std::optional<double> loss_floor;
  std::string eval_metric;  // empty: the run did not evaluate
  std::vector<EvalResult> evals;
  // Time to train (--target-quality): the target, the steps that reached it and MLPerf's measure,
  // run_start to run_stop; the last two absent when it was not reached.
  std::optional<double> target_quality;
  std::optional<int64_t> steps_to_target;
  std::optional<double> time_to_train_s;
  // Checkpoints: the one the run resumed from (its path and the steps it had taken) and those it
  // saved.
  std::string resumed_from;
  int64_t first_step = 0;
  std::vector<CheckpointRecord> checkpoints;
  // The layout: processes, data-parallel ranks, and each rank's median step time (rank order).
  int world_size = 1;
  int data_parallel = 1;
  int tensor_parallel = 1;  // processes per tensor-parallel group (1: none, or rank 0 simulated)
  std::vector<double> rank_step_ms;
  // The collectives of one step and their bytes (nccl-tests' sizes); -1: not counted.
  int64_t grad_buckets = 0;  // data parallel: gradient buckets reduce-scattered a step
  // The step's collectives as the warm-up timed them (one rank's view; multi-GPU runs): each
  // communicator's kinds, dtypes and sizes, the calls a step, the median time, the bus bandwidth.
  struct CollectiveStat {
    std::string comm, collective, dtype;
    int64_t bytes = 0;
    double calls_per_step = 0, median_us = 0, busbw_gbps = 0;
    bool overlapped = false;  // on a side stream beside the step's other work
  };
  std::vector<CollectiveStat> collectives;
  int64_t collectives_per_step = -1;
  int64_t comm_bytes_per_step = -1;

  double units_per_s() const;
  double model_tflops() const;
};

nlohmann::ordered_json to_json(const WorkloadReport& report);
// The environment report as a JSON object (every benchmark's "environment" block).
nlohmann::ordered_json to_json(const EnvironmentReport& environment);
// Writes `doc` to `path` through a temporary file and a rename: never half a file.
void write_json(const std::string& path, const nlohmann::ordered_json& doc);
// The final table printed at the end of a run.
std::string summary(const WorkloadReport& report);

}  // namespace replay::bench
