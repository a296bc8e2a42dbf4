// replay-moe on the GPU:
// - MoeKernels: MLA's key/value assembly and its backward (the sum over heads), the expert-index
//   fold, the bf16 cast and the pipeline-stage head against plain CPU loops on the same inputs.
// - MoeModes: the tiny preset trains 12 steps in none, layer, full and layer with Megatron's
//   scopes (attn, moe_router, moe_preprocess: the experts and the dense MLP eager), graph modes
//   with --verify-graphs on step 0, and gives bit-identical losses, bf16 weights and fp32 master
//   weights, with the graph counts each implies. Dropless too.
// - MoeLearning: 100 steps of tiny take the loss at least 0.5 nats down.
// - MoeDrops: at capacity factor 0.5 one step drops exactly sum over experts of
//   max(0, routed - capacity) assignments (the routed counts read back), dropless drops none,
//   and the router bias moved by the balancing rule (+-rate against the load, 0 at the mean).
// - MoeMla: one block's MLA (the model's own kernels: LoRA GEMMs, RMSNorms, RoPE with and without
//   DeepSeek-V3's YaRN, the key/value assembly, cuDNN attention, the output GEMM with the residual)
//   forward and backward against the fp64 reference (moe_reference.h mla_block, finite-difference
//   checked in test_moe_ref).
// - MoeLayer: one MoE block (the norm, the router, the fold, the dispatch, the expert GEMMs, the
//   shared expert, the combine) forward and backward against the fp64 reference (ref::moe_layer,
//   finite-difference checked in test_moe_ref), the selection against the reference's where clear.
// - MoeYarn: tiny with --rope-scaling yarn bit-identical in every mode and scope.
// - MoeWarmup: step 0 (losses, weights, router biases) does not depend on --warmup: the router
//   biases moved by the warm-up steps are restored with the step scalars.
// - MoePipelineStage: the 671b-ep32 layout at reduced sizes (pipeline-stage head, 32 experts
//   folded onto 4 local ones, top-4 in 8 groups) bit-identical in every mode and scope.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/context.h"
#include "tests/support/compare.h"
#include "train/driver.h"
#include "train/trainer.h"
#include "workloads/moe/moe_kernels.h"
#include "workloads/moe/moe_model.h"
#include "workloads/moe/moe_reference.h"
#include "workloads/moe/moe_workload.h"
#include "workloads/moe/yarn.h"

namespace replay::moe {
namespace {

using bf16 = __nv_bfloat16;

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

std::vector<bf16> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> v(n);
  for (bf16& x : v) x = __float2bfloat16_rn(d(gen));
  return v;
}

float f(bf16 x) {
  return __bfloat162float(x);
}

TEST(MoeKernels, MlaAssemblyFoldCastAndStageHeadMatchTheCpu) {
  const MlaDims d{37, 3, 16, 8, 24};
  const int64_t M = d.tokens, H = d.heads, Dn = d.nope, Dr = d.rope, Dv = d.v, QK = d.qk();
  const auto kvb = random_bf16(static_cast<size_t>(M * H * (Dn + Dv)), 1);
  const auto kpe = random_bf16(static_cast<size_t>(M * Dr), 2);
  DeviceBuffer<bf16> dkvb_in(kvb), dkpe_in(kpe), k(static_cast<size_t>(M * H * QK)),
      v(static_cast<size_t>(M * H * Dv));
  mla_assemble_kv(k.p, v.p, dkvb_in.p, dkpe_in.p, d, nullptr);
  const auto kh = k.get(), vh = v.get();
  for (int64_t t = 0; t < M; ++t)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < QK; ++c) {
        const bf16 want = c < Dn ? kvb[static_cast<size_t>((t * H + h) * (Dn + Dv) + c)]
                                 : kpe[static_cast<size_t>(t * Dr + c - Dn)];
        ASSERT_EQ(f(kh[static_cast<size_t>((t * H + h) * QK + c)]), f(want)) << t << " " << h;
      }
      for (int64_t c = 0; c < Dv; ++c)
        ASSERT_EQ(f(vh[static_cast<size_t>((t * H + h) * Dv + c)]),
                  f(kvb[static_cast<size_t>((t * H + h) * (Dn + Dv) + Dn + c)]));
    }
  // Backward: a copy for the no-position keys and values, the sum over heads for the RoPE key.
  const auto dk = random_bf16(static_cast<size_t>(M * H * QK), 3);
  const auto dv = random_bf16(static_cast<size_t>(M * H * Dv), 4);
  DeviceBuffer<bf16> dk_d(dk), dv_d(dv), dkvb(static_cast<size_t>(M * H * (Dn + Dv))),
      dkpe(static_cast<size_t>(M * Dr));
  mla_assemble_kv_backward(dkvb.p, dkpe.p, dk_d.p, dv_d.p, d, nullptr);
  const auto gkvb = dkvb.get(), gkpe = dkpe.get();
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < Dn + Dv; ++c) {
        const bf16 want = c < Dn ? dk[static_cast<size_t>((t * H + h) * QK + c)]
                                 : dv[static_cast<size_t>((t * H + h) * Dv + c - Dn)];
        ASSERT_EQ(f(gkvb[static_cast<size_t>((t * H + h) * (Dn + Dv) + c)]), f(want));
      }
    for (int64_t r = 0; r < Dr; ++r) {
      float sum = 0.0f;  // the kernel's order: heads 0, 1, ... in fp32, one rounding
      for (int64_t h = 0; h < H; ++h) sum += f(dk[static_cast<size_t>((t * H + h) * QK + Dn + r)]);
      ASSERT_EQ(f(gkpe[static_cast<size_t>(t * Dr + r)]), f(__float2bfloat16_rn(sum)));
    }
  }
  // Fold, cast.
  const std::vector<int32_t> global = {0, 7, 8, 255, -1, 31, 9};
  DeviceBuffer<int32_t> g(global), local(global.size());
  moe_fold_indices(local.p, g.p, static_cast<int64_t>(global.size()), 8, nullptr);
  EXPECT_EQ(local.get(), (std::vector<int32_t>{0, 7, 0, 7, -1, 7, 1}));
  const std::vector<float> x = {1.0f, -2.5f, 3.14159f, 1e-20f, 65504.5f};
  DeviceBuffer<float> xd(x);
  DeviceBuffer<bf16> xb(x.size());
  moe_to_bf16(xb.p, xd.p, static_cast<int64_t>(x.size()), nullptr);
  const auto xbh = xb.get();
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(f(xbh[i]), f(__float2bfloat16_rn(x[i])));
  // Stage head: loss = sum y g / n, dy = g * scale / n.
  const int64_t n = 20000;
  const auto y = random_bf16(static_cast<size_t>(n), 5),
             gr = random_bf16(static_cast<size_t>(n), 6);
  DeviceBuffer<bf16> yd(y), gd(gr), dy(static_cast<size_t>(n));
  DeviceBuffer<float> loss(1), parts(static_cast<size_t>(stage_head_partials(n))),
      scale(std::vector<float>{4.0f});
  stage_head_forward(loss.p, parts.p, yd.p, gd.p, n, nullptr);
  stage_head_backward(dy.p, gd.p, scale.p, n, nullptr);
  double want = 0;
  for (int64_t i = 0; i < n; ++i)
    want += static_cast<double>(f(y[static_cast<size_t>(i)])) * f(gr[static_cast<size_t>(i)]);
  want /= static_cast<double>(n);
  EXPECT_NEAR(loss.get()[0], want, 1e-6 + 1e-5 * std::fabs(want));
  const auto dyh = dy.get();
  for (int64_t i = 0; i < n; i += 97)
    EXPECT_EQ(
        f(dyh[static_cast<size_t>(i)]),
        f(__float2bfloat16_rn(f(gr[static_cast<size_t>(i)]) * (4.0f / static_cast<float>(n)))));
}

train::RunFlags resolved(MoeWorkload& w, const std::vector<std::string>& args) {
  const std::optional<train::RunFlags> fl = train::parse(w, args);
  if (!fl) throw std::runtime_error("--help");
  return train::resolve(w, *fl);
}

std::vector<std::string> tiny(std::vector<std::string> extra) {
  std::vector<std::string> a = {"--preset", "tiny",    "--seed", "4242",     "--log-interval",
                                "4",        "--steps", "12",     "--warmup", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

train::RunResult run(const std::vector<std::string>& args) {
  MoeWorkload w;
  const train::RunFlags fl = resolved(w, args);
  train::RunOptions o;
  o.measure_peak = false;
  return train::run(w, fl, stdout, o);
}

void expect_identical(const train::RunResult& a, const train::RunResult& b,
                      const std::string& what) {
  ASSERT_EQ(a.report.losses.size(), b.report.losses.size()) << what;
  EXPECT_TRUE(test::bit_equal(what + " losses", a.report.losses.data(), b.report.losses.data(),
                              a.report.losses.size() * sizeof(float)));
  ASSERT_TRUE(a.report.weights_hash && b.report.weights_hash);
  EXPECT_EQ(*a.report.weights_hash, *b.report.weights_hash) << what << ": bf16 weights differ";
  EXPECT_EQ(a.master_hash, b.master_hash) << what << ": fp32 master weights differ";
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// none, layer, full and the scoped layer mode on `args`: bit-identical; the graph counts.
void expect_modes(const std::vector<std::string>& args) {
  const train::RunResult none = run(with(args, {"--graphs", "none"}));
  const auto& losses = none.report.losses;
  ASSERT_EQ(losses.size(), 12u);
  for (float l : losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_EQ(none.report.graph_count, 0);
  const train::RunResult layer = run(with(args, {"--graphs", "layer", "--verify-graphs"}));
  expect_identical(none, layer, "layer vs none");
  const train::RunResult full = run(with(args, {"--graphs", "full", "--verify-graphs"}));
  expect_identical(none, full, "full vs none");
  EXPECT_EQ(full.report.graph_count, 1);
  const train::RunResult scoped =
      run(with(args, {"--graphs", "layer", "--verify-graphs", "--graph-scope",
                      "attn,moe_router,moe_preprocess"}));
  expect_identical(none, scoped, "scoped layer vs none");
  const train::RunResult experts_too =
      run(with(args, {"--graphs", "layer", "--graph-scope",
                      "attn,mlp,moe_router,moe_preprocess,moe_experts"}));
  expect_identical(none, experts_too, "every scope vs none");
}

TEST(MoeModes, TinyIsBitIdenticalInEveryModeAndScope) {
  expect_modes(tiny({}));
  // Graph counts: forward and backward of 2 blocks; scoped: attn in both blocks, the router and
  // the preprocess of the MoE block, forward and backward (the experts and the MLP eager).
  EXPECT_EQ(run(tiny({"--graphs", "layer"})).report.graph_count, 4);
  EXPECT_EQ(run(tiny({"--graphs", "layer", "--graph-scope", "attn,moe_router,moe_preprocess"}))
                .report.graph_count,
            8);
}

// The tiny preset with its own schedule learns: step 0's loss is near ln 512 (a fresh model), and
// 100 steps in full mode take the mean loss of the last 10 steps at least 0.5 below that of the
// first 10 (which already fall: 5.37 on an H100).
TEST(MoeLearning, TheTinyPresetsLossFalls) {
  const train::RunResult r = run({"--preset", "tiny", "--seed", "4242", "--steps", "100",
                                  "--warmup", "2", "--graphs", "full", "--log-interval", "20"});
  const auto& l = r.report.losses;
  ASSERT_EQ(l.size(), 100u);
  double first = 0, last = 0;
  for (size_t i = 0; i < 10; ++i) first += l[i] / 10.0, last += l[90 + i] / 10.0;
  EXPECT_GT(l[0], 5.5) << "a fresh model predicts about uniformly over 512 ids";
  EXPECT_LT(last, first - 0.5) << "the loss did not fall: " << first << " -> " << last;
  EXPECT_GT(last, std::log(4.0)) << "below the data's floor";
}

TEST(MoeModes, DroplessIsBitIdenticalInEveryMode) {
  expect_modes(tiny({"--dropless"}));
}

// One step of the tiny preset with `extra`, driven by hand so the model can be read back.
struct OneStep {
  std::vector<int32_t> dropped, routed;
  std::vector<float> bias;
  int64_t capacity = 0;
  float loss = 0;
};
OneStep one_step(const std::vector<std::string>& extra) {
  MoeWorkload w;
  const train::RunFlags fl = resolved(
      w, with({"--preset", "tiny", "--seed", "77", "--graphs", "none", "--warmup", "0"}, extra));
  Context ctx;
  w.open_data(fl, stdout);
  const train::TrainingConfig training = train::training_config(w, fl);
  std::unique_ptr<train::Model> model = w.build(ctx, training, fl, stdout);
  train::TrainerOptions o;
  o.mode = graphs::GraphMode::kNone;
  o.warmup = 0;
  o.seed = fl.seed;
  o.measure_peak = false;
  train::Trainer trainer(ctx, *model, training, o);
  trainer.allocate();
  trainer.prepare();
  trainer.step();
  OneStep r;
  r.loss = trainer.read(0).loss;
  const auto& m = dynamic_cast<const MoeModel&>(*model);
  r.dropped = m.dropped();
  r.routed = m.routed_counts(0);
  r.bias = m.router_bias(0);
  r.capacity = m.shape().capacity();
  return r;
}

TEST(MoeDrops, CapacityBelowOneDropsExactlyTheOverflowAndTheBiasMoves) {
  const OneStep s = one_step({"--capacity-factor", "0.5"});
  ASSERT_TRUE(std::isfinite(s.loss));
  EXPECT_EQ(s.capacity, 16);  // ceil(0.5 * 128 tokens * 2 / 8 experts)
  ASSERT_EQ(s.dropped.size(), 1u);
  ASSERT_EQ(s.routed.size(), 8u);
  int64_t total = 0, over = 0;
  for (int32_t c : s.routed) total += c, over += std::max<int64_t>(0, c - s.capacity);
  EXPECT_EQ(total, 128 * 2);
  EXPECT_GT(over, 0) << "half the average load must overflow some expert";
  EXPECT_EQ(s.dropped[0], over);
  // One balancing step from zero: +rate below the mean load, -rate above it, 0 at it.
  for (size_t e = 0; e < 8; ++e) {
    const int64_t diff = total - 8 * static_cast<int64_t>(s.routed[e]);
    const float want = diff > 0 ? 1e-3f : diff < 0 ? -1e-3f : 0.0f;
    EXPECT_EQ(s.bias[e], want) << "expert " << e;
  }
  const OneStep d = one_step({"--dropless"});
  EXPECT_EQ(d.dropped[0], 0);
  EXPECT_EQ(d.capacity, 128);  // every token could pick one expert
}

TEST(MoePipelineStage, FoldedExpertsOnAStageHeadAreBitIdentical) {
  // tiny-ep: 671b-ep32's structure at test size (the stage head, 32 experts folded onto 4).
  const std::vector<std::string> args = {"--preset", "tiny-ep", "--seed",   "9",
                                         "--steps",  "12",      "--warmup", "2"};
  expect_modes(args);
}

// --ep 1: every one of tiny-ep's 32 experts on this GPU (no fold), with twice the micro-batch: the
// one-GPU reference of an EP2 run (tests/scripts/test_expert_parallel.py), bit-identical in every
// mode and scope like the others.
TEST(MoePipelineStage, EveryExpertLocalIsBitIdentical) {
  const std::vector<std::string> args = {"--preset", "tiny-ep", "--seed",        "9",
                                         "--steps",  "12",      "--warmup",      "2",
                                         "--ep",     "1",       "--micro-batch", "4"};
  expect_modes(args);
}

// ---- MLA against the fp64 reference -------------------------------------------------------------

// One dense block of a pipeline-stage shard at the tiny preset's MLA sizes (2 heads, d_qk 128 + 64,
// d_v 128, LoRA ranks 64, hidden 128; 2 sequences of 32), its FFN's down projection zero so that
// the block's output is x + MLA(x) and the head's loss sum(y g) / n gives dL/dy = g / n. Weights
// random (bf16), the model's own input and next-stage gradient; the regions run eagerly in order.
// The reference runs in fp64 on the same bf16 values; the GPU keeps bf16 activations (and cuDNN's
// attention), so each tensor is compared by its relative L2 error.
// The id of block 0's parameter `name` (without its "layer0." prefix); a failure when there is
// none.
train::ParamId layer0_param(const train::ParamStore& ps, const std::string& name) {
  for (train::ParamId id = 0; id < ps.count(); ++id)
    if (ps.spec(id).name == "layer0." + name) return id;
  ADD_FAILURE() << "no parameter layer0." << name;
  return train::ParamId{0};
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

std::vector<double> read_bf16(const void* p, int64_t n) {
  std::vector<bf16> h(static_cast<size_t>(n));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), p, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = f(h[i]);
  return out;
}

std::vector<double> read_f32(const float* p, int64_t n) {
  std::vector<float> h(static_cast<size_t>(n));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), p, h.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return std::vector<double>(h.begin(), h.end());
}

void check_mla_against_reference(const YarnScaling& yarn) {
  MoeShape s;
  s.micro_batch = 2, s.seq = 32, s.hidden = 128, s.vocab = 0, s.head = HeadKind::kPipelineStage;
  s.heads = 2, s.q_lora = 64, s.kv_lora = 64;  // nope 128, rope 64, v 128: the defaults
  s.dense_layers = 1, s.moe_layers = 0, s.dense_ffn = 64;
  s.yarn = yarn;
  Context ctx;
  MoeModel model(ctx, s, 11, {});
  ArenaPlan plan;
  model.plan(plan);
  Arena arena(std::move(plan), ctx.device());
  model.bind(arena);
  DeviceBuffer<float> scalars(std::vector<float>{0.0f, 1.0f});  // loss, loss scale 1
  DeviceBuffer<int64_t> iteration(std::vector<int64_t>{0});
  const train::StepIO io{scalars.p, scalars.p + 1, iteration.p};
  const cudaStream_t stream = ctx.stream();
  model.initialize(11, io, stream);

  ref::MlaRefDims d;
  d.batch = s.micro_batch, d.seq = s.seq, d.hidden = s.hidden, d.heads = s.heads;
  d.q_lora = s.q_lora, d.kv_lora = s.kv_lora, d.nope = s.nope_dim, d.rope = s.rope_dim;
  d.v = s.v_dim, d.eps = s.norm_eps, d.theta = s.rope_theta, d.yarn = yarn;
  ref::MlaRefWeights w = ref::MlaRefWeights::zeros(d);
  const char* names[] = {"attn_norm.weight",   "attn.q_a.weight",  "attn.q_a_norm.weight",
                         "attn.q_b.weight",    "attn.kv_a.weight", "attn.kv_a_norm.weight",
                         "attn.k_rope.weight", "attn.kv_b.weight", "attn.o.weight"};
  train::ParamStore& ps = model.params();
  std::mt19937 gen(2024);
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::vector<std::vector<double>*> ws = w.all();
  std::vector<train::ParamId> ids;
  for (size_t i = 0; i < ws.size(); ++i) {
    const train::ParamId id = layer0_param(ps, names[i]);
    ids.push_back(id);
    std::vector<double>& t = *ws[i];
    ASSERT_EQ(static_cast<int64_t>(t.size()), ps.numel(id)) << names[i];
    const bool norm = ps.spec(id).shape.size() == 1;
    const double in = norm ? 1.0 : static_cast<double>(ps.spec(id).shape.back());
    std::vector<bf16> h(t.size());
    for (size_t k = 0; k < t.size(); ++k) {
      const double v = norm ? 1.0 + 0.1 * normal(gen) : normal(gen) / std::sqrt(in);
      h[k] = __float2bfloat16_rn(static_cast<float>(v));
      t[k] = f(h[k]);
    }
    ASSERT_EQ(cudaMemcpy(ps.weight(id), h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  const train::ParamId down = layer0_param(ps, "mlp.down.weight");
  ASSERT_EQ(cudaMemset(ps.weight(down), 0, static_cast<size_t>(ps.numel(down)) * sizeof(bf16)),
            cudaSuccess);
  const int64_t n = s.tokens() * s.hidden;
  const std::vector<double> x = read_bf16(model.stage_input().data, n);
  const std::vector<double> g = read_bf16(model.stage_gradient().data, n);

  std::vector<double> out;
  for (const graphs::Region& r : model.regions()) {
    r.enqueue(stream, graphs::RegionArgs());
    if (r.name == "head") out = read_bf16(model.output().data, n);
  }
  const std::vector<double> dx = read_bf16(model.residual_gradient().data, n);
  ASSERT_EQ(out.size(), static_cast<size_t>(n)) << "no head region";

  std::vector<double> dout(g.size()), want_out, want_dx;
  for (size_t i = 0; i < g.size(); ++i) dout[i] = g[i] / static_cast<double>(n);
  ref::MlaRefWeights want_dw;
  ref::mla_block(d, w, x, &want_out, &dout, &want_dw, &want_dx);
  // The output is x + o Wo^T with x of order 1 and the attention's share smaller: compare the
  // MLA's own contribution too, so the residual does not hide its error.
  std::vector<double> mla(out.size()), want_mla(out.size());
  for (size_t i = 0; i < out.size(); ++i) mla[i] = out[i] - x[i], want_mla[i] = want_out[i] - x[i];
  const std::string tag = yarn.enabled ? " (YaRN)" : " (plain RoPE)";
  EXPECT_LT(rel_l2(out, want_out), 1e-2) << "output" << tag;
  EXPECT_LT(rel_l2(mla, want_mla), 3e-2) << "output - x" << tag;
  EXPECT_LT(rel_l2(dx, want_dx), 3e-2) << "input gradient" << tag;
  const std::vector<std::vector<double>*> dws = want_dw.all();
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::vector<double> got = read_f32(ps.grad(ids[i]), ps.numel(ids[i]));
    EXPECT_LT(rel_l2(got, *dws[i]), 3e-2) << names[i] << " gradient" << tag;
  }
}

TEST(MoeMla, ForwardAndBackwardMatchTheReference) {
  check_mla_against_reference(YarnScaling{});
}

TEST(MoeMla, WithYarnMatchesTheReference) {
  check_mla_against_reference(YarnScaling::deepseek_v3());
}

// ---- The MoE block against the fp64 reference ---------------------------------------------------

// One MoE block of a pipeline-stage shard (64 tokens, hidden 128; 8 experts top-2 in 4 groups keep
// 2, folded onto 4 local experts with SwiGLU 64; a shared expert of 64; capacity factor 4: 128 rows
// per local expert, nothing dropped) whose attention output projection is zero, so the block is
// x + MoE(rmsnorm(x)); the auxiliary loss off (coefficient 0) so the router's gradient is the
// weights' alone. The model's own kernels (the norm, the fp32 router GEMM and router, the fold,
// the counting sort and gather, the batched expert GEMMs, the shared expert, the combine) forward
// and backward against ref::moe_layer on the same bf16 values. The GPU's selection must be the
// reference's wherever the reference's margin is clear of fp32 rounding; the reference then uses
// the GPU's selection so that a near-tie cannot make the comparison fail.
std::vector<double> rmsnorm_rows(const std::vector<double>& x, const std::vector<double>& g,
                                 int64_t M, int64_t C, double eps, std::vector<double>* r) {
  std::vector<double> y(x.size());
  r->assign(static_cast<size_t>(M), 0.0);
  for (int64_t t = 0; t < M; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c)
      ss += x[static_cast<size_t>(t * C + c)] * x[static_cast<size_t>(t * C + c)];
    const double rr = 1.0 / std::sqrt(ss / static_cast<double>(C) + eps);
    (*r)[static_cast<size_t>(t)] = rr;
    for (int64_t c = 0; c < C; ++c)
      y[static_cast<size_t>(t * C + c)] =
          x[static_cast<size_t>(t * C + c)] * rr * g[static_cast<size_t>(c)];
  }
  return y;
}

TEST(MoeLayer, BlockMatchesTheReference) {
  MoeShape s;
  s.micro_batch = 2, s.seq = 32, s.hidden = 128, s.vocab = 0, s.head = HeadKind::kPipelineStage;
  s.heads = 2, s.q_lora = 64, s.kv_lora = 64;
  s.dense_layers = 0, s.moe_layers = 1;
  s.experts = 8, s.local_experts = 4, s.groups = 4, s.topk_groups = 2, s.topk = 2;
  s.expert_ffn = 64, s.shared_ffn = 64, s.capacity_factor = 4.0, s.aux_coeff = 0.0f;
  Context ctx;
  MoeModel model(ctx, s, 13, {});
  ASSERT_EQ(s.capacity(), 128);
  ArenaPlan plan;
  model.plan(plan);
  Arena arena(std::move(plan), ctx.device());
  model.bind(arena);
  DeviceBuffer<float> scalars(std::vector<float>{0.0f, 1.0f});
  DeviceBuffer<int64_t> iteration(std::vector<int64_t>{0});
  const train::StepIO io{scalars.p, scalars.p + 1, iteration.p};
  const cudaStream_t stream = ctx.stream();
  model.initialize(13, io, stream);

  const int64_t M = s.tokens(), C = s.hidden, F = s.expert_ffn, S = s.shared_ffn;
  const int L = s.local_experts, E = s.experts;
  train::ParamStore& ps = model.params();
  std::mt19937 gen(77);
  std::normal_distribution<double> normal(0.0, 1.0);
  // Host values, rounded to bf16, written to the device; `stddev` 0 writes zeros.
  auto put = [&](void* dst, size_t n, double mean, double stddev) {
    std::vector<bf16> h(n);
    std::vector<double> v(n);
    for (size_t k = 0; k < n; ++k) {
      h[k] = __float2bfloat16_rn(static_cast<float>(mean + stddev * normal(gen)));
      v[k] = f(h[k]);
    }
    EXPECT_EQ(cudaMemcpy(dst, h.data(), n * sizeof(bf16), cudaMemcpyHostToDevice), cudaSuccess);
    return v;
  };
  auto param = [&](const std::string& name, double mean, double stddev) {
    const train::ParamId id = layer0_param(ps, name);
    return put(ps.weight(id), static_cast<size_t>(ps.numel(id)), mean, stddev);
  };
  param("attn.o.weight", 0.0, 0.0);  // the attention adds nothing: x_mid = x
  ref::MoeLayerRefDims d;
  d.tokens = M, d.hidden = C, d.experts = E, d.local_experts = L, d.groups = s.groups;
  d.topk_groups = s.topk_groups, d.topk = s.topk, d.expert_ffn = F, d.shared_ffn = S;
  d.capacity = s.capacity(), d.route_scale = s.route_scale;
  ref::MoeLayerRefWeights w = ref::MoeLayerRefWeights::zeros(d);
  const std::vector<double> g2 = param("ffn_norm.weight", 1.0, 0.1);
  w.router = param("moe.router.weight", 0.0, 1.0 / std::sqrt(static_cast<double>(C)));
  w.w1 = param("moe.experts.gate_up.weight", 0.0, 1.0 / std::sqrt(static_cast<double>(C)));
  w.w2 = param("moe.experts.down.weight", 0.0, 1.0 / std::sqrt(static_cast<double>(F)));
  w.ws1 = param("moe.shared.gate_up.weight", 0.0, 1.0 / std::sqrt(static_cast<double>(C)));
  w.ws2 = param("moe.shared.down.weight", 0.0, 1.0 / std::sqrt(static_cast<double>(S)));
  const int64_t n = M * C;
  const std::vector<double> x = put(model.stage_input().data, static_cast<size_t>(n), 0.0, 1.0);
  const std::vector<double> g = put(model.stage_gradient().data, static_cast<size_t>(n), 0.0, 1.0);

  std::vector<double> out;
  std::vector<int32_t> gpu_idx;
  for (const graphs::Region& r : model.regions()) {
    r.enqueue(stream, graphs::RegionArgs());
    if (r.name == "head") {
      out = read_bf16(model.output().data, n);
      gpu_idx = model.router_indices(0);
    }
  }
  const std::vector<double> dx = read_bf16(model.residual_gradient().data, n);
  ASSERT_EQ(out.size(), static_cast<size_t>(n)) << "no head region";
  EXPECT_EQ(model.dropped()[0], 0);

  // The reference: h2 = rmsnorm(x; g2) in fp64, the MoE part, the norm's backward.
  std::vector<double> r2;
  const std::vector<double> h2 = rmsnorm_rows(x, g2, M, C, s.norm_eps, &r2);
  std::vector<double> dout(g.size());
  for (size_t i = 0; i < g.size(); ++i) dout[i] = g[i] / static_cast<double>(n);
  std::vector<double> want_moe, dh2, margin, unused;
  ref::MoeLayerRefWeights dw;
  int32_t dropped = -1;
  ref::moe_layer(d, w, h2, &unused, nullptr, nullptr, nullptr, nullptr, &margin);
  std::vector<int32_t> ref_idx(gpu_idx.size());
  {
    // router_select's own choice, to compare with the GPU's where the margin is clear.
    std::vector<double> logits(static_cast<size_t>(M * E), 0.0);
    for (int64_t t = 0; t < M; ++t)
      for (int e = 0; e < E; ++e)
        for (int64_t c = 0; c < C; ++c)
          logits[static_cast<size_t>(t * E + e)] +=
              h2[static_cast<size_t>(t * C + c)] * w.router[static_cast<size_t>(e * C + c)];
    ref::router_select(ref_idx.data(), nullptr, logits.data(), w.bias.data(),
                       RouterShape{M, E, s.groups, s.topk_groups, s.topk, s.route_scale});
  }
  int clear = 0, agree = 0;
  for (int64_t t = 0; t < M; ++t) {
    if (margin[static_cast<size_t>(t)] < 1e-2) continue;
    ++clear;
    bool same = true;
    for (int j = 0; j < s.topk; ++j)
      same = same && gpu_idx[static_cast<size_t>(t * s.topk + j)] ==
                         ref_idx[static_cast<size_t>(t * s.topk + j)];
    agree += same ? 1 : 0;
  }
  EXPECT_GT(clear, M / 2) << "too few tokens with a clear routing margin to check the selection";
  EXPECT_EQ(agree, clear) << "the GPU's selection differs where the reference's margin is clear";
  ref::moe_layer(d, w, h2, &want_moe, &dout, &dw, &dh2, &dropped, nullptr, &gpu_idx);
  EXPECT_EQ(dropped, 0);
  // dx = dout (the residual) + the norm's backward of dh2.
  std::vector<double> want_dx(dout), dg2(static_cast<size_t>(C), 0.0);
  for (int64_t t = 0; t < M; ++t) {
    const double rr = r2[static_cast<size_t>(t)];
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      const auto i = static_cast<size_t>(t * C + c);
      dot += g2[static_cast<size_t>(c)] * dh2[i] * x[i];
      dg2[static_cast<size_t>(c)] += dh2[i] * x[i] * rr;
    }
    for (int64_t c = 0; c < C; ++c) {
      const auto i = static_cast<size_t>(t * C + c);
      want_dx[i] += rr * g2[static_cast<size_t>(c)] * dh2[i] -
                    x[i] * rr * rr * rr / static_cast<double>(C) * dot;
    }
  }
  std::vector<double> moe(out.size());
  for (size_t i = 0; i < out.size(); ++i) moe[i] = out[i] - x[i];
  EXPECT_LT(rel_l2(moe, want_moe), 3e-2) << "output - x";
  EXPECT_LT(rel_l2(dx, want_dx), 3e-2) << "input gradient";
  auto grad = [&](const std::string& name) {
    const train::ParamId id = layer0_param(ps, name);
    return read_f32(ps.grad(id), ps.numel(id));
  };
  EXPECT_LT(rel_l2(grad("ffn_norm.weight"), dg2), 3e-2) << "ffn_norm gradient";
  EXPECT_LT(rel_l2(grad("moe.router.weight"), dw.router), 3e-2) << "router gradient";
  EXPECT_LT(rel_l2(grad("moe.experts.gate_up.weight"), dw.w1), 3e-2) << "experts' gate_up gradient";
  EXPECT_LT(rel_l2(grad("moe.experts.down.weight"), dw.w2), 3e-2) << "experts' down gradient";
  EXPECT_LT(rel_l2(grad("moe.shared.gate_up.weight"), dw.ws1), 3e-2) << "shared gate_up gradient";
  EXPECT_LT(rel_l2(grad("moe.shared.down.weight"), dw.ws2), 3e-2) << "shared down gradient";
}

// YaRN changes the table and the softmax scale, nothing about the graphs: every mode and scope
// still gives the same bits, and the losses differ from plain RoPE's.
TEST(MoeYarn, TinyWithYarnIsBitIdenticalInEveryModeAndScope) {
  expect_modes(tiny({"--rope-scaling", "yarn"}));
  const train::RunResult plain = run(tiny({"--graphs", "full", "--rope-scaling", "none"}));
  const train::RunResult yarn = run(tiny({"--graphs", "full", "--rope-scaling", "yarn"}));
  EXPECT_NE(plain.report.losses[0], yarn.report.losses[0]);
}

// Step 0 does not depend on --warmup: the warm-up steps move the router biases (every step's
// balancing update), and the trainer restores them with the step scalars (checkpoint_state
// registered as step-plan state), so eager runs with 0, 1 and 3 warm-up steps and the full graph
// after 3 train the same bits (without the restore, the warm-up's bias moves can change step 0's
// routing).
TEST(MoeWarmup, StepZeroDoesNotDependOnWarmup) {
  const std::vector<std::string> base = {"--preset", "tiny-ep", "--seed", "31", "--steps", "6"};
  const train::RunResult w0 = run(with(base, {"--graphs", "none", "--warmup", "0"}));
  ASSERT_EQ(w0.report.losses.size(), 6u);
  expect_identical(w0, run(with(base, {"--graphs", "none", "--warmup", "1"})), "warmup 1 vs 0");
  expect_identical(w0, run(with(base, {"--graphs", "none", "--warmup", "3"})), "warmup 3 vs 0");
  expect_identical(w0, run(with(base, {"--graphs", "full", "--warmup", "3"})),
                   "full, warmup 3 vs none, warmup 0");
}

}  // namespace
}  // namespace replay::moe
