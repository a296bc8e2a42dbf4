// replay-ops: times the GEMMs and attention of the GPT-3 175B TP4 and Llama 3.1 405B TP8 shards and
// replay's memory-bound kernels, against the bf16 GEMM rate and copy bandwidth measured at
// start-up. The shapes are the workloads' own presets (replay-gpt3 --preset 175b-tp4,
// replay-llama31 --preset 405b-tp8), read from their recipes rather than written again. Names and
// FLOP/byte formulas: reports/SCHEMA.md (scripts/pytorch_baseline.py ops times the same GEMMs and
// attention through PyTorch under the same names, with the shapes the binaries print with
// --print-config).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "common/attention.h"
#include "common/bench/harness.h"
#include "common/bench/peaks.h"
#include "common/bench/timing.h"
#include "common/context.h"
#include "common/gemm.h"
#include "common/kernels/activations.h"
#include "common/kernels/cross_entropy.h"
#include "common/kernels/dropout.h"
#include "common/kernels/embedding.h"
#include "common/kernels/init.h"
#include "common/kernels/norms.h"
#include "common/kernels/rope.h"
#include "common/optim/adamw.h"
#include "common/optim/grad_norm.h"
#include "common/version.h"
#include "workloads/gpt3/gpt3.h"
#include "workloads/llama31/llama31.h"

namespace replay {
namespace {

using nlohmann::json;

// One GPU's shard of a workload preset, named as the op names begin ("gpt3_175b_tp4").
struct Shard {
  struct Linear {
    const char* name;
    int64_t out, in;
  };
  std::string name;
  transformer::TransformerShape shape;
  int64_t tokens() const { return shape.tokens(); }  // micro-batch x sequence
  int64_t hidden() const { return shape.hidden; }
  // The four linear layers of a block, as [out, in] weights.
  std::vector<Linear> linears() const {
    return {{"qkv", shape.qkv_width(), shape.hidden},
            {"proj", shape.hidden, shape.attn_width()},
            {"fc1", shape.fc1_width(), shape.hidden},
            {"fc2", shape.hidden, shape.ffn_shard()}};
  }
};

Shard shard(const transformer::Recipe& recipe, const std::string& preset) {
  for (const transformer::Preset& p : recipe.presets) {
    if (p.info.name != preset) continue;
    std::string name = recipe.info.name + "_" + preset;
    std::replace(name.begin(), name.end(), '-', '_');
    return {name, p.shape};
  }
  throw Error("replay", "invalid argument", recipe.info.tool + " has no preset " + preset);
}

// One timed operation: declares its buffers, then fills its inputs, then runs.
struct OpCase {
  std::string name, kind;
  json shape;
  double flops = 0, bytes = 0;  // per call; 0 = not applicable
  std::function<void(ArenaPlan&, Lifetime)> plan;
  std::function<void(const Context&, const Arena&)> prepare;  // after the arena exists
  std::function<void(cudaStream_t)> run;
  // Memory-bound kernels also run as a stream: `sets` copies of their buffers, the call on set i
  // (run_set) touching only that copy, so that back-to-back calls start with a cold L2.
  int sets = 0;  // 0: not timed as a stream
  std::function<void(cudaStream_t, int)> run_set;
};

// Shared state of a run: library plan caches and the workspaces every case uses.
struct Shared {
  Context& ctx;
  GemmCache gemms;
  AttentionCache attention;
  BufferId gemm_workspace = -1, attention_workspace = -1;
  Shared(Context& c, GemmOptions options) : ctx(c), gemms(c, options) {}
};

void fill(const Context& ctx, const Arena& arena, BufferId id, DType t, uint64_t stream_id,
          float stddev = 1.0f) {
  const int64_t n = static_cast<int64_t>(arena.bytes(id) / dtype_size(t));
  init_normal(TensorView(arena.data(id), t, {n}), 2024, stream_id, 0.0f, stddev, ctx.stream());
}

// How the wgrad GEMMs are timed: as torch's dy.t() @ x (bf16 dW, compared with torch.matmul), or as
// the workloads run them (fp32 dW), with or without the bias gradient (BGRADA epilogue), to measure
// what each costs.
enum class WgradForm { kTorch, kFp32, kFp32BiasGrad };

// The three GEMMs of one linear layer, as SCHEMA.md names them.
void add_gemm_cases(std::vector<OpCase>& cases, Shared& sh, const Shard& s, WgradForm wgrad_form) {
  for (const auto& lin : s.linears()) {
    LinearGemms g =
        linear_gemms(s.tokens(), lin.in, lin.out, wgrad_form == WgradForm::kFp32BiasGrad, false);
    g.forward.epilogue = Epilogue::kNone;
    if (wgrad_form == WgradForm::kTorch) g.wgrad.d_type = DType::kBF16;
    const std::pair<const char*, GemmDesc> forms[] = {
        {"fwd", g.forward}, {"dgrad", g.dgrad}, {"wgrad", g.wgrad}};
    for (const auto& [dir, desc] : forms) {
      auto ids = std::make_shared<std::array<BufferId, 4>>();
      GemmPlan* plan = &sh.gemms.get(desc);
      OpCase c;
      c.name = s.name + "." + lin.name + "." + dir;
      c.kind = "gemm";
      c.shape = {{"m", desc.m}, {"n", desc.n}, {"k", desc.k}};
      c.flops = 2.0 * desc.m * desc.n * desc.k;
      const bool bias_grad = desc.epilogue == Epilogue::kBGradA;
      c.plan = [=](ArenaPlan& p, Lifetime life) {
        (*ids)[0] = p.add(c.name + ".a", DType::kBF16, desc.m * desc.k, "ops", life);
        (*ids)[1] = p.add(c.name + ".b", DType::kBF16, desc.n * desc.k, "ops", life);
        (*ids)[2] = p.add(c.name + ".d", desc.d_type, desc.m * desc.n, "ops", life);
        (*ids)[3] =
            bias_grad ? p.add(c.name + ".bias_grad", DType::kFP32, desc.m, "ops", life) : -1;
      };
      auto args = std::make_shared<GemmArgs>();
      const std::string c_name = c.name;
      c.prepare = [=, &sh](const Context& ctx, const Arena& a) {
        fill(ctx, a, (*ids)[0], DType::kBF16, 1);
        fill(ctx, a, (*ids)[1], DType::kBF16, 2);
        args->a = a.data((*ids)[0]);
        args->b = a.data((*ids)[1]);
        args->d = a.data((*ids)[2]);
        if (bias_grad) args->bias_grad = a.as<float>((*ids)[3]);
        args->workspace = a.data(sh.gemm_workspace);
        args->workspace_bytes = a.bytes(sh.gemm_workspace);
        const bool tune = sh.gemms.options().selection == GemmAlgoSelection::kAutotune;
        if (tune) plan->autotune(ctx.stream(), *args);
        std::printf("# %s %s: %s\n", tune ? "autotuned" : "heuristic", c_name.c_str(),
                    plan->algo_info().to_string().c_str());
      };
      c.run = [=](cudaStream_t st) { plan->run(st, *args); };
      cases.push_back(std::move(c));
    }
  }
}

// Attention forward alone, and forward then backward, on the layout the QKV GEMM produces: q, k and
// v are views into one token-major buffer [B, S, (Hq + 2 Hkv) D] (kFusedQKV), and the backward
// writes one fused dQKV buffer.
void add_attention_cases(std::vector<OpCase>& cases, Shared& sh, const Shard& s,
                         bool deterministic) {
  AttentionDesc d;
  d.batch = 1;
  d.heads_q = s.shape.heads_shard();
  d.heads_kv = s.shape.kv_heads_shard();
  d.seq_q = s.tokens();
  d.head_dim_qk = s.shape.head_dim;
  d.causal = true;
  d.layout = AttentionLayout::kFusedQKV;
  d.deterministic = deterministic;
  const AttentionPlan* plan = &sh.attention.get(sh.ctx, d);
  const double fwd_flops =
      4.0 * d.batch * d.heads_q * double(d.seq_q) * d.seq_q * d.head_dim_qk / 2;
  for (bool backward : {false, true}) {
    auto ids = std::make_shared<std::array<BufferId, 5>>();
    OpCase c;
    c.name = s.name + ".attention." + (backward ? "fwd_bwd" : "fwd");
    c.kind = "attention";
    c.shape = {{"batch", d.batch},
               {"q_heads", d.heads_q},
               {"kv_heads", d.heads_kv},
               {"seq", d.seq_q},
               {"head_dim", d.head_dim_qk}};
    c.flops = backward ? 3.5 * fwd_flops : fwd_flops;
    const int64_t qkv = d.batch * d.seq_q * d.fused_row();
    const int64_t o = d.batch * d.seq_q * d.heads_q * d.dim_v();
    c.plan = [=](ArenaPlan& p, Lifetime life) {
      const char* names[5] = {"qkv", "o", "stats", "do", "dqkv"};
      const int64_t sizes[5] = {qkv, o, d.batch * d.heads_q * d.seq_q, o, qkv};
      for (int i = 0; i < 5; ++i)
        (*ids)[i] = p.add(c.name + "." + names[i], i == 2 ? DType::kFP32 : DType::kBF16, sizes[i],
                          "ops", life);
    };
    auto io = std::make_shared<AttentionIO>();
    auto grads = std::make_shared<AttentionGrads>();
    auto ws = std::make_shared<std::pair<void*, size_t>>();
    c.prepare = [=, &sh](const Context& ctx, const Arena& a) {
      fill(ctx, a, (*ids)[0], DType::kBF16, 10);
      fill(ctx, a, (*ids)[3], DType::kBF16, 13);
      const auto* q = a.as<__nv_bfloat16>((*ids)[0]);
      auto* dq = a.as<__nv_bfloat16>((*ids)[4]);
      *io = AttentionIO{q, q + d.k_offset(), q + d.v_offset(), a.data((*ids)[1]),
                        a.as<float>((*ids)[2])};
      *grads = AttentionGrads{a.data((*ids)[3]), dq, dq + d.k_offset(), dq + d.v_offset()};
      *ws = {a.data(sh.attention_workspace), a.bytes(sh.attention_workspace)};
    };
    const Context* ctx = &sh.ctx;
    c.run = [=](cudaStream_t st) {
      plan->forward(*ctx, st, *io, RngArgs{}, ws->first, ws->second);
      if (backward) plan->backward(*ctx, st, *io, *grads, RngArgs{}, ws->first, ws->second);
    };
    cases.push_back(std::move(c));
  }
}

// A memory-bound kernel case: `buffers` are (name, dtype, elements); `inputs` the indices filled
// with random values; `setup` (optional) runs once per buffer set after that, before timing. A case
// that moves less than 2x the L2 size per call gets enough buffer sets that each is touched again
// only after 2x the L2 size of other traffic (at most 8); a larger one evicts its own start and
// gets one set.
using KernelBody = std::function<void(const Arena&, const std::vector<BufferId>&, cudaStream_t)>;
OpCase kernel_case(double l2_bytes, std::string name, json shape, double bytes,
                   std::vector<std::tuple<std::string, DType, int64_t>> buffers,
                   std::vector<int> inputs, KernelBody body, KernelBody setup = nullptr) {
  auto ids = std::make_shared<std::vector<std::vector<BufferId>>>();
  OpCase c;
  c.name = std::move(name);
  c.kind = "kernel";
  c.shape = std::move(shape);
  c.bytes = bytes;
  c.sets = bytes >= 2 * l2_bytes
               ? 1
               : 1 + static_cast<int>(std::min(7.0, std::ceil(2 * l2_bytes / bytes)));
  const int sets = c.sets;
  c.plan = [=](ArenaPlan& p, Lifetime life) {
    ids->assign(static_cast<size_t>(sets), {});
    for (int k = 0; k < sets; ++k) {
      const std::string prefix = c.name + (k == 0 ? "" : ".set" + std::to_string(k)) + ".";
      for (const auto& [n, t, count] : buffers)
        (*ids)[k].push_back(p.add(prefix + n, t, count, "ops", life));
    }
  };
  auto arena = std::make_shared<const Arena*>();
  c.prepare = [=](const Context& ctx, const Arena& a) {
    *arena = &a;
    for (int k = 0; k < sets; ++k) {
      for (int i : inputs)
        fill(ctx, a, (*ids)[k][i], std::get<1>(buffers[i]), 100 + 16 * k + i, 0.5f);
      if (setup) setup(a, (*ids)[k], ctx.stream());
    }
  };
  c.run = [=](cudaStream_t st) { body(**arena, (*ids)[0], st); };
  c.run_set = [=](cudaStream_t st, int k) { body(**arena, (*ids)[k], st); };
  return c;
}

constexpr int kStreamCalls = 24;  // at least this many calls per stream graph

// Stream protocol: one CUDA graph of `calls` back-to-back calls cycling through the case's buffer
// sets, replayed `replays` times with events around each replay; per-call time = replay / calls.
// This is how the kernels run inside a training step (one after another in a graph, inputs mostly
// not in L2), with no event or launch latency inside the measured span, like the copy peak it is
// compared to.
bench::Stats time_stream(cudaStream_t stream, const OpCase& c, int calls, int replays) {
  cudaGraph_t graph = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) c.run_set(stream, i % c.sets);
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> ms = bench::time_repeats(
      stream, 2, replays, [&](cudaStream_t s) { REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
  REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
  for (double& t : ms) t /= calls;
  return bench::summarize(std::move(ms));
}

// Writes host values into a device buffer at set-up.
template <typename T>
void upload(void* dst, const std::vector<T>& v, cudaStream_t s) {
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
}

template <typename T>
void upload(void* dst, std::initializer_list<T> values, cudaStream_t s) {
  upload(dst, std::vector<T>(values), s);
}

// Valid token ids for a cross-entropy case's rows, spread over the shard (every row counts).
void upload_targets(int32_t* dst, int64_t rows, int64_t vocab, cudaStream_t s) {
  std::vector<int32_t> v(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    v[static_cast<size_t>(r)] = static_cast<int32_t>(r * 7919 % vocab);
  upload(dst, v, s);
}

template <typename T>
T* ptr(const Arena& a, const std::vector<BufferId>& ids, int i) {
  return a.as<T>(ids[i]);
}
using bf16 = __nv_bfloat16;

// GPT-3's kernels on `gpt3`, Llama's on `llama` (the names say which shard; the shapes come from
// it).
void add_kernel_cases(std::vector<OpCase>& cases, const Context& ctx, const Shard& gpt3,
                      const Shard& llama) {
  const double l2 = ctx.props().l2CacheSize;
  const int64_t M = gpt3.tokens(), C = gpt3.hidden();  // 2048 x 12288
  const float gpt3_eps = gpt3.shape.norm_eps;
  const double mc = double(M) * C;
  cases.push_back(kernel_case(
      l2, "gpt3_175b_tp4.layernorm.fwd", {{"rows", M}, {"channels", C}}, 4 * mc + 4 * C + 8 * M,
      {{"x", DType::kBF16, M * C},
       {"gamma", DType::kBF16, C},
       {"beta", DType::kBF16, C},
       {"out", DType::kBF16, M * C},
       {"mean", DType::kFP32, M},
       {"rstd", DType::kFP32, M}},
      {0, 1, 2}, [=](const Arena& a, const auto& id, cudaStream_t s) {
        layernorm_forward(ptr<bf16>(a, id, 3), ptr<float>(a, id, 4), ptr<float>(a, id, 5),
                          ptr<bf16>(a, id, 0), ptr<bf16>(a, id, 1), ptr<bf16>(a, id, 2), M, C,
                          gpt3_eps, s);
      }));
  const size_t ln_ws = layernorm_backward_workspace_bytes(M, C);
  cases.push_back(kernel_case(l2, "gpt3_175b_tp4.layernorm.bwd", {{"rows", M}, {"channels", C}},
                              6 * mc + 2 * C + 8 * M + 8 * C,
                              {{"dout", DType::kBF16, M * C},
                               {"x", DType::kBF16, M * C},
                               {"gamma", DType::kBF16, C},
                               {"mean", DType::kFP32, M},
                               {"rstd", DType::kFP32, M},
                               {"dx", DType::kBF16, M * C},
                               {"dgamma", DType::kFP32, C},
                               {"dbeta", DType::kFP32, C},
                               {"ws", DType::kUINT8, int64_t(ln_ws)}},
                              {0, 1, 2, 3, 4}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                layernorm_backward(ptr<bf16>(a, id, 5), ptr<float>(a, id, 6),
                                                   ptr<float>(a, id, 7), ptr<bf16>(a, id, 0),
                                                   ptr<bf16>(a, id, 1), ptr<bf16>(a, id, 2),
                                                   ptr<float>(a, id, 3), ptr<float>(a, id, 4), M, C,
                                                   false, false, a.data(id[8]), ln_ws, s);
                              }));
  cases.push_back(kernel_case(l2, "gpt3_175b_tp4.dropout_residual.fwd",
                              {{"rows", M}, {"channels", C}, {"p", 0.1}}, 6 * mc + 2 * C,
                              {{"x", DType::kBF16, M * C},
                               {"bias", DType::kBF16, C},
                               {"residual", DType::kBF16, M * C},
                               {"out", DType::kBF16, M * C},
                               {"slot", DType::kINT64, 2}},
                              {0, 1, 2}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                dropout_residual_forward(ptr<bf16>(a, id, 3), ptr<bf16>(a, id, 0),
                                                         ptr<bf16>(a, id, 1), ptr<bf16>(a, id, 2),
                                                         M, C, 0.1f,
                                                         RngArgs{a.as<PhiloxSlot>(id[4]), 0}, s);
                              }));
  const size_t dr_ws = dropout_residual_backward_workspace_bytes(M, C);
  cases.push_back(kernel_case(l2, "gpt3_175b_tp4.dropout_residual.bwd",
                              {{"rows", M}, {"channels", C}, {"p", 0.1}}, 4 * mc + 4 * C,
                              {{"dout", DType::kBF16, M * C},
                               {"dx", DType::kBF16, M * C},
                               {"dbias", DType::kFP32, C},
                               {"slot", DType::kINT64, 2},
                               {"ws", DType::kUINT8, int64_t(dr_ws)}},
                              {0}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                dropout_residual_backward(ptr<bf16>(a, id, 1), ptr<float>(a, id, 2),
                                                          ptr<bf16>(a, id, 0), M, C, 0.1f,
                                                          RngArgs{a.as<PhiloxSlot>(id[3]), 0},
                                                          false, a.data(id[4]), dr_ws, s);
                              }));
  const int64_t V = gpt3.shape.vocab_shard();  // GPT-3's padded vocabulary, one TP4 shard
  cases.push_back(kernel_case(
      l2, "gpt3_175b_tp4.cross_entropy.fwd", {{"rows", M}, {"vocab_shard", V}}, 2.0 * M * V + 4 * M,
      {{"logits", DType::kBF16, M * V},
       {"targets", DType::kINT32, M},
       {"stats", DType::kFP32, 3 * M},
       {"row_loss", DType::kFP32, M},
       {"loss", DType::kFP32, 1},
       {"count", DType::kINT32, 1}},
      {0},
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        cross_entropy_forward(ptr<float>(a, id, 2), ptr<float>(a, id, 3), ptr<float>(a, id, 4),
                              ptr<int32_t>(a, id, 5), ptr<bf16>(a, id, 0), ptr<int32_t>(a, id, 1),
                              {M, V, 0}, s);
      },
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        upload_targets(ptr<int32_t>(a, id, 1), M, V, s);
      }));
  cases.push_back(kernel_case(
      l2, "gpt3_175b_tp4.cross_entropy.bwd", {{"rows", M}, {"vocab_shard", V}}, 4.0 * M * V,
      {{"logits", DType::kBF16, M * V},
       {"targets", DType::kINT32, M},
       {"stats", DType::kFP32, 3 * M},
       {"dlogits", DType::kBF16, M * V},
       {"count", DType::kINT32, 1},
       {"dloss", DType::kFP32, 1}},
      {0},
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        cross_entropy_backward(ptr<bf16>(a, id, 3), ptr<bf16>(a, id, 0), ptr<float>(a, id, 2),
                               ptr<int32_t>(a, id, 1), ptr<int32_t>(a, id, 4), ptr<float>(a, id, 5),
                               {M, V, 0}, s);
      },
      [=](const Arena& a, const auto& id,
          cudaStream_t s) {  // the forward's statistics, every row counted
        upload_targets(ptr<int32_t>(a, id, 1), M, V, s);
        cross_entropy_stats(ptr<float>(a, id, 2), ptr<bf16>(a, id, 0), ptr<int32_t>(a, id, 1),
                            {M, V, 0}, s);
        upload(a.data(id[4]), {static_cast<int32_t>(M)}, s);
        upload(a.data(id[5]), {1.0f}, s);
      }));
  cases.push_back(kernel_case(l2, "gpt3_175b_tp4.embedding.fwd",
                              {{"tokens", M}, {"channels", C}, {"vocab_shard", V}}, 6 * mc + 4 * M,
                              {{"tokens", DType::kINT32, M},
                               {"wte", DType::kBF16, V * C},
                               {"wpe", DType::kBF16, M * C},
                               {"out", DType::kBF16, M * C}},
                              {1, 2}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                embedding_forward(ptr<bf16>(a, id, 3), ptr<int32_t>(a, id, 0),
                                                  ptr<bf16>(a, id, 1), ptr<bf16>(a, id, 2),
                                                  {1, M, C, 0, V}, s);
                              }));

  // Llama 3.1 405B TP8: RMSNorm at width 16384, SwiGLU over the fused gate+up output, RoPE on q and
  // k.
  const int64_t L = llama.tokens(), H = llama.hidden(), F = llama.shape.ffn_shard();
  const float llama_eps = llama.shape.norm_eps;
  const double lh = double(L) * H;
  cases.push_back(kernel_case(
      l2, "llama31_405b_tp8.rmsnorm.fwd", {{"rows", L}, {"channels", H}}, 4 * lh + 2 * H + 4 * L,
      {{"x", DType::kBF16, L * H},
       {"gamma", DType::kBF16, H},
       {"out", DType::kBF16, L * H},
       {"rstd", DType::kFP32, L}},
      {0, 1}, [=](const Arena& a, const auto& id, cudaStream_t s) {
        rmsnorm_forward(ptr<bf16>(a, id, 2), ptr<float>(a, id, 3), ptr<bf16>(a, id, 0),
                        ptr<bf16>(a, id, 1), L, H, llama_eps, s);
      }));
  const size_t rms_ws = rmsnorm_backward_workspace_bytes(L, H);
  cases.push_back(kernel_case(l2, "llama31_405b_tp8.rmsnorm.bwd", {{"rows", L}, {"channels", H}},
                              6 * lh + 2 * H + 4 * L + 4 * H,
                              {{"dout", DType::kBF16, L * H},
                               {"x", DType::kBF16, L * H},
                               {"gamma", DType::kBF16, H},
                               {"rstd", DType::kFP32, L},
                               {"dx", DType::kBF16, L * H},
                               {"dgamma", DType::kFP32, H},
                               {"ws", DType::kUINT8, int64_t(rms_ws)}},
                              {0, 1, 2, 3}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                rmsnorm_backward(ptr<bf16>(a, id, 4), ptr<float>(a, id, 5),
                                                 ptr<bf16>(a, id, 0), ptr<bf16>(a, id, 1),
                                                 ptr<bf16>(a, id, 2), ptr<float>(a, id, 3), L, H,
                                                 false, false, a.data(id[6]), rms_ws, s);
                              }));
  const double lf = double(L) * F;
  cases.push_back(kernel_case(l2, "llama31_405b_tp8.swiglu.fwd", {{"rows", L}, {"ffn", F}}, 6 * lf,
                              {{"in", DType::kBF16, 2 * L * F}, {"out", DType::kBF16, L * F}}, {0},
                              [=](const Arena& a, const auto& id, cudaStream_t s) {
                                swiglu_forward(ptr<bf16>(a, id, 1), ptr<bf16>(a, id, 0), L, F, s);
                              }));
  cases.push_back(kernel_case(l2, "llama31_405b_tp8.swiglu.bwd", {{"rows", L}, {"ffn", F}}, 10 * lf,
                              {{"in", DType::kBF16, 2 * L * F},
                               {"dout", DType::kBF16, L * F},
                               {"din", DType::kBF16, 2 * L * F}},
                              {0, 1}, [=](const Arena& a, const auto& id, cudaStream_t s) {
                                swiglu_backward(ptr<bf16>(a, id, 2), ptr<bf16>(a, id, 1),
                                                ptr<bf16>(a, id, 0), L, F, s);
                              }));
  // RoPE in place on the q heads and the k heads of the fused QKV output (16 + 1 of the 18 heads of
  // 128 per token at TP8).
  const int rope_heads = static_cast<int>(llama.shape.heads_shard() + llama.shape.kv_heads_shard());
  const int head_dim = static_cast<int>(llama.shape.head_dim);
  const int64_t qkv_row = llama.shape.qkv_width();
  const double rope_theta = llama.shape.rope_theta;
  const RopeScaling rope_scaling =
      llama.shape.rope_llama31_scaling ? RopeScaling::llama31() : RopeScaling{};
  const double rope_bytes = 2.0 * 2 * L * rope_heads * head_dim;
  cases.push_back(kernel_case(
      l2, "llama31_405b_tp8.rope.fwd",
      {{"tokens", L}, {"heads", rope_heads}, {"head_dim", head_dim}}, rope_bytes,
      {{"qkv", DType::kBF16, L * qkv_row}, {"table", DType::kFP32, L * head_dim}}, {0},
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        RopeLayout layout{1, L, rope_heads, head_dim, head_dim, 0, qkv_row};
        rope_forward(ptr<bf16>(a, id, 0), ptr<bf16>(a, id, 0), a.as<float2>(id[1]), int(L), nullptr,
                     layout, s);
      },
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        rope_build_table(a.as<float2>(id[1]), int(L), head_dim, rope_theta, rope_scaling, s);
      }));

  // AdamW and the gradient norm over one GPT-3 TP4 layer's parameters (about 453M).
  std::vector<int64_t> sizes;
  for (const auto& lin : gpt3.linears()) sizes.insert(sizes.end(), {lin.out * lin.in, lin.out});
  sizes.insert(sizes.end(), {C, C, C, C});
  int64_t total = 0, params = 0;  // total: each tensor padded to 8 elements (16-byte aligned fp32)
  for (int64_t n : sizes) {
    total += (n + 7) / 8 * 8;
    params += n;
  }
  // Both cases move gigabytes per call, so they get one buffer set and one table each.
  auto adam_table = std::make_shared<AdamWTable>();
  auto norm_table = std::make_shared<GradNormTable>();
  // Table sizes for the plan; the tables themselves are built once the arena exists.
  const int64_t adam_table_bytes =
      int64_t(MultiTensorBuilder<AdamWTensor>::device_bytes_for(sizes));
  const int64_t norm_table_bytes =
      int64_t(MultiTensorBuilder<GradNormTensor>::device_bytes_for(sizes));
  // Reads master, grad, m, v (16 bytes a parameter); writes master, m, v (12) and the bf16 copy
  // (2).
  cases.push_back(kernel_case(
      l2, "gpt3_175b_tp4.adamw.step", {{"params", params}, {"tensors", sizes.size()}},
      30.0 * params,
      {{"master", DType::kFP32, total},
       {"model", DType::kBF16, total},
       {"grad", DType::kFP32, total},
       {"m", DType::kFP32, total},
       {"v", DType::kFP32, total},
       {"table", DType::kUINT8, adam_table_bytes},
       {"lr", DType::kFP32, 1},
       {"step", DType::kINT64, 1}},
      {0, 2, 3},
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        adamw_step(*adam_table, AdamWHyper{0.9f, 0.95f, 1e-8f, 0.1f}, ptr<float>(a, id, 6),
                   ptr<int64_t>(a, id, 7), nullptr, nullptr, s);
      },
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        init_constant(a.view(id[4], DType::kFP32, {total}), 1e-4f, s);  // v > 0
        AdamWTableBuilder b;
        int64_t off = 0;
        for (int64_t n : sizes) {
          b.add(ptr<float>(a, id, 0) + off, ptr<bf16>(a, id, 1) + off, ptr<float>(a, id, 2) + off,
                ptr<float>(a, id, 3) + off, ptr<float>(a, id, 4) + off, n, true);
          off += (n + 7) / 8 * 8;  // keep every tensor 16-byte aligned (buffers have slack below)
        }
        *adam_table = b.build(a.data(id[5]), a.bytes(id[5]), s);
        upload<float>(a.data(id[6]), {1e-4f}, s);
        upload<int64_t>(a.data(id[7]), {1}, s);
      }));
  GradNormTable norm_shape;  // the workspace depends on the chunk count only
  norm_shape.num_chunks = int(MultiTensorBuilder<GradNormTensor>::chunk_count(sizes));
  const size_t norm_ws = grad_norm_workspace_bytes(norm_shape);
  cases.push_back(kernel_case(
      l2, "gpt3_175b_tp4.grad_norm", {{"params", params}, {"tensors", sizes.size()}}, 4.0 * params,
      {{"grad", DType::kFP32, total},
       {"table", DType::kUINT8, norm_table_bytes},
       {"ws", DType::kUINT8, int64_t(norm_ws)},
       {"out", DType::kFP32, 4}},
      {0},
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        float* out = ptr<float>(a, id, 3);
        grad_norm(*norm_table, 1.0f, nullptr, out, out + 1, reinterpret_cast<int32_t*>(out + 2),
                  a.data(id[2]), norm_ws, s);
      },
      [=](const Arena& a, const auto& id, cudaStream_t s) {
        GradNormTableBuilder b;
        int64_t off = 0;
        for (int64_t n : sizes) {
          b.add(ptr<float>(a, id, 0) + off, n);
          off += (n + 7) / 8 * 8;
        }
        *norm_table = b.build(a.data(id[1]), a.bytes(id[1]), s);
      }));
}

void print_row(const OpCase& c, const bench::Stats& st, double frac, const bench::Stats* stream) {
  const double rate =
      c.flops > 0 ? c.flops / (st.median * 1e-3) / 1e12 : c.bytes / (st.median * 1e-3) / 1e9;
  std::printf("%-40s %10.3f %10.3f %10.3f %10.1f %-6s %6.1f%%", c.name.c_str(), st.median, st.p10,
              st.p90, rate, c.flops > 0 ? "TF/s" : "GB/s", 100.0 * frac);
  if (stream)
    std::printf("   stream %.4f ms %.1f GB/s", stream->median,
                c.bytes / (stream->median * 1e-3) / 1e9);
  std::printf("\n");
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  CLI::App app{"replay-ops: GEMM, attention and kernel throughput on the MLPerf shard shapes"};
  int warmup = 10, repeats = 50, device = 0;
  std::string json_path, only;
  // Integer ranges, not CLI::PositiveNumber, whose message quotes a range up to the largest double.
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  app.add_option("--warmup", warmup, "untimed calls before timing")->check(CLI::Range(0, kMaxInt));
  app.add_option("--repeats", repeats, "timed calls (median, p10, p90 reported)")
      ->check(CLI::Range(1, kMaxInt));
  app.add_option("--json", json_path, "write the results here (reports/SCHEMA.md)");
  app.add_option("--only", only, "time only the ops whose name matches this regular expression");
  app.add_option("--device", device, "CUDA device ordinal")->check(CLI::Range(0, 1023));
  double lead_ms = 50;
  app.add_option(
         "--lead-ms", lead_ms,
         "idle time before each op's timed calls, so every series starts from the same clocks "
         "(pytorch_baseline.py ops takes the same flag)")
      ->check(CLI::Range(0.0, 10000.0));
  double budget_ms = 20;
  app.add_option("--budget-ms", budget_ms,
                 "device time of each op's timed calls: --repeats calls or as many as fit this "
                 "budget at the "
                 "warm-up's time a call, whichever is fewer, at least 5; 0 for always --repeats. A "
                 "series that "
                 "ends before the clocks drop is timed at one clock level (pytorch_baseline.py ops "
                 "takes the same "
                 "flag)")
      ->check(CLI::Range(0.0, 10000.0));
  bool autotune = false;
  int candidates = 8;
  app.add_option("--gemm-candidates", candidates, "heuristic candidates --gemm-autotune times")
      ->check(CLI::Range(1, 64));
  app.add_flag(
      "--gemm-autotune", autotune,
      "time cuBLASLt's top heuristic candidates at set-up and keep the fastest (the choice, and so "
      "the bits, may then differ between runs)");
  bool nondeterministic = false;
  app.add_flag(
      "--attention-nondeterministic", nondeterministic,
      "time cuDNN's non-deterministic attention backward (PyTorch's default) instead of the "
      "deterministic one the workloads use, to measure what determinism costs");
  WgradForm wgrad_form = WgradForm::kTorch;
  const std::map<std::string, WgradForm> wgrad_forms = {
      {"torch", WgradForm::kTorch},
      {"fp32", WgradForm::kFp32},
      {"fp32-bias-grad", WgradForm::kFp32BiasGrad}};
  app.add_option("--wgrad-form", wgrad_form,
                 "torch: bf16 dW as torch's dy.t() @ x (the form compared with PyTorch); fp32: the "
                 "workloads' fp32 "
                 "dW; fp32-bias-grad: that with the bias gradient from the BGRADA epilogue, as the "
                 "workloads form the "
                 "QKV and fc1 bias gradients")
      ->transform(CLI::CheckedTransformer(wgrad_forms, CLI::ignore_case));
  CLI11_PARSE(app, argc, argv);
  if (budget_ms > 0 && warmup < 2)
    throw bench::UsageError(
        "--budget-ms needs --warmup 2 or more (the calls after the first give the time a "
        "call takes); --budget-ms 0 times --repeats calls");
  std::regex filter(only.empty() ? ".*" : only);

  Context ctx(device);
  const EnvironmentReport env = ctx.environment();
  std::printf("# replay-ops\n%s", env.to_text().c_str());

  GemmOptions gemm_options;
  if (autotune) {
    gemm_options.selection = GemmAlgoSelection::kAutotune;
    gemm_options.autotune_candidates = candidates;
  }
  Shared sh(ctx, gemm_options);
  const Shard gpt3 = shard(gpt3::recipe(), "175b-tp4"),
              llama = shard(llama31::recipe(), "405b-tp8");
  std::vector<OpCase> cases;
  add_gemm_cases(cases, sh, gpt3, wgrad_form);
  add_gemm_cases(cases, sh, llama, wgrad_form);
  add_attention_cases(cases, sh, gpt3, !nondeterministic);
  add_attention_cases(cases, sh, llama, !nondeterministic);
  add_kernel_cases(cases, ctx, gpt3, llama);
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [&](const OpCase& c) { return !std::regex_search(c.name, filter); }),
              cases.end());
  REPLAY_REQUIRE(!cases.empty(), "--only '" + only + "' matches no op");

  // Phase 0 is the peak measurement; case i lives in phase i + 1, so all share memory.
  ArenaPlan plan;
  const bench::PeakBuffers peak_buffers = bench::plan_peak_buffers(plan, true, {0, 0});
  sh.gemm_workspace = plan.add("gemm.workspace",
                               std::max<size_t>(sh.gemms.max_workspace_bytes(), 256), "workspace");
  sh.attention_workspace =
      plan.add("attention.workspace", std::max<size_t>(sh.attention.max_workspace_bytes(), 256),
               "workspace");
  for (size_t i = 0; i < cases.size(); ++i) cases[i].plan(plan, {int(i) + 1, int(i) + 1});
  Arena& arena = ctx.create_arena(std::move(plan));
  std::printf("%s", arena.table().c_str());

  const bench::Peaks peaks = bench::measure_peaks(ctx, arena, peak_buffers, 5, 20, lead_ms);
  std::printf("# peaks: bf16 GEMM %.1f TFLOP/s, device copy %.1f GB/s\n", peaks.bf16_gemm_tflops,
              peaks.copy_gbps);
  std::printf("%-40s %10s %10s %10s %10s %-6s %7s\n", "op", "median ms", "p10 ms", "p90 ms", "rate",
              "", "peak");

  json results = json::array();
  for (OpCase& c : cases) {
    c.prepare(ctx, arena);
    const std::vector<double> samples =
        bench::time_repeats(ctx.stream(), warmup, repeats, c.run, lead_ms, budget_ms);
    const bench::Stats st = bench::summarize(samples);
    const double tflops = c.flops > 0 ? c.flops / (st.median * 1e-3) / 1e12 : 0;
    const double gbps = c.bytes > 0 ? c.bytes / (st.median * 1e-3) / 1e9 : 0;
    const double frac = c.flops > 0 ? tflops / peaks.bf16_gemm_tflops : gbps / peaks.copy_gbps;
    bench::Stats stream;
    const int calls = c.sets > 0 ? c.sets * ((kStreamCalls + c.sets - 1) / c.sets) : 0;
    if (c.sets > 0) stream = time_stream(ctx.stream(), c, calls, std::max(5, repeats / 5));
    print_row(c, st, frac, c.sets > 0 ? &stream : nullptr);
    json r = {{"name", c.name},
              {"kind", c.kind},
              {"shape", c.shape},
              {"dtype", "bf16"},
              {"median_ms", st.median},
              {"p10_ms", st.p10},
              {"p90_ms", st.p90},
              {"flops", c.flops > 0 ? json(c.flops) : json(nullptr)},
              {"bytes", c.bytes > 0 ? json(c.bytes) : json(nullptr)},
              {"tflops", c.flops > 0 ? json(tflops) : json(nullptr)},
              {"gbps", c.bytes > 0 ? json(gbps) : json(nullptr)},
              {"fraction_of_peak", frac},
              {"samples_ms", samples}};
    if (c.sets > 0) {
      r["stream"] = {{"calls", calls},
                     {"buffer_sets", c.sets},
                     {"median_ms", stream.median},
                     {"p10_ms", stream.p10},
                     {"p90_ms", stream.p90},
                     {"gbps", c.bytes / (stream.median * 1e-3) / 1e9}};
    }
    results.push_back(std::move(r));
  }

  if (!json_path.empty()) {
    nlohmann::ordered_json out;
    out["tool"] = "replay-ops";
    out["version"] = version();
    out["environment"] = bench::to_json(env);
    out["protocol"] = {
        {"warmup", warmup},
        {"repeats", repeats},
        {"lead_ms", lead_ms},
        {"budget_ms", budget_ms},
        {"min_repeats", std::min(bench::kMinBudgetRepeats, repeats)},
        {"timer", "cuda events around each repeat"},
        {"stream_timer", "memory-bound kernels: cuda events around each replay of a graph of " +
                             std::to_string(kStreamCalls) +
                             "+ back-to-back calls over rotating buffer sets"},
        {"gemm_algorithm",
         autotune ? "autotuned over cuBLASLt's top candidates" : "cuBLASLt heuristic top-1"},
        {"attention_backward", nondeterministic ? "non-deterministic" : "deterministic"},
        {"wgrad_form", wgrad_form == WgradForm::kTorch  ? "bf16 dW (torch's dy.t() @ x)"
                       : wgrad_form == WgradForm::kFp32 ? "fp32 dW"
                                                        : "fp32 dW, bias gradient (BGRADA)"}};
    out["peaks"] = {{"bf16_gemm_tflops", peaks.bf16_gemm_tflops}, {"copy_gbps", peaks.copy_gbps}};
    out["results"] = results;
    bench::write_json(json_path, out);
    std::printf("# wrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace replay

int main(int argc, char** argv) {
  return replay::bench::run_main("replay-ops", [&] { return replay::run(argc, argv); });
}
