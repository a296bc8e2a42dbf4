// training.cpp: the step plan, the sync-free optimizer and the readback of a transformer shard.
#include "workloads/transformer/training.h"

#include <nvtx3/nvToolsExt.h>

#include <functional>

#include "common/check.h"

namespace replay::transformer {

Trainer::Trainer(Context& ctx, TrainerConfig config, GemmCache& gemms, AttentionCache& attention,
                 const bench::HostDelay* delay)
    : ctx_(ctx), config_(std::move(config)), delay_(delay) {
  graphs::validate(config_.optimizer.schedule);
  REPLAY_REQUIRE(config_.warmup >= 0, "warm-up steps must be non-negative");
  model_ = std::make_unique<Transformer>(ctx_, config_.shape, config_.microbatches, gemms,
                                         attention, delay_);
  // The peak measurement runs once at set-up (phase 0), in memory the step's activations reuse.
  if (config_.measure_peak) peak_buffers_ = bench::plan_peak_buffers(plan_, false, {0, 0});
  model_->plan(plan_);
  scalars_id_ = graphs::plan_step_scalars(plan_);
  rng_id_ = graphs::RngTracker::plan(plan_, kRngStreams);
  plan_.plan();
}

Trainer::~Trainer() = default;

const Arena& Trainer::arena() const {
  REPLAY_REQUIRE(arena_ != nullptr, "Trainer::arena before allocate");
  return *arena_;
}

void Trainer::allocate() {
  REPLAY_REQUIRE(arena_ == nullptr, "Trainer::allocate called twice");
  cudaStream_t s = ctx_.stream();
  used_before_arena_ = bench::device_used_bytes();
  arena_ = &ctx_.create_arena(std::move(plan_));
  model_->bind(*arena_);
  if (config_.measure_peak) peaks_ = bench::measure_peaks(ctx_, *arena_, peak_buffers_);

  model_->initialize(config_.seed, s);
  scalars_ = arena_->as<graphs::StepScalars>(scalars_id_);
  graphs::init_step_scalars(scalars_, 1.0f, 1, s);  // bf16 needs no loss scaling
  model_->set_loss_output(&scalars_->loss);
  rng_ = std::make_unique<graphs::RngTracker>(arena_->data(rng_id_), arena_->bytes(rng_id_),
                                              kRngStreams);
  rng_->add_parallel_streams(config_.seed, 0, 0, 0);  // this process is rank 0 of every group
  model_->register_rng(*rng_);
  rng_->initialize(s);
  if (config_.fault != Fault::kNone)
    injector_ = std::make_unique<FaultInjector>(config_.fault, config_.seed);
  readback_ = std::make_unique<graphs::ReadbackRing>(
      kReadbackSlots, &scalars_->iteration,
      std::vector<graphs::ReadbackField>{
          {"loss", &scalars_->loss, graphs::ScalarType::kF32},
          {"lr", &scalars_->lr, graphs::ScalarType::kF32},
          {"grad_norm", &scalars_->grad_norm, graphs::ScalarType::kF32},
          {"step", &scalars_->step, graphs::ScalarType::kI64}});
  build_step_plan();
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
}

void Trainer::build_step_plan() {
  graphs::StepPlanOptions options(config_.mode);
  options.warmup_steps = config_.warmup;
  step_plan_ = std::make_unique<graphs::StepPlan>("step", options);
  Transformer& m = *model_;

  // Every region runs inside an NVTX range and names itself in the errors it raises (a capture
  // that a region's call refuses then says which region, in full mode too). The planted fault of
  // --inject, when there is one, goes at the end of FaultInjector::kRegion, with its arguments.
  FaultInjector* inject = injector_.get();
  auto region = [&](const std::string& name, graphs::RegionKind kind,
                    std::function<void(cudaStream_t)> work,
                    std::function<graphs::RegionArgs()> args) {
    const bool planted =
        inject != nullptr && (name == FaultInjector::kRegion ||
                              name == std::string("mb0.") + FaultInjector::kRegion);
    graphs::Region r;
    r.name = name;
    r.kind = kind;
    r.enqueue = [name, planted, inject, work = std::move(work)](cudaStream_t s,
                                                                const graphs::RegionArgs& a) {
      nvtxRangePushA(name.c_str());
      try {
        work(s);
        if (planted) inject->enqueue(s, a);
      } catch (const Error& e) {
        nvtxRangePop();
        throw Error(e.library(), e.status(), "region '" + name + "': " + e.what());
      }
      nvtxRangePop();
    };
    r.args = [planted, inject, args = std::move(args)] {
      graphs::RegionArgs a = args();
      if (planted) inject->add_args(a);
      return a;
    };
    step_plan_->add_region(std::move(r));
  };
  using graphs::RegionKind;
  const int n = config_.microbatches, L = m.num_layers();
  for (int mb = 0; mb < n; ++mb) {
    const std::string p = n > 1 ? "mb" + std::to_string(mb) + "." : "";
    region(
        p + "embedding.fwd", RegionKind::kOther,
        [&m, mb](cudaStream_t s) { m.embedding_forward(mb, s); },
        [&m, mb] { return m.embedding_forward_args(mb); });
    for (int l = 0; l < L; ++l)
      region(
          p + "layer" + std::to_string(l) + ".fwd", RegionKind::kForwardLayer,
          [&m, mb, l](cudaStream_t s) { m.layer_forward(mb, l, s); },
          [&m, mb, l] { return m.layer_forward_args(mb, l); });
    region(
        p + "head", RegionKind::kOther, [&m, mb](cudaStream_t s) { m.head(mb, s); },
        [&m, mb] { return m.head_args(mb); });
    for (int l = L - 1; l >= 0; --l)
      region(
          p + "layer" + std::to_string(l) + ".bwd", RegionKind::kBackwardLayer,
          [&m, mb, l](cudaStream_t s) { m.layer_backward(mb, l, s); },
          [&m, mb, l] { return m.layer_backward_args(mb, l); });
    region(
        p + "embedding.bwd", RegionKind::kOther,
        [&m, mb](cudaStream_t s) { m.embedding_backward(mb, s); },
        [&m, mb] { return m.embedding_backward_args(mb); });
  }
  region(
      "optimizer", RegionKind::kOther, [this](cudaStream_t s) { optimizer_step(s); },
      [this] { return optimizer_args(); });

  // What carries from one step to the next: parameters, master weights and Adam's moments, which the
  // warm-up hold keeps the optimizer from touching, and the step scalars, saved and restored. Gradients
  // and activations are rewritten every step.
  step_plan_->set_warmup_hold(&scalars_->hold);
  step_plan_->add_state("step_scalars", graphs::step_scalars_view(scalars_));
  step_plan_->set_rng(rng_.get());
}

// The sync-free optimizer, in syncfree.h's order.
void Trainer::optimizer_step(cudaStream_t s) const {
  const ParamStore& params = model_->params();
  const OptimizerConfig& o = config_.optimizer;
  auto hook = [this] {
    if (delay_) (*delay_)();
  };
  hook();
  graphs::begin_step(scalars_, s);
  hook();
  graphs::clip_grad_norm(params.grad_norm_table(), o.clip_norm, scalars_,
                         params.grad_norm_workspace(), params.grad_norm_workspace_bytes(), s);
  hook();
  graphs::prepare_optimizer(o.schedule, scalars_, s);
  hook();
  adamw_step(params.adamw_table(), o.adam, &scalars_->lr, &scalars_->step, &scalars_->grad_scale,
             &scalars_->noop, s);
  hook();
  readback_->copy(s);
  hook();
  graphs::end_step(scalars_, nullptr, s);
}

graphs::RegionArgs Trainer::optimizer_args() const {
  const ParamStore& params = model_->params();
  return graphs::RegionArgs()
      .read("grads", params.grads())
      .read_write("params.bf16", params.weights())
      .read_write("params.master", params.masters())
      .read_write("adam.exp_avg", params.exp_avg())
      .read_write("adam.exp_avg_sq", params.exp_avg_sq())
      .read_write("step_scalars", graphs::step_scalars_view(scalars_));
}

void Trainer::load_batch(data::BatchStream& data) {
  for (int mb = 0; mb < config_.microbatches; ++mb)
    data.next(ctx_.stream(), model_->tokens(mb), model_->targets(mb));
}

void Trainer::prepare() {
  REPLAY_REQUIRE(step_plan_ != nullptr, "Trainer::prepare before allocate");
  step_plan_->prepare(ctx_.stream());
}

void Trainer::step() {
  step_plan_->run_step(ctx_.stream());
  readback_->step_enqueued(ctx_.stream());
}

graphs::VerifyReport Trainer::verify_step() {
  const graphs::VerifyReport report = step_plan_->verify_step(ctx_.stream());
  readback_->step_enqueued(ctx_.stream());
  return report;
}

bench::StepSample Trainer::read(int64_t s) const {
  const graphs::ReadbackSample r = readback_->read(s);
  bench::StepSample out;
  out.loss = r.get("loss");
  out.lr = r.get("lr");
  out.grad_norm = r.get("grad_norm");
  return out;
}

double Trainer::flops_per_step() const {
  const TransformerShape& s = config_.shape;
  const double n = static_cast<double>(model_->params().total_numel());
  const double per_token = 6.0 * n + 12.0 * static_cast<double>(s.layers) *
                                         static_cast<double>(s.seq) *
                                         static_cast<double>(s.attn_width());
  return per_token * static_cast<double>(tokens_per_step());
}

const char* Trainer::flops_formula() {
  return "6*N*tokens + 12*L*s*d*tokens (per GPU shard: N = this shard's parameters, d = this "
         "shard's "
         "attention width, heads per GPU x head dim)";
}

}  // namespace replay::transformer
