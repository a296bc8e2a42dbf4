// llama31.cpp: presets, MLPerf settings and the timed run of replay-llama31.
#include "workloads/llama31/llama31.h"

#include <chrono>
#include <cinttypes>
#include <cmath>

#include "common/bench/mllog.h"
#include "common/check.h"
#include "common/data/batch_stream.h"
#include "common/data/token_file.h"

namespace replay::llama31 {

using transformer::TrainerConfig;
using transformer::TransformerShape;

namespace {

// The Llama options of the shared transformer: RMSNorm (eps 1e-5), RoPE base 500000 with the
// Llama 3.1 frequency scaling, SwiGLU, no biases, untied LM head, no dropout. The vocabulary is
// padded to a multiple of 8 x TP only, so 32000 splits exactly (4000 per GPU at TP8).
TransformerShape llama_options(TransformerShape s) {
  s.norm = transformer::NormKind::kRMSNorm;
  s.norm_eps = 1e-5f;
  s.position = transformer::PositionKind::kRope;
  s.rope_theta = 500000.0;
  s.rope_llama31_scaling = true;
  s.mlp = transformer::MlpKind::kSwiGLU;
  s.bias = false;
  s.tied_embedding = false;
  s.dropout = 0.0f;  // MLPerf
  s.vocab_multiple = 8;
  return s;
}

TransformerShape llama31_405b(int tp) {
  TransformerShape s;
  s.layers = 0;  // from the memory budget
  s.hidden = 16384;
  s.heads = 128;
  s.heads_kv = 8;
  s.head_dim = 128;
  s.ffn = 53248;
  s.seq = 8192;
  s.micro_batch = 1;
  s.vocab = 32000;
  s.tp = tp;
  return llama_options(s);
}

std::vector<Preset> presets() {
  TransformerShape tiny;
  tiny.layers = 2;
  tiny.hidden = 128;
  tiny.heads = 2;
  tiny.heads_kv = 1;
  tiny.head_dim = 64;
  tiny.ffn = 256;
  tiny.seq = 128;
  tiny.micro_batch = 2;
  tiny.vocab = 512;
  return {
      {"tiny", "2 layers of width 128, 2 query heads and 1 KV head of 64: the test model",
       llama_options(tiny), 20},
      {"405b-tp8",
       "Llama 3.1 405B, one GPU of NVIDIA's H100 layout (TP8, micro-batch 1, sequence 8192)",
       llama31_405b(8), 20},
      {"405b-tp4", "Llama 3.1 405B, one GPU of the H200 layout (TP4, micro-batch 1, sequence 8192)",
       llama31_405b(4), 20},
  };
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Preset& p : presets()) n.push_back(p.name);
    return n;
  }();
  return names;
}

Preset preset(const std::string& name) {
  for (const Preset& p : presets())
    if (p.name == name) return p;
  std::string have;
  for (const std::string& n : preset_names()) have += (have.empty() ? "" : ", ") + n;
  throw bench::UsageError("--preset: '" + name + "' is not a Llama 3.1 preset (" + have + ")");
}

data::MarkovDatasetParams dataset_params(const TransformerShape& shape) {
  data::MarkovDatasetParams p;
  p.vocab_size = shape.vocab;
  p.seq_len = shape.seq;
  p.order = 1;
  p.branching = 4;
  return p;
}

transformer::OptimizerConfig mlperf_optimizer(int64_t global_batch) {
  REPLAY_REQUIRE(global_batch >= 1, "global batch must be positive");
  constexpr int64_t kReferenceBatch = 1152, kWarmupSteps = 8000, kDecaySteps = 1200000;
  transformer::OptimizerConfig o;
  o.adam = AdamWHyper{0.9f, 0.95f, 1e-5f, 0.1f};
  o.schedule.kind = graphs::LrKind::kWarmupCosine;
  o.schedule.base_lr = static_cast<float>(8e-5 * static_cast<double>(global_batch) /
                                          static_cast<double>(kReferenceBatch));
  o.schedule.min_lr = 8e-7f;
  o.schedule.warmup_steps = (kWarmupSteps * kReferenceBatch + global_batch - 1) / global_batch;
  o.schedule.total_steps = (kDecaySteps * kReferenceBatch + global_batch - 1) / global_batch;
  o.clip_norm = 1.0f;
  return o;
}

int layers_for_budget(Context& ctx, const TrainerConfig& config, GemmCache& gemms,
                      AttentionCache& attention, size_t budget) {
  int best = 0;
  for (int64_t layers = 1; layers <= kModelLayers; ++layers) {
    TrainerConfig c = config;
    c.shape.layers = layers;
    const transformer::Trainer planned(ctx, c, gemms, attention);  // plans only: no device memory
    if (planned.arena_plan().total_bytes() > budget) break;
    best = static_cast<int>(layers);
  }
  if (best == 0)
    throw Error("replay", "out of memory",
                "not even one layer of this shard fits the " + std::to_string(budget >> 30) +
                    " GiB budget");
  return best;
}

Settings resolve(bench::HarnessFlags f) {
  Settings s;
  s.preset = preset(f.preset);
  TransformerShape shape = s.preset.shape;
  if (f.layers > kModelLayers)
    throw bench::UsageError("--layers: Llama 3.1 405B has " + std::to_string(kModelLayers) +
                            " layers, got " + std::to_string(f.layers));
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
  s.trainer.optimizer = mlperf_optimizer(shape.micro_batch * f.microbatches);
  s.trainer.mode = graphs::parse_graph_mode(f.graphs);
  s.trainer.warmup = f.warmup;
  s.trainer.seed = f.seed;
  s.flags = f;
  return s;
}

RunResult run(const Settings& st, std::FILE* out) {
  const bench::HarnessFlags& f = st.flags;
  TrainerConfig config = st.trainer;
  const TransformerShape& shape = config.shape;
  std::fprintf(out, "# replay-llama31 %s: %s\n%s", REPLAY_VERSION, st.preset.description.c_str(),
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
    config.shape.layers = layers_for_budget(ctx, config, gemms, attention);
    std::fprintf(out,
                 "# layers: %" PRId64
                 " (the most whose arena fits %zu GiB: an 80 GiB H100 less a margin)\n",
                 config.shape.layers, kMemoryBudgetBytes >> 30);
  }
  transformer::Trainer trainer(ctx, config, gemms, attention, &delay);
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
  const transformer::OptimizerConfig& opt = config.optimizer;
  mllog.event(k::kSubmissionBenchmark, k::kLlama31_405b);
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
  mllog.event(k::kOptName, "adamw");
  mllog.event(k::kOptBaseLearningRate, static_cast<double>(opt.schedule.base_lr));
  mllog.event(k::kOptEndLearningRate, static_cast<double>(opt.schedule.min_lr));
  mllog.event(k::kOptLearningRateWarmupSteps, opt.schedule.warmup_steps);
  mllog.event(k::kOptLearningRateDecaySteps, opt.schedule.total_steps);
  mllog.event(k::kOptLearningRateDecaySchedule, "cosine with linear warmup");
  mllog.event(k::kOptAdamwBeta1, static_cast<double>(opt.adam.beta1));
  mllog.event(k::kOptAdamwBeta2, static_cast<double>(opt.adam.beta2));
  mllog.event(k::kOptAdamwEpsilon, static_cast<double>(opt.adam.eps));
  mllog.event(k::kOptAdamwWeightDecay, static_cast<double>(opt.adam.weight_decay));
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
  rep.tool = "replay-llama31";
  rep.version = REPLAY_VERSION;
  rep.workload = "llama31";
  rep.preset = st.preset.name;
  rep.graphs = f.graphs;
  rep.environment = env;
  rep.config = {{"layers", config.shape.layers},
                {"hidden", shape.hidden},
                {"heads", shape.heads_shard()},
                {"kv_heads", shape.kv_heads_shard()},
                {"head_dim", shape.head_dim},
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
                {"precision", "bf16"}};
  if (f.host_delay_us > 0)
    rep.config["host_delay_us"] = f.host_delay_us;  // SCHEMA.md: only when set
  rep.tensor_parallel_collectives = tp_collectives;
  rep.step_ms = result.step_stats;
  rep.host_enqueue_us = result.host_stats;
  rep.tokens_per_step = static_cast<double>(trainer.tokens_per_step());
  rep.samples_per_step = static_cast<double>(global_batch);
  rep.flops_per_step = trainer.flops_per_step();
  rep.flops_formula = transformer::Trainer::flops_formula();
  rep.peak_tflops = trainer.peaks().bf16_gemm_tflops;
  for (const graphs::GraphStats& g : trainer.step_plan().graph_stats()) {
    rep.graph_count += 1;
    rep.graph_nodes += static_cast<int64_t>(g.nodes);
    rep.capture_ms += g.capture_ms;
    rep.instantiate_ms += g.instantiate_ms;
  }
  rep.losses = result.losses;
  const transformer::ParamStore& ps = trainer.model().params();
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

}  // namespace replay::llama31
