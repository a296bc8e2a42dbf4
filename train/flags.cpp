// flags.cpp: the protocol flags and their validators (CLI11).
#include "train/flags.h"

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "common/bench/harness.h"  // UsageError
#include "graphs/faults.h"

namespace replay::train {

namespace {

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

}  // namespace

CLI::Validator integer_in(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE) return "'" + s + "' is not an integer";
        if (v < lo || v > hi)
          return "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + s;
        return {};
      },
      hi == kMaxInt ? ">=" + std::to_string(lo)
                    : "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

CLI::Validator unsigned_64() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || s[0] == '-' || *end != '\0' || errno == ERANGE)
          return "'" + s + "' is not an integer in [0, 2^64)";
        return {};
      },
      "");
}

CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0') return "'" + s + "' is not a number";
        if (!(v >= lo && v <= hi))
          return "must be in [" + format_number(lo) + ", " + format_number(hi) + "], got " + s;
        return {};
      },
      "[" + format_number(lo) + ", " + format_number(hi) + "]");
}

std::optional<RunFlags> parse_flags(const std::string& tool,
                                    const std::vector<std::string>& presets,
                                    const std::string& default_preset,
                                    const std::function<void(CLI::App&)>& add_own, int argc,
                                    const char* const* argv, std::FILE* out) {
  RunFlags f;
  f.preset = default_preset;
  CLI::App app{tool + ": one replay workload, timed in one graph mode (README.md, \"The suite\")"};
  app.add_option("--preset", f.preset, "model preset: " + join(presets))
      ->check(CLI::IsMember(presets));
  app.add_option("--graphs", f.graphs,
                 "graph mode: none (eager), layer (per-layer graphs), full (one graph per step)")
      ->check(CLI::IsMember({"none", "layer", "full"}));
  app.add_option("--steps", f.steps, "timed training steps (0: the preset's default)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--warmup", f.warmup, "neutral warm-up steps before step 0 (undone in every mode)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--seed", f.seed, "seed of weights, data order and dropout (0: from the clock)")
      ->check(unsigned_64());
  app.add_option("--data", f.data, "the dataset (datasets/); default: generated for the preset");
  app.add_option("--json", f.json, "write the JSON summary here (reports/SCHEMA.md)");
  app.add_option("--mllog", f.mllog, "write the MLPerf log here (scripts/mlperf/README.md)");
  app.add_flag("--verify-graphs", f.verify_graphs,
               "run step 0's graphs eagerly and graphed on the same inputs and compare bitwise");
  app.add_option("--host-delay-us", f.host_delay_us,
                 "host busy-wait after every kernel and library launch (eager work pays it per "
                 "launch, graphs only at capture)")
      ->check(number_in(0.0, 1e6));
  app.add_option("--log-interval", f.log_interval, "steps between progress lines")
      ->check(integer_in(1, kMaxInt));
  app.add_option("--device", f.device, "CUDA device ordinal")->check(integer_in(0, 1023));
  app.add_option("--inject", f.inject,
                 "plant a CUDA-graph fault in the step (--inject help lists them)");
  app.add_option("--eval-interval", f.eval_interval,
                 "evaluate on held-out data every N steps and after the last (0: never)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--eval-samples", f.eval_samples,
                 "held-out samples per evaluation (0: the workload's default)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--target-quality", f.target_quality,
                 "stop at the first evaluation that reaches this value of the workload's metric "
                 "and report the time to train (needs --eval-interval)")
      ->check(number_in(-1e30, 1e30));
  app.add_option("--target-above-floor", f.target_above_floor,
                 "the same, with the target this many nats above the data's loss floor (synthetic "
                 "data, whose floor is known)")
      ->check(number_in(0.0, 1e3));
  app.add_option("--lr", f.lr, "peak learning rate (default: the preset's schedule)")
      ->check(number_in(0.0, 1e3));
  app.add_option("--min-lr", f.min_lr, "learning rate the decay ends at (default: the preset's)")
      ->check(number_in(0.0, 1e3));
  app.add_option("--warmup-steps", f.warmup_steps, "linear warm-up steps (default: the preset's)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--decay-steps", f.decay_steps,
                 "the step the decay ends at, warm-up included (default: the preset's)")
      ->check(integer_in(1, kMaxInt));
  app.add_option("--save", f.save,
                 "save checkpoints in this directory (step-N.safetensors): at the end, and every "
                 "--save-interval steps");
  app.add_option("--save-interval", f.save_interval,
                 "steps between checkpoints (0: at the end only)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--load", f.load,
                 "resume from a checkpoint: a step-N.safetensors file or a --save directory (its "
                 "newest); --steps more steps follow");
  app.add_option("--dump-step", f.dump_step,
                 "write the first step's loss, gradients and batch to this safetensors file (a "
                 "cross-check with another tool)");
  app.add_option("--tp", f.tp,
                 "tensor-parallel degree of the shard (0: the preset's); under mpiexec each group "
                 "of --tp processes runs one model with its collectives, one process alone "
                 "computes rank 0's shard")
      ->check(integer_in(0, 1024));
  app.add_option("--dp", f.dp,
                 "data-parallel ranks (launch one process per GPU with mpiexec or srun; 0: all of "
                 "them)")
      ->check(integer_in(0, 1 << 20));
  app.add_option(
         "--dp-bucket-size", f.dp_bucket_size,
         "data parallelism: parameters per gradient bucket, each reduce-scattered as soon as "
         "the backward finishes it, overlapping the rest (Megatron's 40M by default; 0: one "
         "bucket after the backward)")
      ->check(integer_in(0, kMaxInt));
  app.add_option("--comm-timeout-s", f.comm_timeout_s,
                 "give up a wait for the other ranks after this many seconds (NCCL abort)")
      ->check(number_in(1.0, 1e6));
  app.add_flag("--skip-peak", f.skip_peak,
               "skip the start-up bf16 GEMM peak measurement (no MFU in the output; for "
               "compute-sanitizer runs, scripts/sanitize.sh)");
  app.add_flag("--print-config", f.print_config,
               "print the resolved configuration as JSON and exit (no GPU needed)");
  if (add_own) add_own(app);
  try {
    app.parse(argc, const_cast<char**>(argv));
  } catch (const CLI::CallForHelp&) {
    if (out != nullptr) std::fputs(app.help().c_str(), out);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw bench::UsageError(std::string(e.what()) + " (run with --help for the flags)");
  }
  if (!f.inject.empty()) {
    bool known = false;
    for (const graphs::FaultInfo& k : graphs::fault_catalogue())
      known = known || f.inject == k.name;
    if (!known) {
      std::string list = graphs::describe_faults();
      list.pop_back();  // run_main ends the line
      throw bench::UsageError((f.inject == "help" ? std::string("--inject: the faults it plants")
                                                  : "--inject: unknown fault '" + f.inject + "'") +
                              " (one of):\n" + list);
    }
  }
  return f;
}

std::optional<RunFlags> parse_flags(const std::string& tool,
                                    const std::vector<std::string>& presets,
                                    const std::string& default_preset,
                                    const std::function<void(CLI::App&)>& add_own,
                                    const std::vector<std::string>& args, std::FILE* out) {
  std::vector<const char*> argv{tool.c_str()};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return parse_flags(tool, presets, default_preset, add_own, static_cast<int>(argv.size()),
                     argv.data(), out);
}

std::string describe(const RunFlags& f) {
  std::ostringstream os;
  os << "# preset: " << f.preset << "\n# graphs: " << f.graphs << "\n# steps: " << f.steps
     << "\n# warmup: " << f.warmup << "\n# seed: " << f.seed
     << "\n# data: " << (f.data.empty() ? "-" : f.data)
     << "\n# json: " << (f.json.empty() ? "-" : f.json)
     << "\n# mllog: " << (f.mllog.empty() ? "-" : f.mllog)
     << "\n# verify_graphs: " << (f.verify_graphs ? "yes" : "no")
     << "\n# host_delay_us: " << f.host_delay_us << "\n# log_interval: " << f.log_interval
     << "\n# device: " << f.device << "\n";
  if (!std::isnan(f.lr)) os << "# lr: " << f.lr << "\n";
  if (!std::isnan(f.min_lr)) os << "# min_lr: " << f.min_lr << "\n";
  if (f.warmup_steps >= 0) os << "# warmup_steps: " << f.warmup_steps << "\n";
  if (f.decay_steps >= 0) os << "# decay_steps: " << f.decay_steps << "\n";
  if (!std::isnan(f.target_quality)) os << "# target_quality: " << f.target_quality << "\n";
  if (!std::isnan(f.target_above_floor))
    os << "# target_above_floor: " << f.target_above_floor << "\n";
  if (f.eval_interval > 0)
    os << "# eval_interval: " << f.eval_interval << "\n# eval_samples: " << f.eval_samples << "\n";
  if (!f.inject.empty()) os << "# inject: " << f.inject << "\n";
  if (!f.load.empty()) os << "# load: " << f.load << "\n";
  if (!f.save.empty())
    os << "# save: " << f.save << " (every " << f.save_interval << " steps; 0: at the end)\n";
  return os.str();
}

}  // namespace replay::train
