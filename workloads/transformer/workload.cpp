// workload.cpp: the shared driver of the transformer workloads: presets, settings and the timed
// run.
#include "workloads/transformer/workload.h"

#include <chrono>
#include <cinttypes>
#include <cmath>

#include "common/bench/mllog.h"
#include "common/check.h"
#include "common/data/batch_stream.h"
#include "common/data/token_file.h"
#include "common/version.h"

namespace replay::transformer {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<std::string> preset_names(const Workload& w) {
  std::vector<std::string> names;
  for (const Preset& p : w.presets) names.push_back(p.name);
  return names;
}

Preset preset(const Workload& w, const std::string& name) {
  for (const Preset& p : w.presets)
    if (p.name == name) return p;
  std::string have;
  for (const std::string& n : preset_names(w)) have += (have.empty() ? "" : ", ") + n;
  throw bench::UsageError("--preset: '" + name + "' is not a " + w.family + " preset (" + have +
                          ")");
}

data::MarkovDatasetParams dataset_params(const TransformerShape& shape) {
  data::MarkovDatasetParams p;
  p.vocab_size = shape.vocab;
  p.seq_len = shape.seq;
  p.order = 1;
  p.branching = 4;
  return p;
}

int layers_for_budget(Context& ctx, const TrainerConfig& config, GemmCache& gemms,
                      AttentionCache& attention, int64_t model_layers, size_t budget) {
  int best = 0;
  for (int64_t layers = 1; layers <= model_layers; ++layers) {
    TrainerConfig c = config;
    c.shape.layers = layers;
    const Trainer planned(ctx, c, gemms, attention);  // plans only: no device memory
    if (planned.arena_plan().total_bytes() > budget) break;
    best = static_cast<int>(layers);
  }
  if (best == 0)
    throw Error("replay", "out of memory",
                "not even one layer of this shard fits the " + std::to_string(budget >> 30) +
                    " GiB budget");
  return best;
}

Settings resolve(const Workload& w, bench::HarnessFlags f) {
  Settings s;
  s.preset = preset(w, f.preset);
  TransformerShape shape = s.preset.shape;
  if (f.layers > w.model_layers)
    throw bench::UsageError(std::string("--layers: ") + w.model + " has " +
                            std::to_string(w.model_layers) + " layers, got " +
                            std::to_string(f.layers));
  if (f.layers > 0) shape.layers = f.layers;
  f.layers = static_cast<int>(shape.layers);  // 0: from the memory budget, on the GPU
  if (std::isnan(f.dropout))
    f.dropout = shape.dropout;
  else
    shape.dropout = static_cast<float>(f.dropout);
  if (f.steps == 0) f.steps = s.preset.steps;
  if (f.seed == 0) f.seed = bench::seed_from_clock();
  s.trainer.shape = shape;
  s.trainer.microbatches = f.microbatches;
  s.trainer.optimizer = w.mlperf_optimizer(shape.micro_batch * f.microbatches);
  s.trainer.mode = graphs::parse_graph_mode(f.graphs);
  s.trainer.warmup = f.warmup;
  s.trainer.seed = f.seed;
  s.trainer.fault = parse_fault(f.inject);
  s.flags = f;
  return s;
}

RunResult run(const Workload& w, const Settings& st, std::FILE* out) {
  const bench::HarnessFlags& f = st.flags;
  TrainerConfig config = st.trainer;
  const TransformerShape& shape = config.shape;
  std::fprintf(out, "# %s %s: %s\n%s", w.tool, version(), st.preset.description.c_str(),
               bench::describe(f).c_str());

  // Data first: a missing or malformed file is an error before any GPU work.
  std::string data_path = f.data;
  if (data_path.empty()) data_path = data::ensure_dataset(dataset_params(shape));
  data::TokenFile file(data_path,
                       data::BatchShape{shape.micro_batch, shape.seq, shape.padded_vocab()});
  const double loss_floor = file.info().provenance.entropy_rate;
  std::fprintf(out,
               "# data: %s (%" PRId64 " sequences, vocabulary %" PRId64
               "); loss floor %.4f nats/token\n",
               data_path.c_str(), file.info().num_sequences, file.info().vocab_size, loss_floor);

  Context ctx(f.device);
  const EnvironmentReport env = ctx.environment();
  std::fputs(env.to_text().c_str(), out);

  bench::MlLogOptions log_options;
  log_options.path = f.mllog;
  bench::MlLogger mllog(std::move(log_options));
  namespace k = bench::mlkey;
  mllog.event(k::kCacheClear, false);
  mllog.start(k::kInitStart);

  bench::HostDelay delay(f.host_delay_us);
  GemmCache gemms(ctx);
  AttentionCache attention;
  if (config.shape.layers == 0) {
    config.shape.layers = layers_for_budget(ctx, config, gemms, attention, w.model_layers);
    std::fprintf(out,
                 "# layers: %" PRId64
                 " (the most whose arena fits %zu GiB: an 80 GiB H100 less a margin)\n",
                 config.shape.layers, kMemoryBudgetBytes >> 30);
  }
  Trainer trainer(ctx, config, gemms, attention, &delay);
  gemms.seal();
  const int64_t params = trainer.model().params().total_numel();
  std::fprintf(out, "# model: %s; %" PRId64 " parameters on this GPU\n", shape.describe().c_str(),
               params);
  const std::string tp_collectives = shape.tp > 1 ? "not run (1 process)" : "none (tp 1)";
  if (shape.tp > 1)
    std::fprintf(
        out,
        "# tensor parallelism %d: one process computes rank 0's shard; the TP all-reduces and "
        "all-gathers are not run\n",
        shape.tp);

  trainer.allocate();
  std::fputs(trainer.arena().table().c_str(), out);
  if (trainer.peaks().bf16_gemm_tflops > 0)
    std::fprintf(out, "# peak: bf16 GEMM %.1f TFLOP/s (8192^3, measured)\n",
                 trainer.peaks().bf16_gemm_tflops);

  data::StreamOptions stream_options;
  stream_options.seed = f.seed;
  data::BatchStream batches(std::move(file), stream_options);

  const int64_t global_batch = shape.micro_batch * config.microbatches;
  const OptimizerConfig& opt = config.optimizer;
  mllog.event(k::kSubmissionBenchmark, w.mllog_benchmark);
  mllog.event(k::kSubmissionOrg, "replay");
  mllog.event(k::kSubmissionPlatform, "1x" + std::string(ctx.props().name));
  mllog.event(k::kSubmissionStatus, "research");
  mllog.event(k::kConfigFilename, st.preset.name);
  mllog.event(k::kSeed, f.seed);
  mllog.event(k::kGlobalBatchSize, global_batch);
  mllog.event(k::kMicroBatchSize, shape.micro_batch);
  mllog.event(k::kGradientAccumulationSteps, config.microbatches);
  mllog.event(k::kMaxSequenceLength, shape.seq);
  mllog.event(k::kTensorParallelism, shape.tp);
  mllog.event(k::kPipelineParallelism, 1);
  mllog.event(k::kContextParallelism, 1);
  mllog.event(k::kExpertParallelism, 1);
  mllog.event(k::kPrecisionLinear, "bfloat16");
  mllog.event(k::kPrecisionAttn, "bfloat16");
  mllog.event(k::kPrecisionComm, "bfloat16");
  mllog.event(k::kReplayGraphMode, f.graphs);
  mllog.event(k::kReplayWorldSize, 1);
  mllog.event(k::kReplayNumLayers, config.shape.layers);
  const OptimizerLogKeys& ok = w.optimizer_keys;
  mllog.event(k::kOptName, ok.name);
  mllog.event(k::kOptBaseLearningRate, static_cast<double>(opt.schedule.base_lr));
  mllog.event(k::kOptEndLearningRate, static_cast<double>(opt.schedule.min_lr));
  mllog.event(k::kOptLearningRateWarmupSteps, opt.schedule.warmup_steps);
  mllog.event(k::kOptLearningRateDecaySteps, opt.schedule.total_steps);
  mllog.event(k::kOptLearningRateDecaySchedule, "cosine with linear warmup");
  mllog.event(ok.beta1, static_cast<double>(opt.adam.beta1));
  mllog.event(ok.beta2, static_cast<double>(opt.adam.beta2));
  mllog.event(ok.epsilon, static_cast<double>(opt.adam.eps));
  mllog.event(ok.weight_decay, static_cast<double>(opt.adam.weight_decay));
  mllog.event(k::kOptGradientClipNorm, static_cast<double>(opt.clip_norm));
  mllog.event(k::kTrainSamples, batches.info().num_sequences);
  mllog.event(k::kEvalSamples, 0);

  // Warm-up and capture, on the first batch.
  trainer.load_batch(batches);
  const auto t0 = std::chrono::steady_clock::now();
  trainer.prepare();
  const bool graphed = config.mode != graphs::GraphMode::kNone;
  std::fprintf(out, "# prepare: %d neutral warm-up steps%s in %.1f ms\n", config.warmup,
               graphed ? " and capture" : "", ms_since(t0));
  if (graphed) std::fputs(trainer.step_plan().describe().c_str(), out);
  mllog.end(k::kInitStop);
  mllog.start(k::kRunStart);
  mllog.start(k::kBlockStart, {{k::kSamplesCount, 0}});

  bench::LoopConfig loop;
  loop.steps = f.steps;
  loop.log_interval = f.log_interval;
  loop.untimed_steps = f.verify_graphs ? 1 : 0;
  loop.tokens_per_step = static_cast<double>(trainer.tokens_per_step());
  loop.flops_per_step = trainer.flops_per_step();
  loop.peak_tflops = trainer.peaks().bf16_gemm_tflops;
  bench::LoopCallbacks callbacks;
  callbacks.enqueue = [&](int64_t step) {
    if (step > 0) trainer.load_batch(batches);
    if (step == 0 && f.verify_graphs) {
      const graphs::VerifyReport v = trainer.verify_step();
      std::fprintf(out, "# %s\n", v.message().c_str());
      if (!v.ok) throw Error("replay", "verify-graphs", v.message());
    } else {
      trainer.step();
    }
  };
  callbacks.read = [&](int64_t step) { return trainer.read(step); };
  callbacks.on_progress = [&](int64_t step, double tokens_per_s, const bench::StepSample& s) {
    mllog.tracked_stats(step + 1, {{"throughput", tokens_per_s}, {"loss", s.loss}});
  };
  const bench::LoopResult result = bench::run_steps(ctx.stream(), loop, callbacks, out);
  mllog.end(k::kBlockStop, {{k::kSamplesCount, f.steps * global_batch}});
  mllog.end(k::kRunStop, {{k::kStatus, k::kSuccess}});

  RunResult r;
  bench::WorkloadReport& rep = r.report;
  rep.peak_bytes = static_cast<int64_t>(bench::device_used_bytes()) -
                   static_cast<int64_t>(trainer.used_before_arena());
  rep.arena_bytes = static_cast<int64_t>(trainer.arena().size_bytes());
  rep.tool = w.tool;
  rep.version = version();
  rep.workload = w.name;
  rep.preset = st.preset.name;
  rep.graphs = f.graphs;
  rep.environment = env;
  rep.config = {
      {"layers", config.shape.layers}, {"hidden", shape.hidden}, {"heads", shape.heads_shard()}};
  if (w.report_kv_heads) rep.config["kv_heads"] = shape.kv_heads_shard();
  rep.config.update(nlohmann::ordered_json{{"head_dim", shape.head_dim},
                                           {"ffn", shape.ffn_shard()},
                                           {"seq", shape.seq},
                                           {"micro_batch", shape.micro_batch},
                                           {"microbatches", config.microbatches},
                                           {"vocab", shape.padded_vocab()},
                                           {"vocab_shard", shape.vocab_shard()},
                                           {"tp", shape.tp},
                                           {"dropout", f.dropout},
                                           {"seed", f.seed},
                                           {"steps", f.steps},
                                           {"warmup", f.warmup},
                                           {"precision", "bf16"}});
  if (f.host_delay_us > 0)
    rep.config["host_delay_us"] = f.host_delay_us;  // SCHEMA.md: only when set
  rep.tensor_parallel_collectives = tp_collectives;
  rep.step_ms = result.step_stats;
  rep.host_enqueue_us = result.host_stats;
  rep.tokens_per_step = static_cast<double>(trainer.tokens_per_step());
  rep.samples_per_step = static_cast<double>(global_batch);
  rep.flops_per_step = trainer.flops_per_step();
  rep.flops_formula = Trainer::flops_formula();
  rep.peak_tflops = trainer.peaks().bf16_gemm_tflops;
  for (const graphs::GraphStats& g : trainer.step_plan().graph_stats()) {
    rep.graph_count += 1;
    rep.graph_nodes += static_cast<int64_t>(g.nodes);
    rep.capture_ms += g.capture_ms;
    rep.instantiate_ms += g.instantiate_ms;
  }
  rep.losses = result.losses;
  const ParamStore& ps = trainer.model().params();
  rep.weights_hash = bench::device_hash(ps.weights().data, ps.weights().bytes());
  r.master_hash = bench::device_hash(ps.masters().data, ps.masters().bytes());
  if (std::isfinite(loss_floor)) rep.loss_floor = loss_floor;

  std::fputs(bench::summary(rep).c_str(), out);
  if (!f.json.empty()) {
    bench::write_json(f.json, bench::to_json(rep));
    std::fprintf(out, "# wrote %s\n", f.json.c_str());
  }
  std::fflush(out);
  return r;
}

int workload_main(const Workload& w, int argc, char** argv) {
  return bench::run_main(w.tool, [&] {
    const auto flags = bench::parse_flags(w.tool, argc, argv, preset_names(w), "tiny");
    if (!flags) return 0;  // --help
    run(w, resolve(w, *flags));
    return 0;
  });
}

}  // namespace replay::transformer
