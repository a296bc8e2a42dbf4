// mlp_workload.cpp: the example workload: its presets and flags, synthetic data, model, regions and
// evaluation.
#include "tests/train/mlp_workload.h"

#include <CLI/CLI.hpp>
#include <cuda_bf16.h>

#include <cinttypes>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/bench/harness.h"
#include "common/bench/mllog.h"
#include "common/check.h"
#include "common/context.h"
#include "common/data/splitmix.h"
#include "common/kernels/accumulate.h"
#include "common/kernels/cross_entropy.h"

namespace replay::example {

namespace {

// A standard normal from two splitmix draws (Box-Muller).
double normal(uint64_t& state) {
  const double u1 = (static_cast<double>(data::splitmix(state) >> 11) + 0.5) * 0x1.0p-53;
  const double u2 = static_cast<double>(data::splitmix(state) >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

train::ParamSpec param(std::string name, std::vector<int64_t> shape, train::ParamInit init,
                       float stddev, bool decay) {
  train::ParamSpec s;
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.init = init;
  s.stddev = stddev;
  s.weight_decay = decay;
  return s;
}

GemmDesc linear(int64_t m, int64_t n, int64_t k, Epilogue e) {
  GemmDesc d;
  d.m = m, d.n = n, d.k = k;
  d.epilogue = e;
  d.bias_type = e == Epilogue::kBGradA ? DType::kFP32 : DType::kBF16;
  return d;
}

}  // namespace

// ---- The model ---------------------------------------------------------------------------------

MlpModel::MlpModel(const Context& ctx, const MlpShape& shape, uint64_t data_seed)
    : shape_(shape), gemms_(ctx) {
  const int64_t B = shape_.batch, D = shape_.inputs, H = shape_.hidden, K = shape_.classes;
  REPLAY_REQUIRE(shape_.layers >= 1 && D % 8 == 0 && H % 8 == 0 && K % 8 == 0 && B % 8 == 0,
                 "the MLP needs a hidden layer and widths and batch that are multiples of 8");
  for (int64_t l = 0; l < shape_.layers; ++l) {
    const int64_t in = l == 0 ? D : H;
    Layer layer;
    const std::string p = "layer" + std::to_string(l);
    layer.weight =
        params_.add(param(p + ".weight", {H, in}, train::ParamInit::kNormal,
                          static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))), true));
    layer.bias = params_.add(param(p + ".bias", {H}, train::ParamInit::kZeros, 0.0f, false));
    GemmDesc fwd = linear(B, H, in, Epilogue::kBiasGeluAux);
    fwd.trans_b = true;
    layer.forward = &gemms_.get(fwd);
    GemmDesc wgrad = linear(H, in, B, Epilogue::kBGradA);
    wgrad.trans_a = true;
    wgrad.d_type = DType::kFP32;
    layer.wgrad = &gemms_.get(wgrad);
    if (l > 0) layer.dgrad = &gemms_.get(linear(B, in, H, Epilogue::kDGelu));
    layers_.push_back(layer);
  }
  out_.weight =
      params_.add(param("out.weight", {K, H}, train::ParamInit::kNormal,
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(H))), true));
  out_.bias = params_.add(param("out.bias", {K}, train::ParamInit::kZeros, 0.0f, false));
  GemmDesc fwd = linear(B, K, H, Epilogue::kBias);
  fwd.trans_b = true;
  out_.forward = &gemms_.get(fwd);
  GemmDesc wgrad = linear(K, H, B, Epilogue::kBGradA);
  wgrad.trans_a = true;
  wgrad.d_type = DType::kFP32;
  out_.wgrad = &gemms_.get(wgrad);
  out_.dgrad = &gemms_.get(linear(B, H, K, Epilogue::kDGelu));
  gemms_.seal();

  // The data: Gaussian inputs labelled by the argmax of a random linear teacher, in pinned memory
  // that load_batch copies from (outside any graph).
  const int64_t n = (shape_.train_batches + shape_.eval_batches) * B;
  REPLAY_CUDA_CHECK(cudaHostAlloc(&host_x_, static_cast<size_t>(n * D) * 2, cudaHostAllocDefault));
  REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_y_),
                                  static_cast<size_t>(n) * sizeof(int32_t), cudaHostAllocDefault));
  uint64_t state = data_seed;
  std::vector<double> teacher(static_cast<size_t>(K * D));
  for (double& t : teacher) t = normal(state);
  auto* x = static_cast<__nv_bfloat16*>(host_x_);
  std::vector<double> row(static_cast<size_t>(D));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < D; ++j) {
      x[i * D + j] = __float2bfloat16_rn(static_cast<float>(normal(state)));
      row[static_cast<size_t>(j)] = static_cast<double>(__bfloat162float(x[i * D + j]));
    }
    int32_t best = 0;
    double best_score = -1e300;
    for (int64_t k = 0; k < K; ++k) {
      double score = 0;
      for (int64_t j = 0; j < D; ++j)
        score += teacher[static_cast<size_t>(k * D + j)] * row[static_cast<size_t>(j)];
      if (score > best_score) best_score = score, best = static_cast<int32_t>(k);
    }
    host_y_[i] = best;
  }
}

MlpModel::~MlpModel() {
  if (host_x_) cudaFreeHost(host_x_);
  if (host_y_) cudaFreeHost(host_y_);
}

std::string MlpModel::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "MLP: %" PRId64 " inputs, %" PRId64 " hidden layers of %" PRId64 ", %" PRId64
                " classes, batch %" PRId64,
                shape_.inputs, shape_.layers, shape_.hidden, shape_.classes, shape_.batch);
  return buf;
}

void MlpModel::add(ArenaPlan& plan, TensorView& view, const std::string& name, DType dtype,
                   int64_t n) {
  // Phase 1 is the step; the set-up peak measurement (phase 0) shares the memory.
  buffers_.push_back({plan.add(name, dtype, n, "activations", {1, 2}), dtype, n, &view});
}

void MlpModel::plan(ArenaPlan& plan) {
  const int64_t B = shape_.batch, D = shape_.inputs, H = shape_.hidden, K = shape_.classes;
  params_.plan(plan, {2, 2});
  h_.resize(static_cast<size_t>(shape_.layers));
  aux_.resize(h_.size());
  dz_.resize(h_.size());
  add(plan, x_, "mlp.x", DType::kBF16, B * D);
  add(plan, y_, "mlp.y", DType::kINT32, B);
  for (size_t l = 0; l < h_.size(); ++l) {
    const std::string p = "mlp.layer" + std::to_string(l);
    add(plan, h_[l], p + ".h", DType::kBF16, B * H);
    add(plan, aux_[l], p + ".aux", DType::kBF16, B * H);
    add(plan, dz_[l], p + ".dz", DType::kBF16, B * H);
  }
  add(plan, logits_, "mlp.logits", DType::kBF16, B * K);
  add(plan, dlogits_, "mlp.dlogits", DType::kBF16, B * K);
  add(plan, stats_, "mlp.ce_stats", DType::kFP32, cross_entropy_stats_floats(B));
  add(plan, row_loss_, "mlp.row_loss", DType::kFP32, B);
  add(plan, count_, "mlp.count", DType::kINT32, 1);
  add(plan, eval_loss_, "mlp.eval_loss", DType::kFP32, 1);
  add(plan, eval_sum_, "mlp.eval_sum", DType::kFP32, 1);
  add(plan, gemm_ws_, "mlp.gemm_workspace", DType::kUINT8,
      static_cast<int64_t>(gemms_.max_workspace_bytes()));
}

void MlpModel::bind(const Arena& arena) {
  params_.bind(arena);
  for (const Buffer& b : buffers_) *b.view = arena.view(b.id, b.dtype, {b.elements});
}

void MlpModel::initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) {
  io_ = io;
  params_.initialize(seed, stream);
}

TensorView MlpModel::weights(train::ParamId first, train::ParamId last) const {
  return params_.weight_range(first, last);
}
TensorView MlpModel::grads(train::ParamId first, train::ParamId last) const {
  return params_.grad_range(first, last);
}

void MlpModel::gemm(GemmPlan* plan, GemmArgs args, cudaStream_t stream) const {
  args.workspace = gemm_ws_.data;
  args.workspace_bytes = gemm_ws_.bytes();
  plan->run(stream, args);
}

void MlpModel::forward(int l, cudaStream_t s) const {
  const Layer& layer = layers_[static_cast<size_t>(l)];
  GemmArgs a;
  a.a = input(l).data, a.b = params_.weight(layer.weight), a.d = h_[static_cast<size_t>(l)].data;
  a.bias = params_.weight(layer.bias), a.aux = aux_[static_cast<size_t>(l)].data;
  gemm(layer.forward, a, s);
}

void MlpModel::head(cudaStream_t s) const {
  const int64_t B = shape_.batch, K = shape_.classes;
  const TensorView& top = h_.back();
  GemmArgs fwd;
  fwd.a = top.data, fwd.b = params_.weight(out_.weight), fwd.d = logits_.data;
  fwd.bias = params_.weight(out_.bias);
  gemm(out_.forward, fwd, s);
  const CrossEntropyShape ce{B, K, 0};
  const auto* logits = static_cast<const __nv_bfloat16*>(logits_.data);
  cross_entropy_forward(static_cast<float*>(stats_.data), static_cast<float*>(row_loss_.data),
                        io_.loss, static_cast<int32_t*>(count_.data), logits,
                        static_cast<const int32_t*>(y_.data), ce, s);
  cross_entropy_backward(static_cast<__nv_bfloat16*>(dlogits_.data), logits,
                         static_cast<const float*>(stats_.data),
                         static_cast<const int32_t*>(y_.data),
                         static_cast<const int32_t*>(count_.data), io_.loss_scale, ce, s);
  GemmArgs wgrad;  // dWo = dlogits^T h_L, dbo its column sums
  wgrad.a = dlogits_.data, wgrad.b = top.data, wgrad.d = params_.grad(out_.weight);
  wgrad.bias_grad = params_.grad(out_.bias);
  gemm(out_.wgrad, wgrad, s);
  GemmArgs dgrad;  // dz_{L-1} = (dlogits Wo) * gelu'(aux_{L-1})
  dgrad.a = dlogits_.data, dgrad.b = params_.weight(out_.weight), dgrad.d = dz_.back().data;
  dgrad.aux = aux_.back().data;
  gemm(out_.dgrad, dgrad, s);
}

void MlpModel::backward(int l, cudaStream_t s) const {
  const Layer& layer = layers_[static_cast<size_t>(l)];
  GemmArgs wgrad;  // dW_l = dz_l^T h_l, db_l the column sums of dz_l
  wgrad.a = dz_[static_cast<size_t>(l)].data, wgrad.b = input(l).data;
  wgrad.d = params_.grad(layer.weight), wgrad.bias_grad = params_.grad(layer.bias);
  gemm(layer.wgrad, wgrad, s);
  if (l == 0) return;
  GemmArgs dgrad;  // dz_{l-1} = (dz_l W_l) * gelu'(aux_{l-1})
  dgrad.a = dz_[static_cast<size_t>(l)].data, dgrad.b = params_.weight(layer.weight);
  dgrad.d = dz_[static_cast<size_t>(l - 1)].data, dgrad.aux = aux_[static_cast<size_t>(l - 1)].data;
  gemm(layer.dgrad, dgrad, s);
}

std::vector<graphs::Region> MlpModel::regions() {
  std::vector<graphs::Region> out;
  const int L = static_cast<int>(shape_.layers);
  for (int l = 0; l < L; ++l) {
    graphs::Region r;
    r.name = "layer" + std::to_string(l) + ".fwd";
    r.kind = graphs::RegionKind::kForwardLayer;
    r.enqueue = [this, l](cudaStream_t s, const graphs::RegionArgs&) { forward(l, s); };
    r.args = [this, l] {
      const Layer& p = layers_[static_cast<size_t>(l)];
      return graphs::RegionArgs()
          .read("x", input(l))
          .read("params", weights(p.weight, p.bias))
          .write("h", h_[static_cast<size_t>(l)])
          .write("aux", aux_[static_cast<size_t>(l)]);
    };
    out.push_back(std::move(r));
  }
  graphs::Region head_region;
  head_region.name = "head";
  head_region.enqueue = [this](cudaStream_t s, const graphs::RegionArgs&) { head(s); };
  head_region.args = [this] {
    return graphs::RegionArgs()
        .read("h", h_.back())
        .read("aux", aux_.back())
        .read("y", y_)
        .read("params", weights(out_.weight, out_.bias))
        .read("loss_scale", TensorView(const_cast<float*>(io_.loss_scale), DType::kFP32, {1}))
        .write("logits", logits_)
        .write("ce_stats", stats_)
        .write("row_loss", row_loss_)
        .write("count", count_)
        .write("loss", TensorView(io_.loss, DType::kFP32, {1}))
        .write("dlogits", dlogits_)
        .write("out.grads", grads(out_.weight, out_.bias))
        .write("dz", dz_.back());
  };
  out.push_back(std::move(head_region));
  for (int l = L - 1; l >= 0; --l) {
    graphs::Region r;
    r.name = "layer" + std::to_string(l) + ".bwd";
    r.kind = graphs::RegionKind::kBackwardLayer;
    r.enqueue = [this, l](cudaStream_t s, const graphs::RegionArgs&) { backward(l, s); };
    r.args = [this, l] {
      const Layer& p = layers_[static_cast<size_t>(l)];
      graphs::RegionArgs a;
      a.read("dz", dz_[static_cast<size_t>(l)])
          .read("x", input(l))
          .write("grads", grads(p.weight, p.bias));
      if (l > 0) {
        a.read("weight", weights(p.weight, p.weight))
            .read("aux_below", aux_[static_cast<size_t>(l - 1)])
            .write("dz_below", dz_[static_cast<size_t>(l - 1)]);
      }
      return a;
    };
    out.push_back(std::move(r));
  }
  return out;
}

void MlpModel::copy_rows(int64_t first_row, cudaStream_t s) {
  const int64_t B = shape_.batch, D = shape_.inputs;
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(x_.data, static_cast<char*>(host_x_) + first_row * D * 2,
                                    static_cast<size_t>(B * D) * 2, cudaMemcpyHostToDevice, s));
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(y_.data, host_y_ + first_row,
                                    static_cast<size_t>(B) * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, s));
}

int MlpModel::load_batch(cudaStream_t stream) {
  copy_rows((next_train_ * stride_ + offset_) % shape_.train_batches * shape_.batch, stream);
  next_train_ += 1;
  return 0;
}

bool MlpModel::shard_data(int rank, int count) {
  stride_ = count;
  offset_ = rank;
  return true;
}

void MlpModel::seek_data(int64_t position) {
  REPLAY_REQUIRE(position >= 0, "MlpModel::seek_data: negative position");
  next_train_ = position;
}

// ---- Evaluation: the held-out loss
// ---------------------------------------------------------------

std::optional<train::EvalInfo> MlpModel::evaluation() const {
  train::EvalInfo e;
  e.metric = "loss";
  e.higher_is_better = false;
  e.samples_per_batch = shape_.batch;
  e.default_samples = shape_.eval_batches * shape_.batch;
  e.available_samples = shape_.eval_batches * shape_.batch;
  return e;
}

void MlpModel::eval_head(cudaStream_t s) const {
  GemmArgs fwd;
  fwd.a = h_.back().data, fwd.b = params_.weight(out_.weight), fwd.d = logits_.data;
  fwd.bias = params_.weight(out_.bias);
  gemm(out_.forward, fwd, s);
  cross_entropy_forward(static_cast<float*>(stats_.data), static_cast<float*>(row_loss_.data),
                        static_cast<float*>(eval_loss_.data), static_cast<int32_t*>(count_.data),
                        static_cast<const __nv_bfloat16*>(logits_.data),
                        static_cast<const int32_t*>(y_.data),
                        CrossEntropyShape{shape_.batch, shape_.classes, 0}, s);
  accumulate(static_cast<float*>(eval_sum_.data), static_cast<const float*>(eval_loss_.data), 1, s);
}

std::vector<graphs::Region> MlpModel::eval_regions() {
  std::vector<graphs::Region> out;
  for (graphs::Region& r : regions()) {
    if (r.kind != graphs::RegionKind::kForwardLayer) continue;
    r.name = "eval." + r.name;
    out.push_back(std::move(r));
  }
  graphs::Region head_region;
  head_region.name = "eval.head";
  head_region.enqueue = [this](cudaStream_t s, const graphs::RegionArgs&) { eval_head(s); };
  head_region.args = [this] {
    return graphs::RegionArgs()
        .read("h", h_.back())
        .read("y", y_)
        .read("params", weights(out_.weight, out_.bias))
        .write("logits", logits_)
        .write("ce_stats", stats_)
        .write("row_loss", row_loss_)
        .write("count", count_)
        .write("eval_loss", eval_loss_)
        .read_write("eval_sum", eval_sum_);
  };
  out.push_back(std::move(head_region));
  return out;
}

void MlpModel::begin_eval(cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaMemsetAsync(eval_sum_.data, 0, eval_sum_.bytes(), stream));
  next_eval_ = 0;
  evaluated_ = 0;
}

void MlpModel::load_eval_batch(cudaStream_t stream) {
  copy_rows((shape_.train_batches + next_eval_) * shape_.batch, stream);
  next_eval_ = (next_eval_ + 1) % shape_.eval_batches;
  evaluated_ += 1;
}

double MlpModel::end_eval(cudaStream_t stream) {
  float sum = 0;
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(&sum, eval_sum_.data, sizeof(sum), cudaMemcpyDeviceToHost, stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  return evaluated_ > 0 ? static_cast<double>(sum) / static_cast<double>(evaluated_) : NAN;
}

double MlpModel::flops_per_step() const {
  return 6.0 * static_cast<double>(params_.total_numel()) * static_cast<double>(shape_.batch);
}

std::string MlpModel::flops_formula() const {
  return "6*N*samples (N: the parameters)";
}

// ---- The workload ------------------------------------------------------------------------------

MlpWorkload::MlpWorkload()
    : info_{"replay-mlp-example", "mlp", "MLP", "tiny", "samples", "smp", "mlp_example"},
      presets_{{"tiny", "2 hidden layers of 128 on 64 inputs, 16 classes, batch 256", 30},
               {"wide", "4 hidden layers of 1024 on 256 inputs, 64 classes, batch 1024", 50}} {}

void MlpWorkload::add_flags(CLI::App& app) {
  app.add_option("--width", width_flag_, "hidden width (0: the preset's)")
      ->check(train::integer_in(0, 65536));
  app.add_option("--depth", depth_flag_, "hidden layers (0: the preset's)")
      ->check(train::integer_in(0, 64));
  app.add_flag("--loss-scaling", loss_scaling_,
               "scale the loss dynamically, as fp16 training does (found-inf skips the step)");
}

void MlpWorkload::resolve(const train::RunFlags& flags) {
  shape_ = MlpShape{};
  if (flags.preset == "wide") {
    shape_.inputs = 256, shape_.hidden = 1024, shape_.layers = 4, shape_.classes = 64;
    shape_.batch = 1024;
  }
  if (width_flag_ > 0) shape_.hidden = width_flag_;
  if (depth_flag_ > 0) shape_.layers = depth_flag_;
  if (shape_.hidden % 8 != 0)
    throw bench::UsageError("--width: must be a multiple of 8, got " +
                            std::to_string(shape_.hidden));
}

nlohmann::ordered_json MlpWorkload::config() const {
  return {{"inputs", shape_.inputs},
          {"hidden", shape_.hidden},
          {"layers", shape_.layers},
          {"classes", shape_.classes},
          {"batch", shape_.batch},
          {"train_batches", shape_.train_batches},
          {"eval_batches", shape_.eval_batches},
          {"loss_scaling", loss_scaling_}};
}

train::TrainingConfig MlpWorkload::training() const {
  train::TrainingConfig t;
  t.adam = AdamWHyper{0.9f, 0.999f, 1e-8f, 0.01f};
  t.schedule.kind = train::LrKind::kWarmupCosine;
  t.schedule.base_lr = 3e-3f;
  t.schedule.min_lr = 3e-4f;
  t.schedule.warmup_steps = 5;
  t.schedule.total_steps = 300;
  t.clip_norm = 1.0f;
  if (loss_scaling_) {
    train::LossScalerConfig s;
    s.init_scale = 1024.0f;
    s.growth_interval = 10;
    t.loss_scaling = s;
  }
  return t;
}

void MlpWorkload::open_data(const train::RunFlags& flags, std::FILE* out) {
  if (!flags.data.empty())
    throw bench::UsageError("--data: the MLP example generates its data; it reads no file");
  std::fprintf(out,
               "# data: synthetic, %" PRId64 " training and %" PRId64
               " held-out samples, labelled by a random linear teacher\n",
               shape_.train_batches * shape_.batch, shape_.eval_batches * shape_.batch);
}

std::unique_ptr<train::Model> MlpWorkload::build(Context& ctx, const train::TrainingConfig&,
                                                 const train::RunFlags& flags, std::FILE*) {
  return std::make_unique<MlpModel>(ctx, shape_, flags.seed);
}

void MlpWorkload::log_config(bench::MlLogger& log, const train::Model&,
                             const train::TrainingConfig& t) const {
  namespace k = bench::mlkey;
  log.event(k::kGlobalBatchSize, shape_.batch);
  log.event(k::kOptName, "adamw");
  log.event(k::kOptBaseLearningRate, static_cast<double>(t.schedule.base_lr));
  log.event(k::kOptLearningRateWarmupSteps, t.schedule.warmup_steps);
  log.event(k::kTrainSamples, shape_.train_batches * shape_.batch);
}

}  // namespace replay::example
