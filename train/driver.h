// driver.h: the one run every workload binary makes (the benchmark protocol of README.md), as named
// steps of a short function: flags, resolved configuration, data check, device and environment,
// model and arena, MLPerf configuration, warm-up and capture, timed steps with evaluations between
// them, the final table, the JSON summary and the mllog file. A workload's main() is one line:
//   int main(int argc, char** argv) { MyWorkload w; return replay::train::main(w, argc, argv); }
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench/harness.h"
#include "train/flags.h"
#include "train/workload.h"

namespace replay::train {

// The workload's flags and the protocol's, parsed (nothing when --help was printed to `out`).
std::optional<RunFlags> parse(Workload& w, const std::vector<std::string>& args,
                              std::FILE* out = stdout);
// Fills in what the flags leave open (the seed from the clock, the preset's steps) and resolves the
// workload's configuration. Throws bench::UsageError for what the workload cannot run.
RunFlags resolve(Workload& w, RunFlags flags);
// The training configuration of the resolved workload with the schedule flags applied.
TrainingConfig training_config(const Workload& w, const RunFlags& flags);
// What --print-config prints: tool, workload, preset, version, the resolved configuration (shapes:
// replay-ops and the PyTorch baselines read them from here) and the training configuration.
nlohmann::ordered_json resolved_config(const Workload& w, const RunFlags& flags);

struct RunOptions {
  bool measure_peak = true;  // the bf16 GEMM peak at start-up (MFU); tests turn it off
};

struct RunResult {
  bench::WorkloadReport report;
  std::string master_hash;  // fp32 master weights after the last step (a distributed
                            // optimizer: this rank's share)
};
// One run of resolved flags: everything after parsing. Prints progress and the final table to
// `out`, writes the JSON summary and the MLPerf log when asked.
RunResult run(Workload& w, const RunFlags& flags, std::FILE* out = stdout,
              const RunOptions& options = {});

// The executable's main: parse, resolve, --print-config or run. Exit 0, 2 for a bad command line,
// 1 for any other error (bench::run_main).
int main(Workload& w, int argc, char** argv);

}  // namespace replay::train
