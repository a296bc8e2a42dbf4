// The protocol flags on the CPU: defaults, every flag, a workload's own flag beside them, clear
// errors naming the flag, --help listing every flag, --inject's catalogue, and the start-up header.
#include "train/flags.h"

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/bench/harness.h"

namespace replay::train {
namespace {

const std::vector<std::string> kPresets = {"tiny", "big"};

// A workload's own flag, as a workload adds it.
struct OwnFlags {
  int width = 8;
  void add(CLI::App& app) {
    app.add_option("--width", width, "the model's width")->check(integer_in(1, 4096));
  }
};

RunFlags parse(const std::vector<std::string>& args, OwnFlags* own = nullptr) {
  OwnFlags scratch;
  OwnFlags& o = own ? *own : scratch;
  const auto f = parse_flags(
      "tool", kPresets, "tiny", [&o](CLI::App& app) { o.add(app); }, args);
  EXPECT_TRUE(f.has_value());
  return f.value_or(RunFlags{});
}

std::string usage_error(const std::vector<std::string>& args) {
  try {
    OwnFlags o;
    parse_flags(
        "tool", kPresets, "tiny", [&o](CLI::App& app) { o.add(app); }, args);
  } catch (const bench::UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

TEST(RunFlags, DefaultsAndEveryFlag) {
  const RunFlags d = parse({});
  EXPECT_EQ(d.preset, "tiny");
  EXPECT_EQ(d.graphs, "full");
  EXPECT_EQ(d.steps, 0);
  EXPECT_EQ(d.warmup, 3);
  EXPECT_EQ(d.seed, 0u);
  EXPECT_EQ(d.log_interval, 10);
  EXPECT_FALSE(d.verify_graphs);
  EXPECT_FALSE(d.print_config);
  EXPECT_FALSE(d.skip_peak);
  EXPECT_EQ(d.eval_interval, 0);
  EXPECT_TRUE(std::isnan(d.lr) && std::isnan(d.min_lr));
  EXPECT_EQ(d.warmup_steps, -1);
  EXPECT_EQ(d.decay_steps, -1);

  OwnFlags own;
  const RunFlags f = parse({"--preset",
                            "big",
                            "--graphs",
                            "layer",
                            "--steps",
                            "7",
                            "--warmup",
                            "0",
                            "--seed",
                            "18446744073709551615",
                            "--data",
                            "d.h5",
                            "--json",
                            "r.json",
                            "--mllog",
                            "r.mllog",
                            "--verify-graphs",
                            "--host-delay-us",
                            "12.5",
                            "--log-interval",
                            "2",
                            "--device",
                            "1",
                            "--inject",
                            "stale-input",
                            "--eval-interval",
                            "5",
                            "--eval-samples",
                            "64",
                            "--lr",
                            "0.001",
                            "--min-lr",
                            "1e-4",
                            "--warmup-steps",
                            "3",
                            "--decay-steps",
                            "900",
                            "--print-config",
                            "--skip-peak",
                            "--width",
                            "64"},
                           &own);
  EXPECT_EQ(f.preset, "big");
  EXPECT_EQ(f.graphs, "layer");
  EXPECT_EQ(f.steps, 7);
  EXPECT_EQ(f.warmup, 0);
  EXPECT_EQ(f.seed, 18446744073709551615ull);
  EXPECT_EQ(f.data, "d.h5");
  EXPECT_EQ(f.json, "r.json");
  EXPECT_EQ(f.mllog, "r.mllog");
  EXPECT_TRUE(f.verify_graphs);
  EXPECT_DOUBLE_EQ(f.host_delay_us, 12.5);
  EXPECT_EQ(f.log_interval, 2);
  EXPECT_EQ(f.device, 1);
  EXPECT_EQ(f.inject, "stale-input");
  EXPECT_EQ(f.eval_interval, 5);
  EXPECT_EQ(f.eval_samples, 64);
  EXPECT_DOUBLE_EQ(f.lr, 0.001);
  EXPECT_DOUBLE_EQ(f.min_lr, 1e-4);
  EXPECT_EQ(f.warmup_steps, 3);
  EXPECT_EQ(f.decay_steps, 900);
  EXPECT_TRUE(f.print_config);
  EXPECT_TRUE(f.skip_peak);
  EXPECT_EQ(own.width, 64);
  const std::string text = describe(f);
  EXPECT_TRUE(has(text, "# graphs: layer\n")) << text;
  EXPECT_TRUE(has(text, "# seed: 18446744073709551615\n")) << text;
  EXPECT_TRUE(has(text, "# lr: 0.001\n")) << text;
  EXPECT_TRUE(has(text, "# eval_interval: 5\n")) << text;
  EXPECT_TRUE(has(text, "# inject: stale-input\n")) << text;
}

TEST(RunFlags, BadFlagsAreRejectedNamingTheFlag) {
  std::string m = usage_error({"--graphs", "partial"});
  EXPECT_TRUE(has(m, "--graphs")) << m;
  EXPECT_TRUE(has(m, "partial")) << m;
  EXPECT_TRUE(has(m, "--help")) << m;
  m = usage_error({"--preset", "huge"});
  EXPECT_TRUE(has(m, "--preset") && has(m, "huge")) << m;
  m = usage_error({"--bogus"});
  EXPECT_TRUE(has(m, "--bogus")) << m;
  m = usage_error({"--steps", "-3"});
  EXPECT_TRUE(has(m, "--steps")) << m;
  m = usage_error({"--steps", "many"});
  EXPECT_TRUE(has(m, "--steps")) << m;
  m = usage_error({"--log-interval", "0"});
  EXPECT_TRUE(has(m, "--log-interval")) << m;
  m = usage_error({"--seed", "-1"});
  EXPECT_TRUE(has(m, "--seed")) << m;
  m = usage_error({"--host-delay-us", "-1"});
  EXPECT_TRUE(has(m, "--host-delay-us")) << m;
  m = usage_error({"--lr", "-1"});
  EXPECT_TRUE(has(m, "--lr")) << m;
  m = usage_error({"--decay-steps", "0"});
  EXPECT_TRUE(has(m, "--decay-steps")) << m;
  m = usage_error({"--width", "0"});
  EXPECT_TRUE(has(m, "--width")) << m;
  m = usage_error({"--inject", "bitflip"});
  EXPECT_TRUE(has(m, "unknown fault 'bitflip'") && has(m, "host-sync-in-capture")) << m;
  m = usage_error({"--inject", "help"});
  EXPECT_TRUE(has(m, "the faults it plants") && has(m, "legacy-stream")) << m;
}

TEST(RunFlags, HelpPrintsEveryFlagAndReturnsNothing) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  OwnFlags o;
  EXPECT_FALSE(parse_flags(
                   "tool", kPresets, "tiny", [&o](CLI::App& app) { o.add(app); },
                   std::vector<std::string>{"--help"}, out)
                   .has_value());
  std::rewind(out);
  std::string text;
  for (int c; (c = std::fgetc(out)) != EOF;) text += static_cast<char>(c);
  std::fclose(out);
  for (const char* flag :
       {"--preset",       "--graphs", "--steps",        "--warmup",        "--seed",
        "--data",         "--json",   "--mllog",        "--verify-graphs", "--host-delay-us",
        "--log-interval", "--device", "--inject",       "--eval-interval", "--eval-samples",
        "--lr",           "--min-lr", "--warmup-steps", "--decay-steps",   "--print-config",
        "--width"})
    EXPECT_TRUE(has(text, flag)) << flag << " missing from --help:\n" << text;
}

}  // namespace
}  // namespace replay::train
