// replay-llama31's tiny preset on the GPU (RMSNorm, RoPE, GQA with 2 query heads on 1 KV head,
// SwiGLU, no biases, untied LM head):
// - Llama31Modes: none, layer and full (graph modes with --verify-graphs on step 0) train 12 steps
//   and give bit-identical losses, bf16 weights and fp32 master weights, with the graph counts each
//   mode implies; the loss falls. With two micro-batches too (gradient accumulation inside the
//   step, all of it in the full-iteration graph).
// - Llama31Reference: one step's loss, every parameter gradient and the embedding-output gradient
//   match the fp64 CPU model of the same network (tests/workloads/llama_reference.h).
// - Llama31Binary: the executable writes a JSON summary with SCHEMA.md's fields and a complete
//   mllog.
// - Llama31Mllog (registered separately, exit 77 without the checker): that mllog passes MLCommons'
//   compliance checker with replay's shard rules (shard_llama31_405b.yaml).
#include <cuda_bf16.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/data/batch_stream.h"
#include "tests/support/compare.h"
#include "tests/workloads/llama_reference.h"
#include "workloads/llama31/llama31.h"

namespace replay::llama31 {
namespace {

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

Settings tiny_settings(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--preset", "tiny", "--seed", "4242", "--log-interval", "4"};
  args.insert(args.end(), extra.begin(), extra.end());
  Settings s = resolve(*bench::parse_flags("replay-llama31", args, preset_names(), "tiny"));
  // A learning rate that moves the tiny model within a few steps: MLPerf's schedule (8e-5 x GBS /
  // 1152 after an 8000 x 1152 / GBS-step warm-up) would leave the loss flat.
  graphs::LrSchedule& sc = s.trainer.optimizer.schedule;
  sc.base_lr = 1e-3f;
  sc.min_lr = 1e-4f;
  sc.warmup_steps = 2;
  sc.total_steps = 1000;
  s.trainer.measure_peak = false;  // the binary's test measures it; here it would only cost time
  return s;
}

RunResult run_mode(const std::string& mode, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--graphs", mode, "--warmup", "2"};
  if (mode != "none") args.push_back("--verify-graphs");
  args.insert(args.end(), extra.begin(), extra.end());
  return run(tiny_settings(args), stdout);
}

void expect_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  const auto& la = a.report.losses;
  const auto& lb = b.report.losses;
  ASSERT_EQ(la.size(), lb.size()) << what;
  EXPECT_TRUE(test::bit_equal(what + " losses", la.data(), lb.data(), la.size() * sizeof(float)));
  EXPECT_EQ(*a.report.weights_hash, *b.report.weights_hash) << what << ": bf16 weights differ";
  EXPECT_EQ(a.master_hash, b.master_hash) << what << ": fp32 master weights differ";
}

TEST(Llama31Modes, LossesAndWeightsAreBitIdenticalAcrossModesAndTheLossFalls) {
  const std::vector<std::string> args = {"--steps", "12"};
  const RunResult none = run_mode("none", args);
  const auto& losses = none.report.losses;
  ASSERT_EQ(losses.size(), 12u);
  for (float l : losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_GT(losses.front(), 5.5f)
      << "a fresh model predicts about uniformly over 512 tokens (ln 512 = 6.24)";
  const double first = (losses[0] + losses[1] + losses[2]) / 3.0,
               last = (losses[9] + losses[10] + losses[11]) / 3.0;
  EXPECT_LT(last, first - 0.1) << "the loss did not fall: " << first << " -> " << last;
  EXPECT_EQ(none.report.graph_count, 0);

  const RunResult layer = run_mode("layer", args);
  expect_identical(none, layer, "layer vs none");
  EXPECT_EQ(layer.report.graph_count, 4);  // forward and backward of 2 layers
  const RunResult full = run_mode("full", args);
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.report.graph_count, 1);
  EXPECT_GT(full.report.graph_nodes, layer.report.graph_nodes);
}

TEST(Llama31Modes, GradientAccumulationIsBitIdenticalAcrossModes) {
  const std::vector<std::string> args = {"--steps", "4", "--microbatches", "2"};
  const RunResult none = run_mode("none", args);
  for (float l : none.report.losses) ASSERT_TRUE(std::isfinite(l));
  const RunResult full = run_mode("full", args);
  expect_identical(none, full, "full vs none, 2 micro-batches");
  EXPECT_EQ(full.report.graph_count, 1);  // both micro-batches and the optimizer in one graph
  const RunResult layer = run_mode("layer", args);
  expect_identical(none, layer, "layer vs none, 2 micro-batches");
  EXPECT_EQ(layer.report.graph_count, 8);
}

// ---- The CPU reference -------------------------------------------------------------------------

template <typename T>
std::vector<T> download(const void* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// ||got - ref|| / ||ref|| with the worst element named.
::testing::AssertionResult close_l2(const std::string& what, const std::vector<double>& got,
                                    const std::vector<double>& ref, double tol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  double err = 0, norm = 0, worst = -1;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(got[i] - ref[i]);
    err += e * e;
    norm += ref[i] * ref[i];
    if (!(e <= worst)) worst = e, at = i;
  }
  const double rel = std::sqrt(err) / std::max(std::sqrt(norm), 1e-30);
  if (rel <= tol && std::isfinite(rel)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": relative L2 error " << rel << " > " << tol << "; worst [" << at << "] got "
         << got[at] << " ref " << ref[at] << " (|ref| = " << std::sqrt(norm) << ")";
}

TEST(Llama31Reference, OneStepMatchesTheCpuModel) {
  Context ctx;
  GemmCache gemms(ctx);
  AttentionCache attention;
  const Settings s = tiny_settings({"--graphs", "none", "--warmup", "0"});
  transformer::Trainer trainer(ctx, s.trainer, gemms, attention);
  trainer.allocate();
  const transformer::TransformerShape& sh = s.trainer.shape;
  data::BatchStream batches(data::TokenFile(data::ensure_dataset(dataset_params(sh)),
                                            {sh.micro_batch, sh.seq, sh.padded_vocab()}),
                            data::StreamOptions{});

  const transformer::ParamStore& ps = trainer.model().params();
  const auto weights =
      download<__nv_bfloat16>(ps.weights().data, static_cast<size_t>(ps.buffer_numel()));
  trainer.load_batch(batches);
  trainer.step();
  const bench::StepSample gpu = trainer.read(0);
  ASSERT_EQ(cudaStreamSynchronize(trainer.stream()), cudaSuccess);
  const auto M = static_cast<size_t>(sh.tokens());
  const auto tokens = download<int32_t>(trainer.model().tokens(0), M);
  const auto targets = download<int32_t>(trainer.model().targets(0), M);
  const auto grads = download<float>(ps.grads().data, static_cast<size_t>(ps.buffer_numel()));
  const auto dx0_gpu = download<__nv_bfloat16>(trainer.model().residual_grad().data, M * sh.hidden);

  test::LlamaDims d;
  d.batch = sh.micro_batch, d.seq = sh.seq, d.hidden = sh.hidden, d.heads = sh.heads;
  d.heads_kv = sh.kv_heads(), d.head_dim = sh.head_dim, d.ffn = sh.ffn;
  d.vocab = sh.padded_vocab(), d.layers = sh.layers, d.eps = sh.norm_eps;
  d.rope_theta = sh.rope_theta, d.rope_llama31_scaling = sh.rope_llama31_scaling;
  ASSERT_EQ(ps.count(), test::LlamaParams::count(d));
  const std::vector<int64_t> sizes = test::LlamaParams::sizes(d);
  test::LlamaParams p;
  for (int id = 0; id < ps.count(); ++id) {
    ASSERT_EQ(ps.numel(id), sizes[static_cast<size_t>(id)]) << ps.spec(id).name;
    ASSERT_EQ(ps.spec(id).name, test::LlamaParams::name(d, id));
    std::vector<double> t(static_cast<size_t>(ps.numel(id)));
    for (size_t i = 0; i < t.size(); ++i)
      t[i] = __bfloat162float(weights[static_cast<size_t>(ps.offset(id)) + i]);
    p.t.push_back(std::move(t));
  }
  test::LlamaParams g;
  std::vector<double> dx0;
  const double loss = test::llama_backward(d, p, tokens.data(), targets.data(), &g, &dx0);

  EXPECT_NEAR(gpu.loss, loss, 1e-2) << "forward loss";
  for (int id = 0; id < ps.count(); ++id) {
    const auto off = static_cast<size_t>(ps.offset(id));
    const std::vector<double> got(
        grads.begin() + static_cast<std::ptrdiff_t>(off),
        grads.begin() + static_cast<std::ptrdiff_t>(off + static_cast<size_t>(ps.numel(id))));
    EXPECT_TRUE(close_l2("grad " + ps.spec(id).name, got, g.t[static_cast<size_t>(id)], 3e-2));
  }
  std::vector<double> dx0_got(dx0_gpu.size());
  for (size_t i = 0; i < dx0_got.size(); ++i) dx0_got[i] = __bfloat162float(dx0_gpu[i]);
  EXPECT_TRUE(close_l2("embedding-output gradient", dx0_got, dx0, 3e-2));
}

// ---- The executable -----------------------------------------------------------------------------

struct Outcome {
  int status;
  std::string output;
};

Outcome shell(const std::string& cmd) {
  std::FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return {-1, "popen failed: " + cmd};
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int raw = ::pclose(pipe);
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, out};
}

std::string temp_path(const std::string& tag) {
  return ::testing::TempDir() + "llama31_" + tag + "_" + std::to_string(::getpid());
}

// A tiny run of the binary with a JSON summary and an mllog file.
Outcome run_binary(const std::string& json, const std::string& mllog) {
  return shell(std::string("'") + REPLAY_LLAMA31_BINARY +
               "' --preset tiny --graphs layer --steps 5 --seed 3 " + "--log-interval 2 --json '" +
               json + "' --mllog '" + mllog + "'");
}

TEST(Llama31Binary, WritesTheJsonSummaryAndACompleteMllog) {
  const std::string json = temp_path("summary.json"), mllog = temp_path("run.mllog");
  const Outcome o = run_binary(json, mllog);
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(has(o.output, "step      4/5")) << o.output;
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["tool"], "replay-llama31");
  EXPECT_EQ(j["workload"], "llama31");
  EXPECT_EQ(j["preset"], "tiny");
  EXPECT_EQ(j["graphs"], "layer");
  EXPECT_EQ(j["config"]["layers"], 2);
  EXPECT_EQ(j["config"]["seed"], 3);
  EXPECT_EQ(j["config"]["vocab"], 512);
  EXPECT_EQ(j["config"]["heads"], 2);
  EXPECT_EQ(j["config"]["kv_heads"], 1);
  EXPECT_EQ(j["tensor_parallel_collectives"], "none (tp 1)");
  EXPECT_EQ(j["step_ms"]["count"], 5);
  EXPECT_GT(j["step_ms"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["host_enqueue_us"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["throughput"]["tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["peaks"]["bf16_gemm_tflops"].get<double>(), 50.0);
  EXPECT_GT(j["mfu"].get<double>(), 0.0);
  EXPECT_EQ(j["graphs_info"]["count"], 4);
  EXPECT_GT(j["graphs_info"]["capture_ms"].get<double>(), 0.0);
  EXPECT_GE(j["memory"]["peak_bytes"].get<int64_t>(), j["memory"]["arena_bytes"].get<int64_t>());
  ASSERT_EQ(j["losses"].size(), 5u);
  for (const auto& l : j["losses"]) EXPECT_TRUE(l.is_number());
  EXPECT_EQ(j["loss_hash"].get<std::string>().size(), 16u);
  EXPECT_TRUE(j["weights_hash"].is_string());
  EXPECT_GT(j["loss_floor"].get<double>(), 0.0);

  std::ifstream log(mllog);
  std::vector<std::string> lines;
  for (std::string line; std::getline(log, line);) lines.push_back(line);
  ASSERT_FALSE(lines.empty());
  for (const std::string& line : lines) EXPECT_EQ(line.rfind(":::MLLOG {", 0), 0u) << line;
  EXPECT_TRUE(has(lines.front(), "\"cache_clear\""));
  EXPECT_TRUE(has(lines.back(), "\"run_stop\"") && has(lines.back(), "\"success\""))
      << lines.back();
  std::remove(json.c_str());
  std::remove(mllog.c_str());
}

TEST(Llama31Mllog, TinyRunPassesTheComplianceChecker) {
  const std::string json = temp_path("checked.json"), mllog = temp_path("checked.mllog");
  const Outcome o = run_binary(json, mllog);
  ASSERT_EQ(o.status, 0) << o.output;
  const Outcome check = shell(std::string("bash '") + REPLAY_SOURCE_DIR +
                              "/scripts/mlperf/check_mllog.sh' '" + mllog + "'");
  std::remove(json.c_str());
  if (check.status == 77) {
    std::remove(mllog.c_str());
    std::printf("SKIP: python3 with mlperf_logging is not importable (scripts/setup.sh)\n");
    std::exit(77);
  }
  EXPECT_EQ(check.status, 0) << check.output;
  EXPECT_TRUE(has(check.output, "shard_llama31_405b.yaml")) << check.output;
  std::remove(mllog.c_str());
}

}  // namespace
}  // namespace replay::llama31
