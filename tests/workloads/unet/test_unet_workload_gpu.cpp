// replay-unet's tiny preset on the GPU:
// - UnetModes: none, layer and full (graph modes with --verify-graphs on step 0) train 6 steps and
//   give bit-identical losses, fp16 weights and fp32 master weights; layer mode makes one graph
//   per UNet block forward and backward, full one graph; losses are finite and the weights move.
//   bf16 (no loss scaling) too, none against full.
// - UnetOverflow: --overflow-at 2 makes step 2's gradients infinite. In every mode: the weights
//   after 3 steps equal those of a 2-step run without the fault (exactly that step skipped, no
//   other), the loss scale printed for step 3 is the initial one and for step 4 half of it, and the
//   four runs agree bit for bit.
// - UnetInjectOverflow: --inject overflow (the trainer's planted fault: step 2's gradients made
//   infinite before the norm) with --skip-mode noop and if, in none, layer and full: the weights
//   (16-bit and fp32 master) after 3 steps equal those after 2 clean steps (before and after the
//   overflow step), a 4th step moves them, the scale printed for steps 0-2 is 65536 and for step 3
//   32768, and all six runs agree bit for bit (the IF node changes nothing but what is launched).
// - UnetDataStream: --data-stream (batches read ahead by a prefetch thread) trains bit-identically
//   to the training split held in pinned memory, eager and in full mode.
// - UnetLifetimes: --poison-dead-buffers (every activation and gradient buffer filled with NaN
//   bytes once its planned lifetime ends) trains bit-identically to a plain eager run, with no
//   overflow: no op reads a buffer past the lifetime the arena plan gave it.
// - UnetRecompute: --recompute all (GroupNorm, LayerNorm and GEGLU outputs recomputed in the
//   backward by the forward's kernels) trains bit-identically to keeping them, eager and in one
//   graph, and with the dead buffers poisoned.
// - UnetOpTimes: --op-times in eager mode writes a time per op class; convolutions, GroupNorm,
//   attention and linear layers all took time, and their calls per step match the tiny model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "train/driver.h"
#include "workloads/unet/unet_workload.h"

namespace replay::unet {
namespace {

struct TinyRun {
  train::RunResult result;
  std::string output;
};

TinyRun run_tiny(const std::vector<std::string>& extra) {
  UnetWorkload w;
  std::vector<std::string> args = {"--preset", "tiny", "--seed", "4242",           "--warmup",
                                   "2",        "--lr", "1e-3",   "--warmup-steps", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  const std::optional<train::RunFlags> parsed = train::parse(w, args);
  if (!parsed) throw Error("test", "help", "--help was asked for");
  const train::RunFlags f = train::resolve(w, *parsed);
  train::RunOptions options;
  options.measure_peak = false;
  std::FILE* out = std::tmpfile();
  if (out == nullptr) throw Error("test", "tmpfile", "no temporary file");
  TinyRun r;
  try {
    r.result = train::run(w, f, out, options);
  } catch (...) {
    std::fclose(out);
    throw;
  }
  std::fflush(out);
  std::rewind(out);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), out)) > 0;) r.output.append(buf, n);
  std::fclose(out);
  std::fputs(r.output.c_str(), stdout);
  return r;
}

TinyRun run_mode(const std::string& mode, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--graphs", mode};
  if (mode != "none") args.push_back("--verify-graphs");
  args.insert(args.end(), extra.begin(), extra.end());
  return run_tiny(args);
}

void expect_identical(const TinyRun& a, const TinyRun& b, const std::string& what) {
  const std::vector<float>& la = a.result.report.losses;
  const std::vector<float>& lb = b.result.report.losses;
  ASSERT_EQ(la.size(), lb.size()) << what;
  for (size_t i = 0; i < la.size(); ++i)
    EXPECT_EQ(std::memcmp(&la[i], &lb[i], sizeof(float)), 0)
        << what << ": step " << i << " loss " << la[i] << " vs " << lb[i];
  ASSERT_TRUE(a.result.report.weights_hash && b.result.report.weights_hash);
  EXPECT_EQ(*a.result.report.weights_hash, *b.result.report.weights_hash)
      << what << ": 16-bit weights differ";
  EXPECT_EQ(a.result.master_hash, b.result.master_hash) << what << ": fp32 master weights differ";
}

// The loss scale each progress line printed (one line per step with --log-interval 1).
std::vector<double> scales(const std::string& output) {
  std::vector<double> s;
  const std::regex line(R"(step +\d+/\d+ .* scale ([0-9.e+]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it)
    s.push_back(std::stod((*it)[1].str()));
  return s;
}

int tiny_blocks() {
  // input, down0, down1, mid, up0, up1, out
  return 3 + 2 * static_cast<int>(preset_config("tiny").mult.size());
}

TEST(UnetModes, LossesAndWeightsAreBitIdenticalAcrossModes) {
  const std::vector<std::string> args = {"--steps", "6"};
  const TinyRun none = run_mode("none", args);
  ASSERT_EQ(none.result.report.losses.size(), 6u);
  for (float l : none.result.report.losses) EXPECT_TRUE(std::isfinite(l)) << l;
  const TinyRun layer = run_mode("layer", args);
  expect_identical(none, layer, "layer vs none");
  EXPECT_EQ(layer.result.report.graph_count, 2 * tiny_blocks());
  const TinyRun full = run_mode("full", args);
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.result.report.graph_count, 1);
  EXPECT_GT(full.result.report.graph_nodes, layer.result.report.graph_nodes);
  // Training moved the weights: a 1-step run ends elsewhere.
  const TinyRun one = run_mode("none", {"--steps", "1"});
  EXPECT_NE(one.result.master_hash, none.result.master_hash);
  EXPECT_EQ(std::memcmp(&one.result.report.losses[0], &none.result.report.losses[0], 4), 0)
      << "step 0 must see the same batch, noise and weights";
}

TEST(UnetModes, Bf16IsBitIdenticalAcrossModes) {
  const std::vector<std::string> args = {"--steps", "4", "--precision", "bf16"};
  const TinyRun none = run_mode("none", args);
  const TinyRun full = run_mode("full", args);
  expect_identical(none, full, "bf16 full vs none");
  EXPECT_EQ(scales(none.output).size(), 0u) << "bf16 runs print no loss scale";
}

TEST(UnetOverflow, SkipsExactlyThatStepInEveryModeAndHalvesTheScale) {
  std::optional<TinyRun> first;
  for (const std::string mode : {"none", "layer", "full"}) {
    SCOPED_TRACE(mode);
    const TinyRun fault =
        run_mode(mode, {"--steps", "4", "--overflow-at", "2", "--log-interval", "1"});
    const TinyRun three = run_mode(mode, {"--steps", "3", "--overflow-at", "2"});
    const TinyRun two = run_mode(mode, {"--steps", "2"});
    // Step 2 changed nothing: 3 steps with the fault end where 2 clean steps end.
    EXPECT_EQ(three.result.master_hash, two.result.master_hash);
    EXPECT_EQ(*three.result.report.weights_hash, *two.result.report.weights_hash);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_EQ(std::memcmp(&three.result.report.losses[i], &two.result.report.losses[i], 4), 0);
    // Step 3 trains again from those weights: the 4-step run moved past them.
    EXPECT_NE(fault.result.master_hash, two.result.master_hash);
    const std::vector<double> s = scales(fault.output);
    ASSERT_EQ(s.size(), 4u) << fault.output;
    EXPECT_EQ(s[0], 65536.0);
    EXPECT_EQ(s[1], 65536.0);
    EXPECT_EQ(s[2], 65536.0);  // the scale step 2 ran with; its overflow halves it
    EXPECT_EQ(s[3], 32768.0);
    if (!first) {
      first = fault;
    } else {
      expect_identical(*first, fault, mode + " vs none, with the overflow");
    }
  }
}

TEST(UnetInjectOverflow, SkipsExactlyStep2InEveryModeWithEitherSkipModeAndHalvesTheScale) {
  std::optional<TinyRun> first;
  for (const std::string skip : {"noop", "if"}) {
    for (const std::string mode : {"none", "layer", "full"}) {
      SCOPED_TRACE(mode + ", --skip-mode " + skip);
      const TinyRun fault = run_mode(mode, {"--steps", "4", "--inject", "overflow",
                                            "--log-interval", "1", "--skip-mode", skip});
      EXPECT_NE(fault.output.find("# inject: overflow, planted in region 'optimizer'"),
                std::string::npos)
          << fault.output;
      const TinyRun three =
          run_mode(mode, {"--steps", "3", "--inject", "overflow", "--skip-mode", skip});
      const TinyRun two = run_mode(mode, {"--steps", "2", "--skip-mode", skip});
      // The weights before the overflow step (2 clean steps) and after it (3 steps, the last
      // overflowing) are the same bytes: the update was skipped whole.
      ASSERT_TRUE(three.result.report.weights_hash && two.result.report.weights_hash);
      EXPECT_EQ(*three.result.report.weights_hash, *two.result.report.weights_hash);
      EXPECT_EQ(three.result.master_hash, two.result.master_hash);
      for (size_t i = 0; i < 2; ++i)
        EXPECT_EQ(std::memcmp(&three.result.report.losses[i], &two.result.report.losses[i], 4), 0);
      // Only that step: step 3 trains again.
      EXPECT_NE(fault.result.master_hash, two.result.master_hash);
      EXPECT_NE(*fault.result.report.weights_hash, *two.result.report.weights_hash);
      const std::vector<double> s = scales(fault.output);
      ASSERT_EQ(s.size(), 4u) << fault.output;
      EXPECT_EQ(s[0], 65536.0);
      EXPECT_EQ(s[1], 65536.0);
      EXPECT_EQ(s[2], 65536.0);  // the scale step 2 ran with; its overflow halves it
      EXPECT_EQ(s[3], 32768.0);
      if (!first) {
        first = fault;
      } else {
        expect_identical(*first, fault, mode + " " + skip + " vs none noop, with the overflow");
      }
    }
  }
}

TEST(UnetDataStream, StreamedBatchesTrainBitIdenticallyToHeldOnes) {
  // --data-stream reads each batch on a prefetch thread (LatentStream) in the same order the held
  // split is drawn in: the same losses and weights, eager and in one graph.
  const TinyRun held = run_mode("none", {"--steps", "5"});
  EXPECT_NE(held.output.find("held in pinned memory"), std::string::npos) << held.output;
  for (const std::string mode : {"none", "full"}) {
    SCOPED_TRACE(mode);
    const TinyRun streamed = run_mode(mode, {"--steps", "5", "--data-stream"});
    EXPECT_NE(streamed.output.find("streamed"), std::string::npos) << streamed.output;
    expect_identical(held, streamed, mode + " streamed vs held");
  }
}

TEST(UnetLifetimes, PoisoningEveryDeadBufferChangesNothing) {
  for (const char* precision : {"fp16", "bf16"}) {
    SCOPED_TRACE(precision);
    const std::vector<std::string> args = {"--steps", "4",           "--log-interval",
                                           "1",       "--precision", precision};
    const TinyRun plain = run_mode("none", args);
    std::vector<std::string> poison = args;
    poison.push_back("--poison-dead-buffers");
    const TinyRun poisoned = run_mode("none", poison);
    EXPECT_NE(poisoned.output.find("# poison:"), std::string::npos) << poisoned.output;
    for (float l : poisoned.result.report.losses) EXPECT_TRUE(std::isfinite(l)) << l;
    for (double s : scales(poisoned.output)) EXPECT_EQ(s, 65536.0) << "a step overflowed";
    expect_identical(plain, poisoned, std::string(precision) + " poisoned vs plain");
  }
}

TEST(UnetRecompute, RecomputedActivationsTrainBitIdentically) {
  const std::vector<std::string> args = {"--steps", "4", "--log-interval", "1"};
  const TinyRun kept = run_mode("none", args);
  for (const char* what : {"geglu", "norms", "all"}) {
    SCOPED_TRACE(what);
    std::vector<std::string> r = args;
    r.insert(r.end(), {"--recompute", what});
    expect_identical(kept, run_mode("none", r), std::string("eager, --recompute ") + what);
  }
  std::vector<std::string> all = args;
  all.insert(all.end(), {"--recompute", "all"});
  const TinyRun full = run_mode("full", all);
  expect_identical(kept, full, "full, --recompute all");
  const TinyRun layer = run_mode("layer", all);
  expect_identical(kept, layer, "layer, --recompute all");
  all.push_back("--poison-dead-buffers");
  const TinyRun poisoned = run_mode("none", all);
  for (double s : scales(poisoned.output)) EXPECT_EQ(s, 65536.0) << "a step overflowed";
  expect_identical(kept, poisoned, "eager, --recompute all, poisoned");
}

// The number after "key": in the op-times file's line for `op` (-1 when absent): "ms" and
// "calls" (per step), or any other key of the line ("gb_per_s", "tflop_per_s", ...).
double op_field(const std::string& json, const std::string& op, const std::string& key) {
  const std::regex line(
      "\"" + op + "\": \\{\"ms_per_step\": ([0-9.]+), \"calls_per_step\": ([0-9.]+)([^}]*)\\}");
  std::smatch m;
  if (!std::regex_search(json, m, line)) return -1;
  if (key == "ms" || key == "calls") return std::stod((key == "ms" ? m[1] : m[2]).str());
  const std::string rest = m[3].str();
  std::smatch f;
  if (!std::regex_search(rest, f, std::regex("\"" + key + "\": ([0-9.]+)"))) return -1;
  return std::stod(f[1].str());
}

TEST(UnetOpTimes, EagerRunWritesTimePerOpClass) {
  const std::string path = ::testing::TempDir() + "unet_op_times.json";
  std::remove(path.c_str());
  const TinyRun r = run_mode("none", {"--steps", "3", "--op-times", path});
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "no " << path << "\n" << r.output;
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  std::fputs(json.c_str(), stdout);
  // 2 warm-up and 3 timed steps run; the first (lazy module loading) is not summed.
  EXPECT_NE(json.find("\"steps\": 4,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"steps_run\": 5,"), std::string::npos) << json;
  for (const char* op : {"convolution", "group_norm", "layer_norm", "attention", "linear",
                         "pointwise", "diffusion"}) {
    SCOPED_TRACE(op);
    EXPECT_GT(op_field(json, op, "ms"), 0.0) << json;
  }
  // tiny (2 levels, 2 residual blocks each, transformers at level 0 and in the middle), forward
  // convolutions: conv_in 1; down 0: 2 resnets x 2; its downsampler 1; down 1: 2 x 2 and one
  // shortcut; mid: 2 x 2; up 0 and up 1: 3 resnets x (2 + a shortcut) each; the upsampler 1;
  // conv_out 1: 35, each with a backward.
  EXPECT_EQ(op_field(json, "convolution", "calls"), 70.0) << json;
  // Attention: self and cross in 6 transformers (2 down, 1 mid, 3 up), forward and backward.
  EXPECT_EQ(op_field(json, "attention", "calls"), 24.0) << json;
  // GroupNorm: 2 per residual block (12), 1 per transformer (6), conv_norm_out; LayerNorm: 3 per
  // transformer; forward and backward.
  EXPECT_EQ(op_field(json, "group_norm", "calls"), 2.0 * 31) << json;
  EXPECT_EQ(op_field(json, "layer_norm", "calls"), 2.0 * 18) << json;
  // The achieved rates: model TFLOP/s of the matrix products, GB/s of the memory-bound ops'
  // least traffic; none of the other kind.
  for (const char* op : {"convolution", "linear", "attention"}) {
    SCOPED_TRACE(op);
    EXPECT_GT(op_field(json, op, "tflop_per_s"), 0.0) << json;
    EXPECT_GT(op_field(json, op, "gflop_per_step"), 0.0) << json;
    EXPECT_EQ(op_field(json, op, "gb_per_s"), -1.0) << json;
  }
  for (const char* op : {"group_norm", "layer_norm", "pointwise"}) {
    SCOPED_TRACE(op);
    EXPECT_GT(op_field(json, op, "gb_per_s"), 0.0) << json;
    EXPECT_GT(op_field(json, op, "gb_per_step"), 0.0) << json;
    EXPECT_EQ(op_field(json, op, "tflop_per_s"), -1.0) << json;
  }
  // The slowest nodes: 30 of them (tiny has more), each named with its class, slowest first.
  const std::regex node(
      R"re(\{"node": "([^"]+)", "class": "([a-z_]+)", "ms_per_step": ([0-9.]+))re");
  std::vector<double> ms;
  for (std::sregex_iterator it(json.begin(), json.end(), node), end; it != end; ++it)
    ms.push_back(std::stod((*it)[3].str()));
  ASSERT_EQ(ms.size(), 30u) << json;
  EXPECT_TRUE(std::is_sorted(ms.rbegin(), ms.rend())) << json;
  EXPECT_GT(ms.front(), 0.0) << json;
}

}  // namespace
}  // namespace replay::unet
