// driver.cpp: flags to a timed run, the same for every workload (driver.h).
#include "train/driver.h"

#include <chrono>
#include <cinttypes>
#include <cmath>

#include "common/bench/mllog.h"
#include "common/check.h"
#include "common/version.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace replay::train {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<std::string> preset_names(const Workload& w) {
  std::vector<std::string> names;
  for (const Preset& p : w.presets()) names.push_back(p.name);
  return names;
}

const Preset& find_preset(const Workload& w, const std::string& name) {
  for (const Preset& p : w.presets())
    if (p.name == name) return p;
  std::string have;
  for (const std::string& n : preset_names(w)) have += (have.empty() ? "" : ", ") + n;
  throw bench::UsageError("--preset: '" + name + "' is not a " + w.info().family + " preset (" +
                          have + ")");
}

// The JSON summary's "config": the workload's, then what the run adds.
nlohmann::ordered_json run_config(const Workload& w, const RunFlags& f) {
  nlohmann::ordered_json c = w.config();
  c["seed"] = f.seed;
  c["steps"] = f.steps;
  c["warmup"] = f.warmup;
  c["precision"] = w.precision();
  if (f.host_delay_us > 0) c["host_delay_us"] = f.host_delay_us;  // SCHEMA.md: only when set
  return c;
}

nlohmann::ordered_json to_json(const TrainingConfig& t) {
  nlohmann::ordered_json j;
  using bench::decimal;
  if (t.optimizer == TrainingConfig::Optimizer::kLamb) {
    j["optimizer"] = {{"name", "lamb"},
                      {"beta1", decimal(t.lamb.beta1)},
                      {"beta2", decimal(t.lamb.beta2)},
                      {"eps", decimal(t.lamb.eps)},
                      {"weight_decay", decimal(t.lamb.weight_decay)},
                      {"clip_norm", decimal(t.clip_norm)}};
  } else {
    j["optimizer"] = {{"name", "adamw"},
                      {"beta1", decimal(t.adam.beta1)},
                      {"beta2", decimal(t.adam.beta2)},
                      {"eps", decimal(t.adam.eps)},
                      {"weight_decay", decimal(t.adam.weight_decay)},
                      {"clip_norm", decimal(t.clip_norm)}};
  }
  const LrSchedule& s = t.schedule;
  j["schedule"] = {{"kind", s.kind == LrKind::kWarmupCosine     ? "warmup_cosine"
                            : s.kind == LrKind::kWarmupConstant ? "warmup_constant"
                                                                : "rnnt_warmup_hold_decay"},
                   {"lr", decimal(s.base_lr)},
                   {"min_lr", decimal(s.min_lr)},
                   {"warmup_steps", s.warmup_steps},
                   {"decay_steps", s.total_steps},
                   {"text", describe(s)},
                   {"source", t.schedule_source}};
  if (t.loss_scaling) {
    const LossScalerConfig& l = *t.loss_scaling;
    j["loss_scaling"] = {{"init_scale", decimal(l.init_scale)},
                         {"growth_factor", decimal(l.growth_factor)},
                         {"backoff_factor", decimal(l.backoff_factor)},
                         {"growth_interval", l.growth_interval},
                         {"hysteresis", l.hysteresis}};
  } else {
    j["loss_scaling"] = nullptr;
  }
  return j;
}

// Resets the process-wide launch delay when the run ends, however it ends.
class LaunchDelayScope {
 public:
  explicit LaunchDelayScope(double us) { set_host_launch_delay_us(us); }
  ~LaunchDelayScope() { set_host_launch_delay_us(0); }
  LaunchDelayScope(const LaunchDelayScope&) = delete;
  LaunchDelayScope& operator=(const LaunchDelayScope&) = delete;
};

}  // namespace

std::optional<RunFlags> parse(Workload& w, const std::vector<std::string>& args, std::FILE* out) {
  const WorkloadInfo& info = w.info();
  return parse_flags(
      info.tool, preset_names(w), info.default_preset, [&w](CLI::App& app) { w.add_flags(app); },
      args, out);
}

RunFlags resolve(Workload& w, RunFlags f) {
  const Preset& preset = find_preset(w, f.preset);
  if (f.steps == 0) f.steps = preset.steps;
  if (f.seed == 0)  // a resumed run keeps its checkpoint's seed: the data order follows it
    f.seed = f.load.empty() ? bench::seed_from_clock() : checkpoint_seed(find_checkpoint(f.load));
  if (f.eval_interval > 0 && !w.evaluates())
    throw bench::UsageError("--eval-interval: " + w.info().tool + " has no evaluation yet");
  if (f.save_interval > 0 && f.save.empty())
    throw bench::UsageError("--save-interval: give --save, the directory the checkpoints go to");
  if (!std::isnan(f.target_quality) && !std::isnan(f.target_above_floor))
    throw bench::UsageError("--target-above-floor: give it or --target-quality, not both");
  if (!std::isnan(f.target_above_floor) && f.eval_interval == 0)
    throw bench::UsageError(
        "--target-above-floor: the run stops at an evaluation that reaches it; give "
        "--eval-interval");
  if (!std::isnan(f.target_quality) && f.eval_interval == 0)
    throw bench::UsageError(
        "--target-quality: the run stops at an evaluation that reaches it; give --eval-interval");
  w.resolve(f);
  training_config(w, f);  // the schedule the flags make must be valid
  return f;
}

TrainingConfig training_config(const Workload& w, const RunFlags& f) {
  TrainingConfig t = w.training();
  LrSchedule& s = t.schedule;
  if (!std::isnan(f.lr)) s.base_lr = static_cast<float>(f.lr);
  if (!std::isnan(f.min_lr)) s.min_lr = static_cast<float>(f.min_lr);
  if (f.warmup_steps >= 0) s.warmup_steps = f.warmup_steps;
  if (f.decay_steps >= 0) s.total_steps = f.decay_steps;
  if (!std::isnan(f.lr) || !std::isnan(f.min_lr) || f.warmup_steps >= 0 || f.decay_steps >= 0)
    t.schedule_source +=
        std::string(t.schedule_source.empty() ? "" : ", ") + "with the schedule flags applied";
  try {
    validate(s);
  } catch (const Error& e) {
    throw bench::UsageError(std::string("the learning-rate schedule: ") + e.what());
  }
  return t;
}

nlohmann::ordered_json resolved_config(const Workload& w, const RunFlags& f) {
  nlohmann::ordered_json j;
  j["tool"] = w.info().tool;
  j["version"] = version();
  j["workload"] = w.info().name;
  j["preset"] = f.preset;
  j["graphs"] = f.graphs;
  j["config"] = run_config(w, f);
  j["training"] = to_json(training_config(w, f));
  return j;
}

RunResult run(Workload& w, const RunFlags& f, std::FILE* out, const RunOptions& options) {
  const WorkloadInfo& info = w.info();
  const TrainingConfig training = training_config(w, f);
  std::fprintf(out, "# %s %s: %s\n%s", info.tool.c_str(), version(),
               find_preset(w, f.preset).description.c_str(), describe(f).c_str());
  std::fprintf(out, "# schedule: %s%s%s\n", describe(training.schedule).c_str(),
               training.schedule_source.empty() ? "" : "; ", training.schedule_source.c_str());

  // Data first: a missing or malformed file is an error before any GPU work. So are a checkpoint
  // to resume from that is not this run's, and a save directory that cannot be written.
  // The ranks: one process per GPU, in groups of --tp (consecutive ranks, as Megatron orders
  // them) that split one model, and --dp such groups that split the batch.
  const comm::World& world = comm::world();
  // Expert parallelism (a workload flag, replay-moe's --ep): every process of the launch is one
  // expert-parallel rank reading its own batch (DeepSeek's data parallelism over the EP group),
  // with no tensor or separate data parallelism yet.
  const int ep = w.expert_parallel();
  if (ep > 1) {
    const std::string n = std::to_string(ep);
    if (world.size == 1)
      throw bench::UsageError(
          "--ep " + n + ": expert parallelism runs one process per rank; launch " + n +
          " (mpiexec -n " + n + " ...), or --ep 1 for every expert on this GPU");
    if (world.size % ep != 0)
      throw bench::UsageError("--ep " + n + ": the launch has " + std::to_string(world.size) +
                              " processes, not a multiple of it");
    if (world.size != ep)
      throw bench::UsageError(
          "--ep " + n + " with " + std::to_string(world.size) +
          " processes: expert parallelism times data parallelism is not supported yet; launch " +
          n + " processes");
    if (f.tp > 1 || f.dp > 1)
      throw bench::UsageError(
          "--ep with --tp or --dp: not supported yet (the expert-parallel ranks already split the "
          "batch)");
    if (!f.save.empty() || !f.load.empty())
      throw bench::UsageError(
          "--save/--load: checkpoints of expert-parallel runs are not written yet (each rank holds "
          "its own experts)");
  }
  const int tp = world.size > 1 && f.tp > 1 ? f.tp : 1;
  if (world.size % tp != 0)
    throw bench::UsageError("--tp " + std::to_string(tp) + ": the launch has " +
                            std::to_string(world.size) + " processes, not a multiple of it");
  const int dp = ep > 1 ? 1 : f.dp > 0 ? f.dp : world.size / tp;
  if (ep == 1 && dp * tp != world.size)
    throw bench::UsageError("--tp " + std::to_string(tp) + " x --dp " + std::to_string(dp) +
                            " must be the launch's " + std::to_string(world.size) + " processes");
  const int tp_rank = world.rank % tp, dp_rank = world.rank / tp;
  if (dp * tp * ep > 1 && !f.dump_step.empty())
    throw bench::UsageError(
        "--dump-step: a parallel step keeps only a share of each gradient; "
        "dump a one-process run");
  if (dp * tp * ep == 1 && f.inject == "rank-stall")
    throw bench::UsageError(
        "--inject rank-stall: needs 2 or more processes (mpiexec -n 2 ...): one process has no "
        "other rank to wait for it");
  if (f.inject == "overflow" && f.steps > 0 && f.steps <= graphs::kOverflowStep)
    throw bench::UsageError("--inject overflow: plants its Inf in step " +
                            std::to_string(graphs::kOverflowStep) + " (0-based); give --steps " +
                            std::to_string(graphs::kOverflowStep + 1) + " or more");
  const bool leader = world.rank == 0;  // writes the JSON, the mllog and the checkpoints

  // Every output the run writes at its end can be written, before any work.
  if (leader && !f.json.empty()) check_output_file("--json", f.json);
  if (leader && !f.mllog.empty()) check_output_file("--mllog", f.mllog);
  w.open_data(f, out);
  const CheckpointIdentity identity{info.tool, info.name, f.preset, w.precision(), f.seed};
  std::unique_ptr<safetensors::Reader> resume;
  if (!f.load.empty()) {
    resume = open_checkpoint(find_checkpoint(f.load), identity);
    check_tensor_parallel(*resume, tp);  // a degree that divides every split tensor
  }
  if (!f.save.empty() && leader) prepare_save_directory(f.save);
  if (!f.dump_step.empty()) check_output_file("--dump-step", f.dump_step);

  // The local rank picks the GPU.
  Context ctx(world.size > 1 ? world.local_rank : f.device);
  const EnvironmentReport env = ctx.environment();
  std::fputs(env.to_text().c_str(), out);
  if (world.size > 1 && ep > 1)
    std::fprintf(out, "# world: %d ranks (expert parallel %d), rank %d on %s, GPU %d\n", world.size,
                 ep, world.rank, world.host.c_str(), world.local_rank);
  else if (world.size > 1)
    std::fprintf(
        out, "# world: %d ranks (tensor parallel %d x data parallel %d), rank %d on %s, GPU %d\n",
        world.size, tp, dp, world.rank, world.host.c_str(), world.local_rank);

  // Communicators before any capture; declared before the trainer, so destroyed after its graphs.
  comm::CollectiveLog collectives;
  // Checkpoints of a tensor-parallel run move slices between the group's processes on the host.
  std::unique_ptr<HostGroup> tp_host;
  if (tp > 1 && (!f.save.empty() || !f.load.empty()))
    tp_host = std::make_unique<HostGroup>(world, world.rank / tp);
  std::unique_ptr<comm::Communicator> dp_comm;
  std::unique_ptr<comm::Watchdog> watchdog;
  std::unique_ptr<comm::Communicator> tp_comm;
  if (tp > 1)
    tp_comm = std::make_unique<comm::Communicator>(world, "tensor-parallel", world.rank / tp,
                                                   &collectives);
  if (dp > 1)
    dp_comm =
        std::make_unique<comm::Communicator>(world, "data-parallel", world.rank % tp, &collectives);
  std::unique_ptr<comm::Communicator> ep_comm;
  if (ep > 1)
    ep_comm = std::make_unique<comm::Communicator>(world, "expert-parallel", 0, &collectives);
  if (dp * tp * ep > 1) {
    std::vector<comm::Communicator*> comms;
    for (comm::Communicator* c : {tp_comm.get(), dp_comm.get(), ep_comm.get()})
      if (c != nullptr) comms.push_back(c);
    watchdog =
        std::make_unique<comm::Watchdog>(world, std::move(comms), &collectives, f.comm_timeout_s);
    if (f.warmup < 1 && f.graphs != "none")
      throw bench::UsageError(
          "--warmup: a run over several processes captures NCCL collectives, whose first call "
          "must be eager; give --warmup 1 or more");
  }

  bench::MlLogOptions log_options;
  log_options.path = leader ? f.mllog : "";
  bench::MlLogger mllog(std::move(log_options));
  namespace k = bench::mlkey;
  mllog.event(k::kCacheClear, false);
  mllog.start(k::kInitStart);

  // The model and the arena.
  if (!w.set_tensor_parallel(tp_rank, tp, tp_comm.get()))
    throw bench::UsageError("--tp: " + info.tool + "'s model cannot be split over processes");
  if (ep > 1) w.set_expert_parallel(world.rank, ep, ep_comm.get());
  std::unique_ptr<Model> model = w.build(ctx, training, f, out);
  if (!f.save.empty() || !f.load.empty()) check_tensor_parallel_params(model->params(), tp);
  if (dp > 1 && !model->shard_data(dp_rank, dp))
    throw bench::UsageError("--dp: " + info.tool + "'s model cannot split its batches over ranks");
  double target_quality = f.target_quality;
  if (!std::isnan(f.target_above_floor)) {
    if (std::isnan(model->loss_floor()))
      throw bench::UsageError(
          "--target-above-floor: the data's loss floor is not known (give "
          "--target-quality)");
    target_quality = model->loss_floor() + f.target_above_floor;
    std::fprintf(out, "# target: loss %.6f (the data's floor %.6f + %g)\n", target_quality,
                 model->loss_floor(), f.target_above_floor);
  }
  TrainerOptions topt;
  topt.mode = graphs::parse_graph_mode(f.graphs);
  topt.warmup = f.warmup;
  topt.seed = f.seed;
  topt.measure_peak = options.measure_peak && !f.skip_peak;
  topt.fault = graphs::parse_fault(f.inject);
  topt.evaluate = f.eval_interval > 0;
  topt.data_parallel = dp_comm.get();
  topt.bucket_elements = f.dp_bucket_size;
  // The expert-parallel group is the trainer's model-parallel group: the grad norm's sum of
  // squares is summed over it (the replicated parameters counted on rank 0 only).
  topt.tensor_parallel = ep_comm ? ep_comm.get() : tp_comm.get();
  topt.watchdog = watchdog.get();
  Trainer trainer(ctx, *model, training, topt);
  std::fprintf(out, "# model: %s; %" PRId64 " parameters on this GPU\n", model->describe().c_str(),
               model->params().total_numel());
  trainer.allocate();
  std::fputs(trainer.arena().table().c_str(), out);
  int64_t first = 0;  // steps taken before this run
  if (resume) {
    check_tensors(*resume, checkpoint_tensors(trainer));
    const auto t_load = std::chrono::steady_clock::now();
    first = load_checkpoint(*resume, trainer, tp_host.get());
    std::fprintf(out, "# resumed from %s after %" PRId64 " steps (%.1f ms, written at --tp %d)\n",
                 resume->path().c_str(), first, ms_since(t_load), checkpoint_tp(*resume));
  }
  if (trainer.peaks().bf16_gemm_tflops > 0)
    std::fprintf(out, "# peak: bf16 GEMM %.1f TFLOP/s (8192^3, measured)\n",
                 trainer.peaks().bf16_gemm_tflops);
  if (!trainer.fault_region().empty())
    std::fprintf(out, "# inject: %s, planted in region '%s'\n", f.inject.c_str(),
                 trainer.fault_region().c_str());

  // The MLPerf configuration.
  const std::optional<EvalInfo> eval = model->evaluation();
  REPLAY_REQUIRE(f.eval_interval == 0 || eval.has_value(),
                 info.tool + " says it evaluates, but its model has no evaluation");
  // Whole held-out batches: what an evaluation really reads.
  const int64_t asked =
      f.eval_interval == 0 ? 0 : (f.eval_samples > 0 ? f.eval_samples : eval->default_samples);
  const int64_t per_batch = eval ? eval->samples_per_batch : 1;
  const int64_t eval_samples = (asked + per_batch - 1) / per_batch * per_batch;
  if (f.eval_interval > 0 && eval_samples > eval->available_samples)
    throw bench::UsageError("--eval-samples: the held-out split has " +
                            std::to_string(eval->available_samples) + " samples, " +
                            std::to_string(eval_samples) + " asked");
  mllog.event(k::kSubmissionBenchmark, info.mllog_benchmark);
  mllog.event(k::kSubmissionOrg, "replay");
  mllog.event(k::kSubmissionPlatform,
              std::to_string(world.size) + "x" + std::string(ctx.props().name));
  mllog.event(k::kSubmissionStatus, "research");
  mllog.event(k::kConfigFilename, f.preset);
  mllog.event(k::kSeed, f.seed);
  mllog.event(k::kReplayGraphMode, f.graphs);
  mllog.event(k::kReplayWorldSize, world.size);
  w.log_config(mllog, *model, training);
  mllog.event(k::kEvalSamples, eval_samples);

  // Warm-up and capture, on the first batch. The host launch delay applies from here on, as in a
  // framework that launches every op of the step (set-up and the peak measurement do not pay it).
  const LaunchDelayScope delay(f.host_delay_us);
  const auto t0 = std::chrono::steady_clock::now();
  trainer.prepare();
  const bool graphed = topt.mode != graphs::GraphMode::kNone;
  std::fprintf(out, "# prepare: %d neutral warm-up steps%s in %.1f ms\n", f.warmup,
               graphed ? " and capture" : "", ms_since(t0));
  if (const auto& t = trainer.step_traffic())
    std::fprintf(
        out, "# collectives: %" PRIu64 " a step, %.2f MB (this rank's calls, nccl-tests' sizes)\n",
        t->calls, static_cast<double>(t->bytes) / 1e6);
  for (const comm::CollectiveTiming& c : trainer.collective_timings())
    if (c.bytes >= (1 << 20))  // the bandwidth-bound ones
      std::fprintf(out,
                   "#   %s %s %s %.1f MiB x %.3g a step: %.1f us median in the warm-up, %.1f GB/s "
                   "bus bandwidth%s\n",
                   c.comm.c_str(), comm::kind_name(c.kind), comm::dtype_name(c.dtype),
                   static_cast<double>(c.bytes) / double(1 << 20), c.calls_per_step, c.median_us,
                   c.busbw_gbps, c.overlapped ? " (overlapped with the step's other work)" : "");
  if (graphed) {
    std::fputs(trainer.step_plan().describe().c_str(), out);
    if (trainer.eval_plan()) std::fputs(trainer.eval_plan()->describe().c_str(), out);
  }
  // What each rank captured must match before the first replay, or the replay would hang.
  if (graphed && world.size > 1) {
    comm::check_same_collectives(world, collectives);
    std::fprintf(out, "# capture check: %zu collectives captured, the same on all %d ranks\n",
                 collectives.captured().size(), world.size);
  }
  mllog.end(k::kInitStop);
  mllog.start(k::kRunStart);
  const auto run_start = std::chrono::steady_clock::now();
  const double samples_per_step = model->samples_per_step();
  mllog.start(
      k::kBlockStart,
      {{k::kSamplesCount, static_cast<int64_t>(static_cast<double>(first) * samples_per_step)}});

  // The timed steps, with evaluations between them.
  RunResult r;
  bench::WorkloadReport& rep = r.report;
  bench::LoopConfig loop;
  loop.steps = f.steps;
  loop.first_step = first;
  loop.log_interval = f.log_interval;
  loop.untimed_steps = f.verify_graphs ? 1 : 0;
  loop.units_per_step = model->units_per_step();
  loop.unit_short = info.unit_short;
  loop.flops_per_step = model->flops_per_step();
  loop.peak_tflops = trainer.peaks().bf16_gemm_tflops;
  bench::LoopCallbacks callbacks;
  callbacks.enqueue = [&](int64_t step) {
    if (step > 0) trainer.load_batch();
    if (step == 0 && f.verify_graphs) {
      const graphs::VerifyReport v = trainer.verify_step();
      std::fprintf(out, "# %s\n", v.message().c_str());
      if (!v.ok) throw Error("replay", "verify-graphs", v.message());
    } else {
      trainer.step();
    }
  };
  callbacks.read = [&](int64_t step) { return trainer.read(step); };
  callbacks.on_progress = [&](int64_t step, double units_per_s, const bench::StepSample& s) {
    mllog.tracked_stats(step + 1, {{"throughput", units_per_s}, {"loss", s.loss}});
  };
  std::optional<int64_t> last_saved;
  auto save = [&](int64_t iteration) {
    const auto t_save = std::chrono::steady_clock::now();
    // Data parallel: every rank's share of the optimizer state to data-parallel rank 0; tensor
    // parallel: that rank's group puts the slices together on the leader, which writes one file.
    OptimizerStateHost gathered;
    const bool writes = dp_rank == 0;
    if (dp_comm) trainer.gather_optimizer_state(writes ? &gathered : nullptr);
    SavedCheckpoint c;
    if (writes)
      c = save_checkpoint(f.save, trainer, identity, resolved_config(w, f),
                          dp_comm ? &gathered : nullptr, tp_host.get());
    if (leader) {
      const double seconds = ms_since(t_save) * 1e-3;
      std::fprintf(out, "# saved %s (%.1f MB, %.2f s)\n", c.path.c_str(),
                   static_cast<double>(c.bytes) / 1e6, seconds);
      rep.checkpoints.push_back({c.iteration, c.path, c.bytes, seconds});
    }
    last_saved = iteration;
  };
  callbacks.after_step = [&](int64_t step) {
    const int64_t done = first + step + 1;  // steps taken, those before a resume included
    const bool last = step + 1 == f.steps;
    auto after = bench::LoopCallbacks::After::kNothing;
    if (f.eval_interval > 0 && (done % f.eval_interval == 0 || last)) {
      after = bench::LoopCallbacks::After::kWorked;
      const auto samples = static_cast<int64_t>(static_cast<double>(done) * samples_per_step);
      mllog.end(k::kBlockStop, {{k::kSamplesCount, samples}});
      mllog.start(k::kEvalStart, {{k::kSamplesCount, samples}});
      const auto e0 = std::chrono::steady_clock::now();
      const double value = trainer.evaluate(eval_samples);
      mllog.event(k::kEvalAccuracy, value, {{k::kSamplesCount, samples}});
      mllog.end(k::kEvalStop, {{k::kSamplesCount, samples}});
      std::fprintf(out, "eval after step %" PRId64 ": %s %.6f (%" PRId64 " samples, %.1f ms)\n",
                   done, eval->metric.c_str(), value, eval_samples, ms_since(e0));
      rep.evals.push_back({done, eval_samples, value, ms_since(e0) * 1e-3});
      const bool reached =
          !std::isnan(target_quality) &&
          (eval->higher_is_better ? value >= target_quality : value <= target_quality);
      if (reached) {
        rep.steps_to_target = done;
        after = bench::LoopCallbacks::After::kStop;
      } else if (!last) {
        mllog.start(k::kBlockStart, {{k::kSamplesCount, samples}});
      }
    }
    if (step == 0 && !f.dump_step.empty()) {
      dump_step(f.dump_step, trainer, identity);
      std::fprintf(out, "# wrote step %" PRId64 "'s loss, gradients and batch to %s\n", done,
                   f.dump_step.c_str());
      if (after == bench::LoopCallbacks::After::kNothing)
        after = bench::LoopCallbacks::After::kWorked;
    }
    if (f.save_interval > 0 && done % f.save_interval == 0) {
      save(done);
      if (after == bench::LoopCallbacks::After::kNothing)
        after = bench::LoopCallbacks::After::kWorked;
    }
    return after;
  };
  const bench::LoopResult result = bench::run_steps(ctx.stream(), loop, callbacks, out);
  const auto trained =
      static_cast<int64_t>(static_cast<double>(first + result.steps_run) * samples_per_step);
  if (f.eval_interval == 0) mllog.end(k::kBlockStop, {{k::kSamplesCount, trained}});
  const bool aborted = !std::isnan(target_quality) && !rep.steps_to_target;
  mllog.end(k::kRunStop, {{k::kStatus, aborted ? k::kAborted : k::kSuccess}});
  if (!std::isnan(target_quality)) {
    rep.target_quality = target_quality;
    if (rep.steps_to_target) {
      rep.time_to_train_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      std::fprintf(out, "# target %s %g reached after %" PRId64 " steps: %.3f s to train\n",
                   eval->metric.c_str(), target_quality, *rep.steps_to_target,
                   *rep.time_to_train_s);
    } else {
      std::fprintf(out, "# target %s %g not reached in %" PRId64 " steps (run_stop aborted)\n",
                   eval->metric.c_str(), target_quality, result.steps_run);
    }
  }

  if (!f.save.empty() && last_saved != first + result.steps_run) save(first + result.steps_run);

  // The summary.
  rep.peak_bytes = static_cast<int64_t>(bench::device_used_bytes()) -
                   static_cast<int64_t>(trainer.used_before_arena());
  rep.arena_bytes = static_cast<int64_t>(trainer.arena().size_bytes());
  // cudaMemGetInfo sees the whole GPU: another process that allocated or freed memory during the
  // run moves the figure, and a peak below the arena can only mean that.
  if (rep.peak_bytes < rep.arena_bytes)
    std::fprintf(out,
                 "# memory: warning: the GPU's memory use fell during the run (another process "
                 "freed memory); peak_bytes and graph_extra_bytes are not this run's\n");
  rep.tool = info.tool;
  rep.version = version();
  rep.workload = info.name;
  rep.preset = f.preset;
  rep.graphs = f.graphs;
  rep.environment = env;
  rep.config = run_config(w, f);
  rep.tensor_parallel_collectives = model->collectives();
  rep.step_ms = result.step_stats;
  rep.host_enqueue_us = result.host_stats;
  rep.unit = info.unit;
  rep.units_per_step = model->units_per_step();
  rep.samples_per_step = samples_per_step;
  rep.flops_per_step = model->flops_per_step();
  rep.flops_formula = model->flops_formula();
  rep.peak_tflops = trainer.peaks().bf16_gemm_tflops;
  for (const graphs::GraphStats& g : trainer.step_plan().graph_stats()) {
    rep.graph_count += 1;
    rep.graph_nodes += static_cast<int64_t>(g.nodes);
    rep.capture_ms += g.capture_ms;
    rep.instantiate_ms += g.instantiate_ms;
  }
  rep.losses = result.losses;
  if (eval) rep.eval_metric = f.eval_interval > 0 ? eval->metric : "";
  const ParamStore& ps = model->params();
  rep.weights_hash = bench::device_hash(ps.weights().data, ps.weights().bytes());
  r.master_hash = bench::device_hash(ps.masters().data, ps.masters().bytes());
  rep.loss_floor = model->loss_floor();
  if (resume) {
    rep.resumed_from = resume->path();
    rep.first_step = first;
  }

  rep.world_size = world.size;
  rep.data_parallel = dp;
  if (dp > 1) rep.grad_buckets = static_cast<int64_t>(model->params().buckets().size());
  for (const comm::CollectiveTiming& c : trainer.collective_timings())
    rep.collectives.push_back({c.comm, comm::kind_name(c.kind), comm::dtype_name(c.dtype),
                               static_cast<int64_t>(c.bytes), c.calls_per_step, c.median_us,
                               c.busbw_gbps, c.overlapped});
  rep.tensor_parallel = tp;
  rep.rank_step_ms = comm::all_gather_doubles(world, rep.step_ms.median);
  if (const auto& t = trainer.step_traffic()) {
    rep.collectives_per_step = static_cast<int64_t>(t->calls);
    rep.comm_bytes_per_step = static_cast<int64_t>(t->bytes);
  }

  std::fputs(bench::summary(rep).c_str(), out);
  if (!f.json.empty() && leader) {
    bench::write_json(f.json, bench::to_json(rep));
    std::fprintf(out, "# wrote %s\n", f.json.c_str());
  }
  std::fflush(out);
  return r;
}

int main(Workload& w, int argc, char** argv) {
  const comm::World& world = comm::init_world(&argc, &argv);
  const int status = bench::run_main(w.info().tool.c_str(), [&] {
    const std::vector<std::string> args(argv + 1, argv + argc);
    const std::optional<RunFlags> parsed = parse(w, args, world.rank == 0 ? stdout : nullptr);
    if (!parsed) return 0;  // --help
    RunFlags flags = resolve(w, *parsed);
    flags.seed = comm::broadcast(world, flags.seed);  // a seed from the clock: rank 0's
    if (flags.print_config) {
      if (world.rank == 0) std::printf("%s\n", resolved_config(w, flags).dump(2).c_str());
      return 0;
    }
    // One rank prints the run; the others only their errors.
    std::FILE* out = stdout;
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> quiet(nullptr, std::fclose);
    if (world.rank != 0) {
      quiet.reset(std::fopen("/dev/null", "w"));
      out = quiet ? quiet.get() : stdout;
    }
    run(w, flags, out);
    return 0;
  });
  // A failed rank ends the job: the others may be waiting for it in a collective.
  if (status != 0 && world.size > 1) comm::abort_world(status);
  comm::finalize_world();
  return status;
}

}  // namespace replay::train
