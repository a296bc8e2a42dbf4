// flags.h: the protocol flags every replay workload binary takes (--preset, --graphs, --steps,
// --warmup, --seed, --data, --json, --mllog, --verify-graphs, --host-delay-us, --log-interval,
// --device, --inject, --eval-interval, --eval-samples, --target-quality, --target-above-floor,
// --save, --save-interval,
// --load, --skip-peak, --dump-step, --tp, --dp, --comm-timeout-s, --print-config, and the
// schedule's --lr,
// --min-lr,
// --warmup-steps,
// --decay-steps), parsed with CLI11 together with the flags a workload adds for itself (--layers,
// --dropout, ...), and the validators both use, whose messages say what was expected ("--steps:
// 'many' is not an integer").
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace replay::train {

struct RunFlags {
  std::string preset;           // one of the workload's presets
  std::string graphs = "full";  // none | layer | full
  int64_t steps = 0;            // timed training steps; 0: the preset's default
  int warmup = 3;               // neutral warm-up steps before step 0 (undone, in every mode)
  uint64_t seed = 0;            // 0: drawn from the clock (and logged)
  std::string data;             // the workload's dataset; empty: its generated default
  std::string json;             // JSON summary path (reports/SCHEMA.md); empty: none
  std::string mllog;            // MLPerf log path; empty: none
  bool verify_graphs = false;   // step 0 runs every graph eagerly and graphed, compared bitwise
  double host_delay_us = 0;     // host busy-wait after every launch (common/check.h)
  int log_interval = 10;        // steps between progress lines
  int device = 0;               // CUDA device ordinal
  std::string inject;           // a planted fault (graphs/faults.h); empty: none
  int64_t eval_interval = 0;    // steps between evaluations (and one after the last step); 0: none
  int64_t eval_samples = 0;     // held-out samples per evaluation; 0: the workload's default
  bool print_config = false;    // print the resolved configuration as JSON and exit
  bool skip_peak = false;       // no start-up bf16 GEMM peak measurement (no MFU; sanitizers)
  double target_quality = NAN;  // stop at the first evaluation that reaches it (time to train)
  double target_above_floor = NAN;  // the same, at the data's loss floor + this (synthetic data)
  std::string save;                 // checkpoint directory (train/checkpoint.h); empty: none
  int64_t save_interval = 0;        // steps between checkpoints; 0: at the end only
  std::string load;                 // resume from this checkpoint file or directory; empty: fresh
  std::string dump_step;            // write the first step's loss, gradients and batch here
  int tp = 0;  // tensor-parallel degree of the shard (0: the preset's); processes per TP group
  int dp = 0;  // data-parallel ranks (0: every rank of the launch)
  double comm_timeout_s = 300;  // the watchdog's limit on a wait for the other ranks
  // Parameters per gradient bucket of the distributed optimizer (--dp > 1); 0: one bucket.
  int64_t dp_bucket_size = 40'000'000;
  // The learning-rate schedule, overriding the preset's where set (NaN, -1: the preset's).
  double lr = NAN;            // peak (base) learning rate
  double min_lr = NAN;        // the rate the decay ends at
  int64_t warmup_steps = -1;  // linear warm-up steps
  int64_t decay_steps = -1;   // the step the decay ends at (warm-up included)
};

// Parses the protocol flags and the workload's own, which `add_own` adds to the parser bound to its
// variables. Returns nothing when --help was printed to `out`. Throws bench::UsageError, naming the
// flag, for an unknown flag, a malformed or out-of-range value, an unknown preset or fault
// (`--inject help` lists the faults in the error).
std::optional<RunFlags> parse_flags(const std::string& tool,
                                    const std::vector<std::string>& presets,
                                    const std::string& default_preset,
                                    const std::function<void(CLI::App&)>& add_own, int argc,
                                    const char* const* argv, std::FILE* out = stdout);
// The same from a list of arguments without the program name (tests).
std::optional<RunFlags> parse_flags(const std::string& tool,
                                    const std::vector<std::string>& presets,
                                    const std::string& default_preset,
                                    const std::function<void(CLI::App&)>& add_own,
                                    const std::vector<std::string>& args, std::FILE* out = stdout);

// The resolved protocol flags, one "# key: value" line each, for the start-up header.
std::string describe(const RunFlags& flags);

// Validators for CLI11 options, the protocol's and the workloads' own.
CLI::Validator integer_in(long long lo, long long hi);
CLI::Validator unsigned_64();
CLI::Validator number_in(double lo, double hi);
constexpr long long kMaxInt = 2147483647;

}  // namespace replay::train
