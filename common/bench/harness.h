// harness.h: the benchmark protocol every workload binary shares: the common flags (CLI11), the
// host-delay hook, the timed step loop (events on the work stream read late, host enqueue time per
// step, progress lines fed by a late readback), the final table, the JSON summary of
// reports/SCHEMA.md "Workload runs", hashes of losses and weights, and main()'s error handling.
//
// A workload's main reads like this:
//   int main(int argc, char** argv) {
//     return bench::run_main("replay-gpt3", [&] {
//       const auto flags = bench::parse_flags("replay-gpt3", argc, argv, presets, "tiny");
//       if (!flags) return 0;                        // --help was printed
//       ... resolve presets, print bench::describe(flags), build the model ...
//       const bench::LoopResult r = bench::run_steps(stream, loop, {enqueue, read, on_progress});
//       ... fill a bench::WorkloadReport, print bench::summary(report), write_json(...) ...
//     });
//   }
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

// ---- Flags shared by every workload (DESIGN.md, "Benchmark protocol") ----

struct HarnessFlags {
  std::string preset;           // one of the workload's presets
  std::string graphs = "full";  // none | layer | full
  int64_t steps = 0;            // timed training steps; 0: the preset's default
  int warmup = 3;               // neutral warm-up steps before step 0 (undone, in every mode)
  uint64_t seed = 0;            // 0: drawn from the clock (and logged)
  std::string data;             // token file; empty: the preset's generated default
  std::string json;             // JSON summary path (reports/SCHEMA.md); empty: none
  std::string mllog;            // MLPerf log path; empty: none
  bool verify_graphs = false;   // step 0 runs every graph eagerly and graphed, compared bitwise
  double host_delay_us = 0;     // host busy-wait before each kernel launch in eager regions
  int log_interval = 10;        // steps between progress lines
  int layers = 0;               // 0: the preset's default
  int microbatches = 1;         // gradient-accumulation micro-batches per step
  double dropout = NAN;         // NaN: the preset's (MLPerf: 0)
  int device = 0;               // CUDA device ordinal
  std::string inject;           // a planted fault (injectable_faults()); empty: none
};

// ---- Fault injection (--inject) ----

// A fault a workload can plant in its step (--inject; exercises/README.md).
struct FaultInfo {
  const char* name;  // the --inject value: "host-sync-in-capture"
  const char* what;  // one line: the bug it plants and who detects it
};
// Every fault --inject accepts, in the order --inject help lists them.
const std::vector<FaultInfo>& injectable_faults();
// The faults, one "  name  what" line each (`--inject help`, and a bad value's error).
std::string describe_faults();

// Parses the shared flags. Returns nothing when --help was printed to `out`. Throws UsageError,
// naming the flag, for an unknown flag, a malformed or out-of-range value, or an unknown preset.
std::optional<HarnessFlags> parse_flags(const std::string& tool, int argc, const char* const* argv,
                                        const std::vector<std::string>& presets,
                                        const std::string& default_preset, std::FILE* out = stdout);
// The same from a list of arguments without the program name (tests).
std::optional<HarnessFlags> parse_flags(const std::string& tool,
                                        const std::vector<std::string>& args,
                                        const std::vector<std::string>& presets,
                                        const std::string& default_preset, std::FILE* out = stdout);

// A seed for --seed 0: nanoseconds of the clock mixed by splitmix64; never 0.
uint64_t seed_from_clock();
// The resolved flags, one "# key: value" line each, for the start-up header.
std::string describe(const HarnessFlags& flags);

// ---- Host-delay hook ----

// --host-delay-us: a host busy-wait of the given length. A workload calls it before every kernel or
// library launch, so eager regions pay it per launch and graphed regions only while capturing:
// what a slower host (Python, a framework's dispatcher) costs, and what graphs hide.
class HostDelay {
 public:
  explicit HostDelay(double microseconds = 0.0);
  void operator()() const;
  double microseconds() const { return static_cast<double>(ns_) / 1e3; }

 private:
  int64_t ns_ = 0;
};

// ---- The timed step loop ----

// What the host reads back from one step, steps late (the graph layer's ReadbackRing). NaN: absent.
struct StepSample {
  double loss = NAN;
  double lr = NAN;
  double grad_norm = NAN;
};

struct LoopConfig {
  int64_t steps = 0;
  int log_interval = 10;
  int readback_lag = 2;       // after enqueuing step s the host reads step s - lag
  int64_t untimed_steps = 0;  // leading steps left out of the statistics (a verified step)
  double tokens_per_step = 0;
  double flops_per_step = 0;  // model FLOPs of one step
  double peak_tflops = 0;     // measured bf16 GEMM peak; 0: MFU not reported
};

struct LoopCallbacks {
  std::function<void(int64_t step)> enqueue;     // enqueues step `step`; never synchronizes
  std::function<StepSample(int64_t step)> read;  // waits for step `step` only, then reads it
  // Called with each progress line's values (e.g. MLPerf tracked_stats). Optional.
  std::function<void(int64_t step, double tokens_per_s, const StepSample&)> on_progress;
};

struct LoopResult {
  std::vector<double> step_ms;          // per timed step, from events on the work stream
  std::vector<double> host_enqueue_us;  // per timed step, host clock around enqueue()
  std::vector<float> losses;            // every step's loss, in order
  Stats step_stats;                     // over step_ms
  Stats host_stats;                     // over host_enqueue_us
};

// Runs `config.steps` steps on `stream`. An event is recorded before each step and after the last;
// they are read only for steps the host has already read back (never the current one) and after
// the loop. Prints a progress line every log_interval steps (step, loss, step ms, tokens/s,
// TFLOP/s, MFU) to `out`.
LoopResult run_steps(cudaStream_t stream, const LoopConfig& config, const LoopCallbacks& callbacks,
                     std::FILE* out = stdout);

// ---- Reports ----

// 64-bit hash (FNV-1a over little-endian 64-bit words, then the tail bytes), fed in pieces.
class Hasher {
 public:
  void update(const void* data, size_t bytes);
  uint64_t value() const;
  std::string hex() const;  // 16 hex digits

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
  unsigned char tail_[8] = {};
  size_t tail_bytes_ = 0;
};
// The exact float bits of every loss, hashed in order.
std::string loss_hash(const std::vector<float>& losses);
// Device memory copied to the host in pieces and hashed (synchronous: after the run only).
std::string device_hash(const void* device, size_t bytes);

// Device memory in use (total - free, cudaMemGetInfo): taken before the arena and after the run.
size_t device_used_bytes();

// One workload run, as SCHEMA.md "Workload runs" writes it.
struct WorkloadReport {
  std::string tool, version, workload, preset, graphs;
  EnvironmentReport environment;
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  std::string tensor_parallel_collectives;
  Stats step_ms;
  Stats host_enqueue_us;
  double tokens_per_step = 0;
  double samples_per_step = 0;
  double flops_per_step = 0;
  std::string flops_formula;
  double peak_tflops = 0;  // 0: not measured (null in the JSON)
  int64_t peak_bytes = 0;  // device memory used at the end of the run minus before the arena
  int64_t arena_bytes = 0;
  int graph_count = 0;
  int64_t graph_nodes = 0;
  double capture_ms = 0;
  double instantiate_ms = 0;
  std::vector<float> losses;
  std::optional<std::string> weights_hash;
  std::optional<double> loss_floor;

  double tokens_per_s() const;
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
