// replay-moe-parts: where a replay-moe step's time goes. Takes replay-moe's flags (--preset,
// --capacity-factor, --dropless, --layers, --seed), trains `--steps` eager steps (default 3), then
// times the step's parts eagerly (MoeModel::time_parts: attention, router, dispatch, experts, the
// routed experts' GEMMs alone) and, side by side, the routed experts' forward GEMMs as the
// capacity-padded strided batch against one dense GEMM of the same total rows. Prints a JSON
// object (the last line of stdout): per part ms, the router + dispatch share of the summed parts,
// the expert GEMMs' TFLOP/s as executed (padding included) and as routed, and the dropped
// assignments of the last step.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench/harness.h"
#include "common/check.h"
#include "common/context.h"
#include "common/gemm.h"
#include "train/driver.h"
#include "train/trainer.h"
#include "workloads/moe/expert_gemm.h"
#include "workloads/moe/moe_model.h"
#include "workloads/moe/moe_workload.h"

namespace {

using namespace replay;

// Mean ms of `reps` launches of `work` on `s` (after one untimed launch).
template <typename F>
double time_ms(cudaStream_t s, int reps, F work) {
  work();
  cudaEvent_t a = nullptr, b = nullptr;
  REPLAY_CUDA_CHECK(cudaEventCreate(&a));
  REPLAY_CUDA_CHECK(cudaEventCreate(&b));
  REPLAY_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) work();
  REPLAY_CUDA_CHECK(cudaEventRecord(b, s));
  REPLAY_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return static_cast<double>(ms) / reps;
}

// The routed experts' forward GEMMs (gate+up, down) at the shape's capacity as the strided batch,
// and as one dense GEMM over the same rows, on scratch buffers.
nlohmann::ordered_json gemm_side_by_side(const Context& ctx, const moe::MoeShape& sh,
                                         cudaStream_t s) {
  const int64_t E = sh.local_experts, cap = sh.capacity(), rows = E * cap, C = sh.hidden,
                F = sh.expert_ffn;
  GemmCache cache(ctx);
  GemmPlan& up_b = cache.get(moe::expert_linear_gemms(E, cap, C, 2 * F, false).forward);
  GemmPlan& down_b = cache.get(moe::expert_linear_gemms(E, cap, F, C, false).forward);
  GemmPlan& up_d = cache.get(linear_gemms(rows, C, 2 * F, false, false).forward);
  GemmPlan& down_d = cache.get(linear_gemms(rows, F, C, false, false).forward);
  void *x = nullptr, *w1 = nullptr, *h = nullptr, *w2 = nullptr, *y = nullptr, *ws = nullptr;
  const size_t ws_bytes = std::max<size_t>(cache.max_workspace_bytes(), 256);
  REPLAY_CUDA_CHECK(cudaMalloc(&x, static_cast<size_t>(rows * C) * 2));
  REPLAY_CUDA_CHECK(cudaMalloc(&w1, static_cast<size_t>(E * 2 * F * C) * 2));
  REPLAY_CUDA_CHECK(cudaMalloc(&h, static_cast<size_t>(rows * 2 * F) * 2));
  REPLAY_CUDA_CHECK(cudaMalloc(&w2, static_cast<size_t>(E * C * F) * 2));
  REPLAY_CUDA_CHECK(cudaMalloc(&y, static_cast<size_t>(rows * C) * 2));
  REPLAY_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(x, 0x3c, static_cast<size_t>(rows * C) * 2, s));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(w1, 0x3c, static_cast<size_t>(E * 2 * F * C) * 2, s));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(w2, 0x3c, static_cast<size_t>(E * C * F) * 2, s));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(h, 0x3c, static_cast<size_t>(rows * 2 * F) * 2, s));
  auto run = [&](GemmPlan& plan, void* a, void* b, void* d) {
    GemmArgs g;
    g.a = a, g.b = b, g.d = d, g.workspace = ws, g.workspace_bytes = ws_bytes;
    plan.run(s, g);
  };
  const int reps = 20;
  const double up_bms = time_ms(s, reps, [&] { run(up_b, x, w1, h); });
  const double up_dms = time_ms(s, reps, [&] { run(up_d, x, w1, h); });
  const double down_bms = time_ms(s, reps, [&] { run(down_b, h, w2, y); });
  const double down_dms = time_ms(s, reps, [&] { run(down_d, h, w2, y); });
  for (void* p : {x, w1, h, w2, y, ws}) cudaFree(p);
  const double up_flops = moe::expert_gemm_flops(rows, C, 2 * F),
               down_flops = moe::expert_gemm_flops(rows, F, C);
  auto tf = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  return {{"rows_per_expert", cap},
          {"experts", E},
          {"gate_up_batched_ms", up_bms},
          {"gate_up_batched_tflops", tf(up_flops, up_bms)},
          {"gate_up_dense_ms", up_dms},
          {"gate_up_dense_tflops", tf(up_flops, up_dms)},
          {"down_batched_ms", down_bms},
          {"down_batched_tflops", tf(down_flops, down_bms)},
          {"down_dense_ms", down_dms},
          {"down_dense_tflops", tf(down_flops, down_dms)},
          {"gate_up_algo", up_b.algo_info().to_string()},
          {"down_algo", down_b.algo_info().to_string()}};
}

int run_parts(int argc, char** argv) {
  moe::MoeWorkload w;
  std::vector<std::string> args(argv + 1, argv + argc);
  const std::optional<train::RunFlags> parsed = train::parse(w, args);
  if (!parsed) return 0;
  const train::RunFlags f = train::resolve(w, *parsed);
  if (w.expert_parallel() > 1)
    throw bench::UsageError(
        "--ep: replay-moe-parts times one process's parts; time an expert-parallel run with "
        "replay-moe under mpiexec");
  Context ctx;
  w.open_data(f, stdout);
  const train::TrainingConfig training = train::training_config(w, f);
  std::unique_ptr<train::Model> model = w.build(ctx, training, f, stdout);
  auto& m = dynamic_cast<moe::MoeModel&>(*model);
  train::TrainerOptions o;
  o.mode = graphs::GraphMode::kNone;
  o.warmup = 1;
  o.seed = f.seed;
  o.measure_peak = false;
  train::Trainer trainer(ctx, *model, training, o);
  trainer.allocate();
  const int64_t steps = f.steps > 0 ? f.steps : 3;
  for (int64_t i = 0; i < steps; ++i) {
    if (i > 0) trainer.load_batch();
    trainer.step();
  }
  const float last_loss = trainer.read(steps - 1).loss;
  const auto parts = m.time_parts(trainer.stream(), 3);
  double sum = 0, router = 0, preprocess = 0, gemm_fwd = 0, gemm_bwd = 0;
  nlohmann::ordered_json pj = nlohmann::ordered_json::object();
  for (const auto& kv : parts) {
    pj[kv.first] = kv.second;
    if (kv.first.rfind("expert_gemm", 0) == 0) {
      (kv.first == "expert_gemm.fwd" ? gemm_fwd : gemm_bwd) = kv.second;
      continue;  // timed apart (also inside the experts' parts): not summed
    }
    sum += kv.second;
    if (kv.first.rfind("moe_router", 0) == 0) router += kv.second;
    if (kv.first.rfind("moe_preprocess", 0) == 0) preprocess += kv.second;
  }
  const moe::MoeShape& sh = m.shape();
  const double exec = m.expert_flops_executed(), routed = m.expert_flops_routed();
  const double gemm_ms = gemm_fwd + gemm_bwd;
  nlohmann::ordered_json j = {
      {"tool", "replay-moe-parts"},
      {"preset", f.preset},
      {"moe_layers", sh.moe_layers},
      {"capacity_rows_per_expert", sh.capacity()},
      {"dispatch", sh.dropless() ? "dropless" : "capacity"},
      {"last_loss", last_loss},
      {"parts_ms", pj},
      {"parts_sum_ms", sum},
      {"router_ms", router},
      {"preprocess_ms", preprocess},
      {"router_dispatch_share_of_parts", sum > 0 ? (router + preprocess) / sum : 0.0},
      {"expert_gemm_ms", gemm_ms},
      {"expert_gemm_tflops_executed", exec / (gemm_ms * 1e-3) / 1e12},
      {"expert_gemm_tflops_routed", routed / (gemm_ms * 1e-3) / 1e12},
      {"dropped_last_step", m.dropped()},
      {"routed_counts_block0_first16", std::vector<int32_t>()}};
  std::vector<int32_t> counts = m.routed_counts(0);
  counts.resize(std::min<size_t>(counts.size(), 16));
  j["routed_counts_block0_first16"] = counts;
  j["gemm_side_by_side"] = gemm_side_by_side(ctx, sh, trainer.stream());
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replay::bench::run_main("replay-moe-parts", [&] { return run_parts(argc, argv); });
}
