// workload_test_util.cpp: the shared checks of the transformer workloads' tests.
#include "tests/workloads/workload_test_util.h"

#include <cuda_bf16.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "common/data/token_file.h"
#include "common/safetensors.h"
#include "tests/support/compare.h"
#include "train/trainer.h"

namespace replay::test {

using train::RunResult;

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

Outcome shell(const std::string& cmd) {
  std::FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return {-1, "popen failed: " + cmd};
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int raw = ::pclose(pipe);
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, out};
}

train::RunFlags resolved(train::Workload& w, const std::vector<std::string>& args) {
  const std::optional<train::RunFlags> f = train::parse(w, args);
  if (!f) throw Error("test", "help", "--help was asked for");
  return train::resolve(w, *f);
}

std::vector<std::string> tiny_args(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {
      "--preset", "tiny", "--seed",         "4242", "--log-interval", "4",   "--lr", "1e-3",
      "--min-lr", "1e-4", "--warmup-steps", "2",    "--decay-steps",  "1000"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

RunResult run_tiny(const transformer::Recipe& r, const std::vector<std::string>& extra) {
  transformer::TransformerWorkload w(r);
  const train::RunFlags f = resolved(w, tiny_args(extra));
  train::RunOptions options;
  options.measure_peak = false;  // the binary's test measures it; here it would only cost time
  return train::run(w, f, stdout, options);
}

void expect_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  const auto& la = a.report.losses;
  const auto& lb = b.report.losses;
  ASSERT_EQ(la.size(), lb.size()) << what;
  EXPECT_TRUE(bit_equal(what + " losses", la.data(), lb.data(), la.size() * sizeof(float)));
  EXPECT_EQ(*a.report.weights_hash, *b.report.weights_hash) << what << ": bf16 weights differ";
  EXPECT_EQ(a.master_hash, b.master_hash) << what << ": fp32 master weights differ";
}

namespace {

RunResult run_mode(const transformer::Recipe& r, const std::string& mode,
                   const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--graphs", mode, "--warmup", "2"};
  if (mode != "none") args.push_back("--verify-graphs");
  args.insert(args.end(), extra.begin(), extra.end());
  return run_tiny(r, args);
}

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

std::string temp_path(const transformer::Recipe& r, const std::string& tag) {
  return ::testing::TempDir() + r.info.name + "_" + tag + "_" + std::to_string(::getpid());
}

// A tiny run of the binary with a JSON summary and an mllog file.
Outcome run_binary(const std::string& binary, const std::string& json, const std::string& mllog) {
  return shell(std::string("'") + binary + "' --preset tiny --graphs layer --steps 5 --seed 3 " +
               "--log-interval 2 --json '" + json + "' --mllog '" + mllog + "'");
}

}  // namespace

void expect_modes_bit_identical_and_loss_falls(const transformer::Recipe& w,
                                               const std::vector<std::string>& args) {
  const RunResult none = run_mode(w, "none", args);
  const auto& losses = none.report.losses;
  ASSERT_EQ(losses.size(), 12u);
  for (float l : losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_GT(losses.front(), 5.5f)
      << "a fresh model predicts about uniformly over 512 tokens (ln 512 = 6.24)";
  const double first = (losses[0] + losses[1] + losses[2]) / 3.0,
               last = (losses[9] + losses[10] + losses[11]) / 3.0;
  EXPECT_LT(last, first - 0.1) << "the loss did not fall: " << first << " -> " << last;
  EXPECT_EQ(none.report.graph_count, 0);

  const RunResult layer = run_mode(w, "layer", args);
  expect_identical(none, layer, "layer vs none");
  EXPECT_EQ(layer.report.graph_count, 4);  // forward and backward of 2 layers
  const RunResult full = run_mode(w, "full", args);
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.report.graph_count, 1);
  EXPECT_GT(full.report.graph_nodes, layer.report.graph_nodes);
}

void expect_tiny_schedule_learns(const transformer::Recipe& r) {
  transformer::TransformerWorkload w(r);
  const train::RunFlags f = resolved(w, {"--preset", "tiny", "--graphs", "full", "--steps", "300",
                                         "--seed", "7", "--log-interval", "100"});
  const train::TrainingConfig t = train::training_config(w, f);
  EXPECT_EQ(t.schedule.warmup_steps, 20);
  EXPECT_EQ(t.schedule.total_steps, 400);
  train::RunOptions options;
  options.measure_peak = false;
  const RunResult run = train::run(w, f, stdout, options);
  const std::vector<float>& losses = run.report.losses;
  ASSERT_EQ(losses.size(), 300u);
  ASSERT_TRUE(run.report.loss_floor.has_value());
  const double floor = *run.report.loss_floor;
  double tail = 0;
  for (size_t i = 250; i < 300; ++i) tail += losses[i] / 50.0;
  EXPECT_GT(losses.front(), 5.5f);
  EXPECT_LT(tail, floor + 0.4) << "the tiny schedule left the loss at " << tail << ", floor "
                               << floor;
  EXPECT_GT(tail, floor - 0.05) << "below the entropy floor: the loss is not what it claims";
}

void expect_resume_bit_exact(const transformer::Recipe& r) {
  char tmpl[] = "/tmp/replay-resume-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::vector<std::string> common = {"--warmup",       "2", "--dropout", "0.1",
                                           "--microbatches", "2"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), common.begin(), common.end());
    return a;
  };
  auto data_hash = [](const std::string& path) {
    return safetensors::Reader(path).meta(safetensors::kDataHashKey);
  };
  const struct {
    const char *save_mode, *resume_mode;
  } cases[] = {{"none", "none"}, {"layer", "layer"}, {"full", "full"}, {"none", "full"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.save_mode) + " resumed in " + c.resume_mode);
    const std::string a = dir + "/" + c.save_mode + "-" + c.resume_mode + "-a",
                      b = dir + "/" + c.save_mode + "-" + c.resume_mode + "-b";
    const RunResult whole = run_tiny(
        r, with({"--graphs", c.save_mode, "--steps", "20", "--save", a, "--save-interval", "10"}));
    const RunResult half = run_tiny(r, with({"--graphs", c.resume_mode, "--steps", "10", "--load",
                                             a + "/step-00000010.safetensors", "--save", b}));
    ASSERT_EQ(whole.report.losses.size(), 20u);
    ASSERT_EQ(half.report.losses.size(), 10u);
    EXPECT_EQ(half.report.first_step, 10);
    EXPECT_TRUE(bit_equal("losses of steps 10-19", whole.report.losses.data() + 10,
                          half.report.losses.data(), 10 * sizeof(float)));
    EXPECT_EQ(*whole.report.weights_hash, *half.report.weights_hash) << "bf16 weights at 20";
    EXPECT_EQ(whole.master_hash, half.master_hash) << "fp32 master weights at 20";
    EXPECT_EQ(data_hash(a + "/step-00000020.safetensors"),
              data_hash(b + "/step-00000020.safetensors"))
        << "Adam's moments, the RNG or the data cursor differ at step 20";
  }
  std::system(("rm -rf '" + dir + "'").c_str());
}

void expect_time_to_train(const transformer::Recipe& r) {
  double floor = NAN;
  {
    transformer::TransformerWorkload w(r);
    resolved(w, {"--preset", "tiny"});
    const transformer::TransformerShape& sh = w.shape();
    const data::TokenFile file(data::ensure_dataset(transformer::dataset_params(sh)),
                               {sh.micro_batch, sh.seq, sh.padded_vocab()});
    floor = file.info().provenance.entropy_rate;
  }
  ASSERT_TRUE(std::isfinite(floor));
  char target[32];
  std::snprintf(target, sizeof(target), "%.4f", floor + 0.25);
  std::vector<RunResult> runs;
  for (const char* mode : {"none", "layer", "full"}) {
    transformer::TransformerWorkload w(r);
    const train::RunFlags f =
        resolved(w, {"--preset", "tiny", "--graphs", mode, "--steps", "500", "--seed", "7",
                     "--log-interval", "100", "--eval-interval", "50", "--target-quality", target});
    train::RunOptions options;
    options.measure_peak = false;
    runs.push_back(train::run(w, f, stdout, options));
  }
  const bench::WorkloadReport& none = runs[0].report;
  ASSERT_TRUE(none.steps_to_target.has_value()) << "floor + 0.25 not reached in 500 steps";
  EXPECT_EQ(none.steps_to_target.value() % 50, 0);
  EXPECT_EQ(static_cast<int64_t>(none.losses.size()), *none.steps_to_target) << "stopped there";
  EXPECT_LE(none.evals.back().value, floor + 0.25);
  EXPECT_GT(none.evals.back().value, floor) << "below the entropy floor";
  EXPECT_GT(none.time_to_train_s.value_or(0), 0.0);
  EXPECT_EQ(none.eval_metric, "loss");
  for (size_t m = 1; m < runs.size(); ++m) {
    const std::string what = m == 1 ? "layer vs none" : "full vs none";
    expect_identical(runs[0], runs[m], what);
    EXPECT_EQ(runs[m].report.steps_to_target, none.steps_to_target) << what;
    ASSERT_EQ(runs[m].report.evals.size(), none.evals.size()) << what;
    for (size_t i = 0; i < none.evals.size(); ++i)
      EXPECT_EQ(runs[m].report.evals[i].value, none.evals[i].value) << what << ", eval " << i;
  }

  // A target the run cannot reach: it runs to the step limit and says so, in JSON and mllog.
  transformer::TransformerWorkload w(r);
  const std::string mllog =
      ::testing::TempDir() + r.info.name + "_aborted_" + std::to_string(::getpid()) + ".mllog";
  const train::RunFlags f =
      resolved(w, {"--preset", "tiny", "--graphs", "full", "--steps", "20", "--seed", "7",
                   "--eval-interval", "10", "--target-quality", "0.5", "--mllog", mllog});
  train::RunOptions options;
  options.measure_peak = false;
  const RunResult aborted = train::run(w, f, stdout, options);
  EXPECT_EQ(aborted.report.losses.size(), 20u);
  EXPECT_FALSE(aborted.report.steps_to_target.has_value());
  EXPECT_EQ(aborted.report.target_quality, 0.5);
  std::ifstream log(mllog);
  std::string last, line;
  while (std::getline(log, line)) last = line;
  EXPECT_TRUE(has(last, "\"run_stop\"") && has(last, "\"aborted\"")) << last;
  std::remove(mllog.c_str());
}

void expect_accumulation_bit_identical(const transformer::Recipe& w,
                                       const std::vector<std::string>& args, ModeRuns* runs) {
  runs->none = run_mode(w, "none", args);
  for (float l : runs->none.report.losses) ASSERT_TRUE(std::isfinite(l));
  runs->full = run_mode(w, "full", args);
  expect_identical(runs->none, runs->full, "full vs none, 2 micro-batches");
  runs->layer = run_mode(w, "layer", args);
  expect_identical(runs->none, runs->layer, "layer vs none, 2 micro-batches");
}

void expect_one_step_matches(transformer::TransformerWorkload& w, const train::RunFlags& f,
                             const ReferenceModel& ref) {
  Context ctx;
  w.open_data(f, stdout);
  const train::TrainingConfig training = train::training_config(w, f);
  std::unique_ptr<transformer::TransformerModel> model =
      w.build_model(ctx, training, f.seed, stdout);
  train::TrainerOptions options;
  options.mode = graphs::GraphMode::kNone;
  options.warmup = 0;
  options.seed = f.seed;
  options.measure_peak = false;
  train::Trainer trainer(ctx, *model, training, options);
  trainer.allocate();
  const transformer::Transformer& m = model->transformer();
  const transformer::TransformerShape& sh = m.shape();

  const train::ParamStore& ps = model->params();
  const auto weights =
      download<__nv_bfloat16>(ps.weights().data, static_cast<size_t>(ps.buffer_numel()));
  trainer.prepare();  // loads the first batch
  trainer.step();
  const bench::StepSample gpu = trainer.read(0);
  ASSERT_EQ(cudaStreamSynchronize(trainer.stream()), cudaSuccess);
  const auto M = static_cast<size_t>(sh.tokens());
  const auto tokens = download<int32_t>(m.tokens(0), M);
  const auto targets = download<int32_t>(m.targets(0), M);
  const auto grads = download<float>(ps.grads().data, static_cast<size_t>(ps.buffer_numel()));
  const auto dx0_gpu = download<__nv_bfloat16>(m.residual_grad().data, M * sh.hidden);

  ASSERT_EQ(ps.count(), ref.count);
  std::vector<std::vector<double>> p;
  for (int id = 0; id < ps.count(); ++id) {
    ASSERT_EQ(ps.numel(id), ref.sizes[static_cast<size_t>(id)]) << ps.spec(id).name;
    ASSERT_EQ(ps.spec(id).name, ref.name(id));
    std::vector<double> t(static_cast<size_t>(ps.numel(id)));
    for (size_t i = 0; i < t.size(); ++i)
      t[i] = __bfloat162float(weights[static_cast<size_t>(ps.offset(id)) + i]);
    p.push_back(std::move(t));
  }
  std::vector<std::vector<double>> g;
  std::vector<double> dx0;
  const double loss = ref.backward(std::move(p), tokens.data(), targets.data(), &g, &dx0);

  EXPECT_NEAR(gpu.loss, loss, 1e-2) << "forward loss";
  for (int id = 0; id < ps.count(); ++id) {
    const auto off = static_cast<size_t>(ps.offset(id));
    const std::vector<double> got(
        grads.begin() + static_cast<std::ptrdiff_t>(off),
        grads.begin() + static_cast<std::ptrdiff_t>(off + static_cast<size_t>(ps.numel(id))));
    EXPECT_TRUE(close_l2("grad " + ps.spec(id).name, got, g[static_cast<size_t>(id)], 3e-2));
  }
  std::vector<double> dx0_got(dx0_gpu.size());
  for (size_t i = 0; i < dx0_got.size(); ++i) dx0_got[i] = __bfloat162float(dx0_gpu[i]);
  EXPECT_TRUE(close_l2("embedding-output gradient", dx0_got, dx0, 3e-2));
}

void expect_summary_and_mllog(const transformer::Recipe& w, const std::string& binary,
                              const std::function<void(const nlohmann::json& j)>& check_config) {
  const std::string json = temp_path(w, "summary.json"), mllog = temp_path(w, "run.mllog");
  const Outcome o = run_binary(binary, json, mllog);
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(has(o.output, "step      4/5")) << o.output;
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["tool"], w.info.tool);
  EXPECT_EQ(j["workload"], w.info.name);
  EXPECT_EQ(j["preset"], "tiny");
  EXPECT_EQ(j["graphs"], "layer");
  EXPECT_EQ(j["config"]["layers"], 2);
  EXPECT_EQ(j["config"]["seed"], 3);
  EXPECT_EQ(j["config"]["vocab"], 512);
  if (check_config) check_config(j);
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

void expect_mllog_passes_checker(const transformer::Recipe& w, const std::string& binary,
                                 const std::string& yaml) {
  const std::string json = temp_path(w, "checked.json"), mllog = temp_path(w, "checked.mllog");
  const Outcome o = run_binary(binary, json, mllog);
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
  EXPECT_TRUE(has(check.output, yaml)) << check.output;
  std::remove(mllog.c_str());
}

}  // namespace replay::test
