// trainer.cpp: the step plan, the sync-free optimizer, the readback and the evaluation plan.
#include "train/trainer.h"

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include "common/check.h"

namespace replay::train {

Trainer::Trainer(Context& ctx, Model& model, TrainingConfig training, TrainerOptions options)
    : ctx_(ctx), model_(model), training_(std::move(training)), options_(options) {
  validate(training_.schedule);
  if (training_.loss_scaling) validate(*training_.loss_scaling);
  REPLAY_REQUIRE(options_.warmup >= 0, "warm-up steps must be non-negative");
  // The peak measurement runs once at set-up (phase 0), in memory the step's activations reuse.
  if (options_.measure_peak) peak_buffers_ = bench::plan_peak_buffers(plan_, false, {0, 0});
  comm::Communicator* dp = options_.data_parallel;
  if (dp != nullptr) {
    REPLAY_REQUIRE(dp->size() > 1, "Trainer: a data-parallel group of one rank");
    model_.params().set_shard(dp->rank(), dp->size());
    model_.params().set_bucket_elements(options_.bucket_elements);
  }
  if (dp != nullptr || options_.tensor_parallel != nullptr)
    // The grad norm's sum of squares (a double), then a float the planted fault reduces.
    sumsq_id_ = plan_.add("grad_norm.sumsq", DType::kFP32, 4, "optimizer");
  model_.plan(plan_);
  if (training_.optimizer == TrainingConfig::Optimizer::kLamb) {
    REPLAY_REQUIRE(dp == nullptr && options_.tensor_parallel == nullptr,
                   "LAMB runs in one process: its per-tensor norms would need every rank's share");
    const ParamStore& p = model_.params();
    lamb_ws_id_ = plan_.add("lamb.workspace",
                            lamb_workspace_bound(p.buffer_numel(), static_cast<int64_t>(p.count())),
                            "optimizer");
  }
  scalars_id_ = plan_step_scalars(plan_);
  rng_id_ = graphs::RngTracker::plan(plan_, kRngStreams);
  plan_.plan();
}

Trainer::~Trainer() {
  if (comm_fork_) cudaEventDestroy(comm_fork_);
  if (comm_join_) cudaEventDestroy(comm_join_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
}

const Arena& Trainer::arena() const {
  REPLAY_REQUIRE(arena_ != nullptr, "Trainer::arena before allocate");
  return *arena_;
}

void Trainer::allocate() {
  REPLAY_REQUIRE(arena_ == nullptr, "Trainer::allocate called twice");
  cudaStream_t s = ctx_.stream();
  used_before_arena_ = bench::device_used_bytes();
  arena_ = &ctx_.create_arena(std::move(plan_));
  model_.bind(*arena_);
  if (options_.measure_peak) peaks_ = bench::measure_peaks(ctx_, *arena_, peak_buffers_);

  scalars_ = arena_->as<StepScalars>(scalars_id_);
  if (sumsq_id_ >= 0) sumsq_ = static_cast<double*>(arena_->data(sumsq_id_));
  if (lamb_ws_id_ >= 0) lamb_ws_ = arena_->data(lamb_ws_id_);
  const LossScalerConfig* scaler = training_.loss_scaling ? &*training_.loss_scaling : nullptr;
  init_step_scalars(scalars_, scaler ? scaler->init_scale : 1.0f, scaler ? scaler->hysteresis : 1,
                    s);
  model_.initialize(options_.seed,
                    StepIO{&scalars_->loss, &scalars_->loss_scale, &scalars_->iteration}, s);
  rng_ = std::make_unique<graphs::RngTracker>(arena_->data(rng_id_), arena_->bytes(rng_id_),
                                              kRngStreams);
  rng_->add_parallel_streams(options_.seed, 0, 0, 0);  // this process is rank 0 of every group
  model_.register_rng(*rng_);
  rng_->initialize(s);
  if (options_.fault != graphs::Fault::kNone)
    injector_ = std::make_unique<graphs::FaultInjector>(options_.fault, options_.seed);
  if (training_.skip_with_if) conditionals_ = std::make_unique<graphs::Conditionals>();
  std::vector<graphs::ReadbackField> fields{
      {"loss", &scalars_->loss, graphs::ScalarType::kF32},
      {"lr", &scalars_->lr, graphs::ScalarType::kF32},
      {"grad_norm", &scalars_->grad_norm, graphs::ScalarType::kF32},
      {"step", &scalars_->step, graphs::ScalarType::kI64}};
  if (scaler) fields.push_back({"loss_scale", &scalars_->loss_scale, graphs::ScalarType::kF32});
  readback_ = std::make_unique<graphs::ReadbackRing>(kReadbackSlots, &scalars_->iteration,
                                                     std::move(fields));
  build_step_plan();
  if (options_.evaluate) {
    REPLAY_REQUIRE(model_.evaluation().has_value(), "an evaluating run of a model without one");
    build_eval_plan();
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
}

// NVTX range and the region's name in its errors; the planted fault, when there is one, at the end
// of the region's work, with its arguments.
graphs::Region Trainer::wrap(graphs::Region r, int site) {
  graphs::FaultInjector* inject = site >= 0 ? injector_.get() : nullptr;
  auto work = std::move(r.enqueue);
  r.enqueue = [name = r.name, inject, site, work = std::move(work)](cudaStream_t s,
                                                                    const graphs::RegionArgs& a) {
    nvtxRangePushA(name.c_str());
    try {
      work(s, a);
      if (inject) inject->enqueue(s, a, site);
    } catch (const Error& e) {
      nvtxRangePop();
      throw Error(e.library(), e.status(), "region '" + name + "': " + e.what());
    }
    nvtxRangePop();
  };
  if (inject) {
    auto args = std::move(r.args);
    r.args = [inject, site, args = std::move(args)] {
      graphs::RegionArgs a = args ? args() : graphs::RegionArgs{};
      inject->add_args(a, site);
      return a;
    };
  }
  return r;
}

void Trainer::build_step_plan() {
  graphs::StepPlanOptions o(options_.mode);
  o.warmup_steps = options_.warmup;
  step_plan_ = std::make_unique<graphs::StepPlan>("step", o);

  std::vector<graphs::Region> regions = model_.regions();
  REPLAY_REQUIRE(!regions.empty(), "the model's step has no regions");
  size_t planted = regions.size(), second = regions.size();
  if (injector_) {
    planted = 0;
    for (size_t i = 0; i < regions.size(); ++i)
      if (regions[i].kind == graphs::RegionKind::kForwardLayer) {
        planted = i;
        break;
      }
    fault_region_ = options_.fault == graphs::Fault::kCollectiveMismatch ||
                            options_.fault == graphs::Fault::kOverflow
                        ? std::string("optimizer")
                    : options_.fault == graphs::Fault::kRankStall
                        ? std::string("the step loop of rank 1, before step 2")
                        : regions[planted].name;
    if (injector_->sites() > 1) {  // replay-order: the next layer region reads what `planted` wrote
      for (size_t i = planted + 1; i < regions.size() && second == regions.size(); ++i)
        if (regions[i].kind != graphs::RegionKind::kOther) second = i;
      REPLAY_REQUIRE(second < regions.size(), std::string("--inject ") +
                                                  graphs::fault_name(options_.fault) +
                                                  ": the step needs two layer regions");
      fault_region_ += ", " + regions[second].name;
    }
  }
  std::vector<std::vector<int>> buckets(regions.size());
  if (options_.data_parallel != nullptr) {
    buckets = bucket_regions(regions);
    REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&comm_fork_, cudaEventDisableTiming));
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&comm_join_, cudaEventDisableTiming));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    const std::string name = regions[i].name;
    step_plan_->add_region(wrap(std::move(regions[i]), i == planted ? 0 : i == second ? 1 : -1));
    if (buckets[i].empty()) continue;
    // The buckets this region finishes, reduce-scattered on the side stream while the backward
    // goes on: a region of their own (kOther), so in layer mode they run eagerly between the
    // layer graphs (a layer graph would have to join its fork before it ends: no overlap), and in
    // full mode the whole step's graph holds the fork and the optimizer's join.
    graphs::Region rs;
    rs.name = name + ".grad_rs";
    rs.enqueue = [this, b = std::move(buckets[i])](cudaStream_t s, const graphs::RegionArgs&) {
      reduce_scatter_buckets(b, s);
    };
    step_plan_->add_region(wrap(std::move(rs), -1));
  }
  graphs::Region opt;
  opt.name = "optimizer";
  opt.enqueue = [this](cudaStream_t s, const graphs::RegionArgs&) { optimizer_step(s); };
  opt.args = [this] { return optimizer_args(); };
  step_plan_->add_region(wrap(std::move(opt), -1));

  // What carries from one step to the next: parameters, master weights and Adam's moments, which
  // the warm-up hold keeps the optimizer from touching, and the step scalars, saved and restored.
  // Gradients and activations are rewritten every step.
  step_plan_->set_warmup_hold(&scalars_->hold);
  step_plan_->add_state("step_scalars", step_scalars_view(scalars_));
  // The model's own carried state (a router's biases, EMA weights) changes in the warm-up too:
  // saved and restored with the scalars, so step 0 starts from the same bytes whatever --warmup.
  for (const Model::NamedTensor& t : model_.checkpoint_state())
    step_plan_->add_state("state." + t.name, t.view);
  step_plan_->set_rng(rng_.get());
  const std::vector<std::string> keys = model_.shape_keys();
  if (!keys.empty()) step_plan_->set_shape_keys(keys, [this](int k) { model_.select_shape(k); });
}

void Trainer::build_eval_plan() {
  const std::optional<EvalInfo> info = model_.evaluation();
  const bool per_region =
      options_.mode == graphs::GraphMode::kFull && info && !info->one_graph_in_full;
  graphs::StepPlanOptions o(per_region ? graphs::GraphMode::kLayer : options_.mode);
  o.warmup_steps =
      options_.warmup > 0 ? 1 : 0;  // the eval regions' libraries warm up outside capture
  eval_plan_ = std::make_unique<graphs::StepPlan>("eval", o);
  for (graphs::Region& r : model_.eval_regions()) eval_plan_->add_region(wrap(std::move(r), -1));
}

std::vector<std::vector<int>> Trainer::bucket_regions(const std::vector<graphs::Region>& regions) {
  const ParamStore& ps = model_.params();
  const auto* g = static_cast<const char*>(ps.grads().data);
  const auto g_end = g + ps.grads().bytes();
  const std::vector<ParamStore::Bucket>& buckets = ps.buckets();
  std::vector<int> last(buckets.size(), -1);
  for (size_t i = 0; i < regions.size(); ++i) {
    if (!regions[i].args) continue;
    const graphs::RegionArgs args = regions[i].args();  // kept: list() refers into it
    for (const graphs::RegionArg& a : args.list()) {
      const auto* p = static_cast<const char*>(a.view.data);
      if (a.access == graphs::Access::kRead || p < g || p >= g_end) continue;
      const int64_t lo = (p - g) / static_cast<int64_t>(sizeof(float)),
                    hi = lo + static_cast<int64_t>(a.view.bytes() / sizeof(float));
      for (size_t b = 0; b < buckets.size(); ++b)
        if (lo < buckets[b].begin + buckets[b].length && buckets[b].begin < hi)
          last[b] = static_cast<int>(i);
    }
  }
  std::vector<std::vector<int>> out(regions.size());
  optimizer_buckets_.clear();
  // The last region has nothing after it to overlap with: its buckets go with the optimizer.
  for (size_t b = 0; b < buckets.size(); ++b)
    if (last[b] < 0 || last[b] + 1 == static_cast<int>(regions.size()))
      optimizer_buckets_.push_back(static_cast<int>(b));
    else
      out[static_cast<size_t>(last[b])].push_back(static_cast<int>(b));
  return out;
}

void Trainer::reduce_scatter_bucket(int b, cudaStream_t s) const {
  const ParamStore& ps = model_.params();
  const ParamStore::Bucket& bucket = ps.buckets().at(static_cast<size_t>(b));
  float* g = ps.grads().as<float>(DType::kFP32) + bucket.begin;
  const int64_t part = bucket.length / ps.shard_count();
  options_.data_parallel->reduce_scatter(g, g + ps.shard_rank() * part, static_cast<size_t>(part),
                                         ncclFloat32, ncclAvg, s);
}

void Trainer::reduce_scatter_buckets(const std::vector<int>& buckets, cudaStream_t s) const {
  REPLAY_CUDA_CHECK(cudaEventRecord(comm_fork_, s));
  REPLAY_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, comm_fork_, 0));
  for (int b : buckets) reduce_scatter_bucket(b, comm_stream_);
}

// The sync-free optimizer, in step_scalars.h's order. The grad norm sets found_inf when a gradient
// is Inf or NaN, which is the overflow check of loss scaling: every gradient is in the norm.
void Trainer::optimizer_step(cudaStream_t s) const {
  const ParamStore& params = model_.params();
  const TrainingConfig& t = training_;
  comm::Communicator* dp = options_.data_parallel;
  comm::Communicator* tp = options_.tensor_parallel;
  // The buckets reduce-scattered on the side stream during the backward, joined first.
  if (comm_stream_ != nullptr && optimizer_buckets_.size() < params.buckets().size()) {
    REPLAY_CUDA_CHECK(cudaEventRecord(comm_join_, comm_stream_));
    REPLAY_CUDA_CHECK(cudaStreamWaitEvent(s, comm_join_, 0));
  }
  begin_step(scalars_, s);
  if (injector_) {  // --inject overflow: Inf gradients in one step, before the norm finds them
    const TensorView g = params.grads();
    injector_->plant_overflow(g.as<float>(DType::kFP32), g.numel(), &scalars_->iteration, s);
  }
  if (dp == nullptr && tp == nullptr) {
    clip_grad_norm(params.grad_norm_table(), t.clip_norm, scalars_, params.grad_norm_workspace(),
                   params.grad_norm_workspace_bytes(), s);
  } else {
    if (dp != nullptr)  // the ranks' mean gradient, this rank's part of each bucket in place
      for (int b : optimizer_buckets_) reduce_scatter_bucket(b, s);
    // The norm over every data-parallel share and every tensor-parallel shard.
    grad_norm_sumsq(params.grad_norm_table(), sumsq_, params.grad_norm_workspace(),
                    params.grad_norm_workspace_bytes(), s);
    if (tp != nullptr) tp->all_reduce(sumsq_, sumsq_, 1, ncclFloat64, ncclSum, s);
    if (dp != nullptr) dp->all_reduce(sumsq_, sumsq_, 1, ncclFloat64, ncclSum, s);
    grad_norm_from_sumsq(sumsq_, t.clip_norm, &scalars_->loss_scale, &scalars_->grad_norm,
                         &scalars_->grad_scale, &scalars_->found_inf, s);
    if (dp != nullptr) {
      dp->all_reduce(&scalars_->loss, &scalars_->loss, 1, ncclFloat32, ncclAvg, s);
      if (options_.fault == graphs::Fault::kCollectiveMismatch && dp->rank() == 1) {
        // --inject collective-mismatch: one all-reduce more on rank 1, captured only (an eager
        // extra collective would pair with the other ranks' next one and hang the warm-up).
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        REPLAY_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
        float* scratch = reinterpret_cast<float*>(sumsq_ + 1);
        if (capturing == cudaStreamCaptureStatusActive)
          dp->all_reduce(scratch, scratch, 1, ncclFloat32, ncclSum, s);
      }
    }
  }
  prepare_optimizer(t.schedule, scalars_, s);
  const auto update = [&](cudaStream_t u) {
    if (t.optimizer == TrainingConfig::Optimizer::kLamb) {
      lamb_step(params.adamw_table(), t.lamb, &scalars_->lr, &scalars_->step, &scalars_->grad_scale,
                &scalars_->noop, lamb_ws_, arena_->bytes(lamb_ws_id_), u);
    } else {
      adamw_step(params.adamw_table(), t.adam, &scalars_->lr, &scalars_->step,
                 &scalars_->grad_scale, &scalars_->noop, u);
    }
  };
  if (conditionals_) {  // the update as an IF node's body, run only when noop == 0
    conditionals_->if_equal(s, "optimizer.update", &scalars_->noop, 0, update);
  } else {
    update(s);
  }
  if (dp != nullptr) {  // every rank's updated share, to every rank
    const TensorView w = params.weights();
    const size_t esize = dtype_size(w.dtype);
    const ncclDataType_t type = w.dtype == DType::kBF16   ? ncclBfloat16
                                : w.dtype == DType::kFP16 ? ncclFloat16
                                                          : ncclFloat32;
    for (const ParamStore::Bucket& b : params.buckets()) {
      const int64_t part = b.length / params.shard_count();
      char* base = static_cast<char*>(w.data) + b.begin * static_cast<int64_t>(esize);
      dp->all_gather(base + params.shard_rank() * part * static_cast<int64_t>(esize), base,
                     static_cast<size_t>(part), type, s);
    }
  }
  readback_->copy(s);
  end_step(scalars_, t.loss_scaling ? &*t.loss_scaling : nullptr, s);
}

graphs::RegionArgs Trainer::optimizer_args() const {
  const ParamStore& params = model_.params();
  graphs::RegionArgs a;
  if (options_.fault == graphs::Fault::kOverflow)  // the planted Inf writes the first gradients
    a.read_write("grads", params.grads());
  else
    a.read("grads", params.grads());
  a.read_write("params.weights", params.weights())
      .read_write("params.master", params.masters())
      .read_write("adam.exp_avg", params.exp_avg())
      .read_write("adam.exp_avg_sq", params.exp_avg_sq())
      .read_write("step_scalars", step_scalars_view(scalars_));
  if (lamb_ws_ != nullptr)
    a.write("lamb.workspace", TensorView(lamb_ws_, DType::kUINT8,
                                         {static_cast<int64_t>(arena_->bytes(lamb_ws_id_))}));
  return a;
}

void Trainer::gather_optimizer_state(OptimizerStateHost* out) {
  comm::Communicator* dp = options_.data_parallel;
  REPLAY_REQUIRE(dp != nullptr, "gather_optimizer_state: not a data-parallel run");
  const ParamStore& p = model_.params();
  const auto share = static_cast<size_t>(p.shard_numel()), whole = share * p.shard_count();
  float* staging = p.grads().as<float>(DType::kFP32);  // whole; its contents die with the step
  std::vector<float>* to[] = {out ? &out->master : nullptr, out ? &out->exp_avg : nullptr,
                              out ? &out->exp_avg_sq : nullptr};
  const TensorView from[] = {p.masters(), p.exp_avg(), p.exp_avg_sq()};
  for (int k = 0; k < 3; ++k) {
    for (const ParamStore::Bucket& b : p.buckets())
      dp->all_gather(from[k].as<float>(DType::kFP32) + b.share_begin, staging + b.begin,
                     static_cast<size_t>(b.length / p.shard_count()), ncclFloat32, ctx_.stream());
    if (options_.watchdog != nullptr) {
      cudaEvent_t done = nullptr;
      REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      REPLAY_CUDA_CHECK(cudaEventRecord(done, ctx_.stream()));
      options_.watchdog->wait("the optimizer state's all-gather",
                              [&] { return cudaEventQuery(done) == cudaSuccess; });
      cudaEventDestroy(done);
    }
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));
    if (to[k] != nullptr) {
      to[k]->resize(whole);
      REPLAY_CUDA_CHECK(
          cudaMemcpy(to[k]->data(), staging, whole * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }
  REPLAY_CUDA_CHECK(cudaMemsetAsync(staging, 0, whole * sizeof(float), ctx_.stream()));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));
}

void Trainer::resume_at(int64_t iteration) {
  REPLAY_REQUIRE(readback_ != nullptr, "Trainer::resume_at before allocate");
  readback_->set_first_iteration(iteration);
}

void Trainer::load_batch() {
  key_ = model_.load_batch(ctx_.stream());
}

void Trainer::prepare() {
  REPLAY_REQUIRE(step_plan_ != nullptr, "Trainer::prepare before allocate");
  if (eval_plan_) {  // its warm-up reads a real held-out batch
    model_.begin_eval(ctx_.stream());
    model_.load_eval_batch(ctx_.stream());
    eval_plan_->prepare(ctx_.stream());
  }
  load_batch();  // the first batch: the step's warm-up reads it and step 0 trains on it
  // The warm-up runs the step eagerly warmup x keys times: what its collectives enqueue is the
  // communication of a step, which the graphs replay unchanged.
  auto traffic = [this] {
    comm::Traffic t;
    for (const comm::Communicator* c : {options_.data_parallel, options_.tensor_parallel})
      if (c != nullptr) {
        t.calls += c->eager_traffic().calls;
        t.bytes += c->eager_traffic().bytes;
      }
    return t;
  };
  const comm::Traffic before = traffic();
  // ... and each eager collective of the warm-up is timed (events around it): the bandwidth the
  // step's collectives reach, with the step's other work around them.
  comm::Communicator* comms[] = {options_.data_parallel, options_.tensor_parallel};
  for (comm::Communicator* c : comms)
    if (c != nullptr) c->begin_timing(kTimedCollectives, ctx_.stream());
  step_plan_->prepare(ctx_.stream());
  for (comm::Communicator* c : comms)
    if (c != nullptr) c->end_timing();
  const comm::Traffic after = traffic();
  const auto steps = static_cast<uint64_t>(options_.warmup) *
                     static_cast<uint64_t>(std::max<size_t>(model_.shape_keys().size(), 1));
  if (steps > 0 && (options_.data_parallel != nullptr || options_.tensor_parallel != nullptr)) {
    step_traffic_ =
        comm::Traffic{(after.calls - before.calls) / steps, (after.bytes - before.bytes) / steps};
    collective_timings_.clear();
    for (comm::Communicator* c : comms) {
      if (c == nullptr) continue;
      const std::vector<comm::TimedCollective> timed = c->timed();
      if (timed.empty()) continue;
      for (comm::CollectiveTiming& t :
           comm::summarize_timings(c->name(), timed, c->size(), static_cast<int>(steps)))
        collective_timings_.push_back(std::move(t));
    }
  }
  model_.select_shape(key_);  // the plan leaves its last key selected
}

void Trainer::step() {
  if (!step_plan_->prepared()) prepare();
  if (options_.fault == graphs::Fault::kRankStall && steps_enqueued_ == 2 && stalls_here()) {
    // --inject rank-stall: this host thread stops, as a hung one would; the other ranks' GPUs
    // wait in this step's first collective and their watchdog ends the job.
    std::fprintf(stderr, "--inject rank-stall: this rank stops enqueuing before step 2\n");
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  steps_enqueued_ += 1;
  step_plan_->run_step(ctx_.stream(), key_);
  readback_->step_enqueued(ctx_.stream());
}

bool Trainer::stalls_here() const {
  // Rank 1 of the first group that has one, rank 0 of the other: one process of the world.
  comm::Communicator* dp = options_.data_parallel;
  comm::Communicator* tp = options_.tensor_parallel;
  if (tp != nullptr) return tp->rank() == 1 && (dp == nullptr || dp->rank() == 0);
  return dp != nullptr && dp->rank() == 1;
}

graphs::VerifyReport Trainer::verify_step() {
  if (!step_plan_->prepared()) prepare();
  steps_enqueued_ += 1;
  const graphs::VerifyReport report = step_plan_->verify_step(ctx_.stream(), key_);
  readback_->step_enqueued(ctx_.stream());
  return report;
}

bench::StepSample Trainer::read(int64_t s) const {
  graphs::ReadbackSample r;
  if (options_.watchdog != nullptr) {
    options_.watchdog->wait("the step's readback", [&] {
      std::optional<graphs::ReadbackSample> got = readback_->try_read(s);
      if (got) r = std::move(*got);
      return got.has_value();
    });
  } else {
    r = readback_->read(s);
  }
  bench::StepSample out;
  out.loss = r.get("loss");
  out.lr = r.get("lr");
  out.grad_norm = r.get("grad_norm");
  if (training_.loss_scaling) out.loss_scale = r.get("loss_scale");
  return out;
}

double Trainer::evaluate(int64_t samples) {
  const std::optional<EvalInfo> info = model_.evaluation();
  REPLAY_REQUIRE(info && eval_plan_, "this model has no evaluation");
  REPLAY_REQUIRE(samples >= 1, "an evaluation needs at least one sample");
  const int64_t batches = (samples + info->samples_per_batch - 1) / info->samples_per_batch;
  cudaStream_t s = ctx_.stream();
  model_.begin_eval(s);
  for (int64_t b = 0; b < batches; ++b) {
    model_.load_eval_batch(s);
    eval_plan_->run_step(s);
  }
  return model_.end_eval(s);
}

}  // namespace replay::train
