// workload_test_util.h: what the transformer workloads' tests share: running the executable, the
// tiny preset in each graph mode with bit-identity checks, one GPU step against an fp64 CPU model,
// and the executable's JSON summary and mllog checks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "train/driver.h"
#include "workloads/transformer/workload.h"

namespace replay::test {

bool has(const std::string& text, const std::string& what);

struct Outcome {
  int status;          // exit status, -1 when the command did not exit normally
  std::string output;  // stdout and stderr together
};
// Runs `cmd` through the shell with stderr folded into stdout.
Outcome shell(const std::string& cmd);

// The workload's flags parsed and resolved, as its binary would (driver.h parse and resolve).
train::RunFlags resolved(train::Workload& w, const std::vector<std::string>& args);

// The tiny preset with `extra` flags, seed 4242 and a learning rate that moves the tiny model
// within a few steps (MLPerf's schedules would leave the loss flat).
std::vector<std::string> tiny_args(const std::vector<std::string>& extra);

// One in-process run of the tiny preset with `extra` flags (no peak measurement).
train::RunResult run_tiny(const transformer::Recipe& r, const std::vector<std::string>& extra);

// none, layer and full train `args` and give bit-identical losses, bf16 weights and fp32 master
// weights, with the graph counts each mode implies (2 layers); the loss falls.
void expect_modes_bit_identical_and_loss_falls(const transformer::Recipe& r,
                                               const std::vector<std::string>& args);

// The tiny preset with its own schedule (no schedule flags) learns: 300 steps in full mode take the
// loss from about ln 512 to within 0.4 nats of the data's floor (the mean of the last 50 steps).
void expect_tiny_schedule_learns(const transformer::Recipe& r);

// Time to train: the tiny preset with its own schedule, evaluated on its held-out split every 50
// steps, reaches floor + 0.25 nats within 500 steps and stops there, in none, layer and full mode
// with bit-identical losses and evaluations; an unreachable target ends the run as MLPerf's
// "aborted" at the step limit.
void expect_time_to_train(const transformer::Recipe& r);

// Checkpoints: in none, layer and full mode, with dropout and two micro-batches, 20 steps in one
// run give the same losses, bf16 and fp32 weights and final checkpoint data as 10 steps, a save,
// a load and 10 more; a checkpoint saved eagerly resumes bit-exactly in full mode too.
void expect_resume_bit_exact(const transformer::Recipe& r);

// With `args` (two micro-batches) none, full and layer give bit-identical results; `full` and
// `layer` are left in the runs for the caller's graph-count checks.
struct ModeRuns {
  train::RunResult none, full, layer;
};
void expect_accumulation_bit_identical(const transformer::Recipe& r,
                                       const std::vector<std::string>& args, ModeRuns* runs);

// Two runs bit for bit the same: losses, model weights and fp32 master weights.
void expect_identical(const train::RunResult& a, const train::RunResult& b,
                      const std::string& what);

// The fp64 CPU model of a shard: its parameter layout (ParamStore order) and one backward pass
// (parameters in, loss out, every parameter's gradient and the embedding-output gradient filled).
struct ReferenceModel {
  int count;
  std::vector<int64_t> sizes;
  std::function<std::string(int id)> name;
  std::function<double(std::vector<std::vector<double>> params, const int32_t* tokens,
                       const int32_t* targets, std::vector<std::vector<double>>* grads,
                       std::vector<double>* dx0)>
      backward;
};
// One step of the resolved workload `w` (flags `f`) on the GPU: its loss, every parameter gradient
// and the embedding-output gradient match `ref` run on the same bf16 weights and batch.
void expect_one_step_matches(transformer::TransformerWorkload& w, const train::RunFlags& f,
                             const ReferenceModel& ref);

// A tiny run of `binary` writes a JSON summary with SCHEMA.md's fields and a complete mllog;
// `check_config` adds the workload's own config checks.
void expect_summary_and_mllog(const transformer::Recipe& r, const std::string& binary,
                              const std::function<void(const nlohmann::json& j)>& check_config);

// The mllog of that run passes MLCommons' compliance checker with `yaml` (replay's shard rules);
// exits 77 when the checker is not importable.
void expect_mllog_passes_checker(const transformer::Recipe& r, const std::string& binary,
                                 const std::string& yaml);

}  // namespace replay::test
