// Attention on the GPU against the fp64 reference (head dims 64, 128 and 192/128; causal or not;
// MHA, GQA, MQA; separate and fused QKV layouts; bf16 and fp16), bitwise determinism, dropout
// (reproducible, fresh per position, unbiased, same mask in the backward), capture on a caller's
// stream, clear errors, and the plans of the benchmark shapes (engines, workspaces, time).
#include "common/attention.h"

#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/context.h"
#include "common/reference/attention.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using test::DeviceBuffer;
using test::same_bits;

// --- host helpers --------------------------------------------------------------------------------

int64_t q_elems(const AttentionDesc& d) {
  return d.batch * d.seq_q * d.heads_q * d.head_dim_qk;
}
int64_t k_elems(const AttentionDesc& d) {
  return d.batch * d.kv_len() * d.heads_kv * d.head_dim_qk;
}
int64_t v_elems(const AttentionDesc& d) {
  return d.batch * d.kv_len() * d.heads_kv * d.dim_v();
}
int64_t o_elems(const AttentionDesc& d) {
  return d.batch * d.seq_q * d.heads_q * d.dim_v();
}
int64_t stats_elems(const AttentionDesc& d) {
  return d.batch * d.heads_q * d.seq_q;
}

// 16-bit storage (bf16 or fp16) to and from float, as raw bits.
std::vector<uint16_t> to_storage(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = t == DType::kFP16 ? __half_as_ushort(__float2half_rn(x[i]))
                             : __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  return y;
}

std::vector<float> from_storage(const std::vector<uint16_t>& x, DType t) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = t == DType::kFP16 ? __half2float(__ushort_as_half(x[i]))
                             : __bfloat162float(__ushort_as_bfloat16(x[i]));
  return y;
}

// Element offsets of k and v inside the q/k/v buffer: consecutive tensors (kSeparate) or one row.
int64_t k_at(const AttentionDesc& d) {
  return d.layout == AttentionLayout::kFusedQKV ? d.k_offset() : q_elems(d);
}
int64_t v_at(const AttentionDesc& d) {
  return d.layout == AttentionLayout::kFusedQKV ? d.v_offset() : q_elems(d) + k_elems(d);
}
int64_t qkv_elems(const AttentionDesc& d) {
  return d.layout == AttentionLayout::kFusedQKV ? d.batch * d.seq_q * d.fused_row()
                                                : q_elems(d) + k_elems(d) + v_elems(d);
}

// Copies rows of `width` elements between a contiguous tensor and the q/k/v buffer (at `base`,
// `row` elements apart).
void copy_rows(int64_t tokens, int64_t width, int64_t base, int64_t row, std::vector<float>& buffer,
               std::vector<float>& tensor, bool into_buffer) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t x = 0; x < width; ++x) {
      float& b = buffer[base + t * row + x];
      float& c = tensor[t * width + x];
      if (into_buffer)
        b = c;
      else
        c = b;
    }
}

struct Qkv {
  std::vector<float> q, k, v;  // contiguous [B, S, H, D] each
};

std::vector<float> to_layout(const AttentionDesc& d, Qkv t) {
  std::vector<float> buf(qkv_elems(d), 0.0f);
  const int64_t tq = d.batch * d.seq_q, tkv = d.batch * d.kv_len();
  copy_rows(tq, d.heads_q * d.head_dim_qk, 0, d.q_row(), buf, t.q, true);
  copy_rows(tkv, d.heads_kv * d.head_dim_qk, k_at(d), d.k_row(), buf, t.k, true);
  copy_rows(tkv, d.heads_kv * d.dim_v(), v_at(d), d.v_row(), buf, t.v, true);
  return buf;
}

Qkv from_layout(const AttentionDesc& d, std::vector<float> buf) {
  Qkv t{std::vector<float>(q_elems(d)), std::vector<float>(k_elems(d)),
        std::vector<float>(v_elems(d))};
  const int64_t tq = d.batch * d.seq_q, tkv = d.batch * d.kv_len();
  copy_rows(tq, d.heads_q * d.head_dim_qk, 0, d.q_row(), buf, t.q, false);
  copy_rows(tkv, d.heads_kv * d.head_dim_qk, k_at(d), d.k_row(), buf, t.k, false);
  copy_rows(tkv, d.heads_kv * d.dim_v(), v_at(d), d.v_row(), buf, t.v, false);
  return t;
}

// A problem: inputs drawn N(0, 1) and rounded to the storage type, so the reference sees exactly
// the values the GPU sees.
struct Problem {
  Qkv in;
  std::vector<float> d_o;
};

Problem make_problem(const AttentionDesc& d, uint64_t seed) {
  auto draw = [&](int64_t n, uint64_t s) {
    return from_storage(to_storage(test::random_normal(static_cast<size_t>(n), s), d.dtype),
                        d.dtype);
  };
  return {{draw(q_elems(d), seed), draw(k_elems(d), seed + 1), draw(v_elems(d), seed + 2)},
          draw(o_elems(d), seed + 3)};
}

// Device buffers of one problem, in the desc's layout. Outputs start as NaN (DeviceBuffer poisons).
struct Buffers {
  Buffers(const AttentionPlan& plan, const Problem& p)
      : desc(plan.desc()),
        qkv(to_storage(to_layout(desc, p.in), desc.dtype)),
        o(o_elems(desc)),
        d_o(to_storage(p.d_o, desc.dtype)),
        dqkv(qkv_elems(desc)),
        stats(stats_elems(desc)),
        workspace(std::max(plan.forward_workspace_bytes(), plan.backward_workspace_bytes())) {
    // DeviceBuffer poisons on the legacy stream, which does not order against the non-blocking
    // streams the plans run on.
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  }

  AttentionIO io() const {
    return {qkv.get(), qkv.get() + k_at(desc), qkv.get() + v_at(desc), o.get(), stats.get()};
  }
  AttentionGrads grads() const {
    return {d_o.get(), dqkv.get(), dqkv.get() + k_at(desc), dqkv.get() + v_at(desc)};
  }
  std::vector<float> o_host() const { return from_storage(o.download(), desc.dtype); }
  Qkv grads_host() const { return from_layout(desc, from_storage(dqkv.download(), desc.dtype)); }

  AttentionDesc desc;
  DeviceBuffer<uint16_t> qkv, o, d_o, dqkv;
  DeviceBuffer<float> stats;
  DeviceBuffer<uint8_t> workspace;
};

void forward(const Context& ctx, const AttentionPlan& plan, Buffers& b, RngArgs rng = {},
             cudaStream_t stream = nullptr) {
  plan.forward(ctx, stream ? stream : ctx.stream(), b.io(), rng, b.workspace.get(),
               b.workspace.size());
}

void backward(const Context& ctx, const AttentionPlan& plan, Buffers& b, RngArgs rng = {},
              cudaStream_t stream = nullptr) {
  plan.backward(ctx, stream ? stream : ctx.stream(), b.io(), b.grads(), rng, b.workspace.get(),
                b.workspace.size());
}

reference::AttentionShape shape_of(const AttentionDesc& d) {
  return {d.batch,   d.heads_q,  d.heads_kv,
          d.seq_q,   d.kv_len(), d.head_dim_qk,
          d.dim_v(), d.causal,   static_cast<double>(d.softmax_scale())};
}

// The table's atol is a fraction of the tensor's largest |ref| (attention outputs and gradients
// vary in scale with the shape); rtol applies per element.
::testing::AssertionResult close_scaled(const std::string& what, const std::vector<float>& got,
                                        const std::vector<double>& ref, test::Tolerance tol) {
  double largest = 0.0;
  for (double r : ref) largest = std::max(largest, std::fabs(r));
  return test::all_close(what, got, ref, {tol.atol * largest, tol.rtol});
}

std::string dtype_key(DType t) {
  return t == DType::kFP16 ? "fp16" : "bf16";
}

// --- forward and backward against the reference --------------------------------------------------

struct Case {
  const char* name;
  AttentionDesc desc;
};

AttentionDesc make_desc(int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t dqk,
                        int64_t dv, bool causal, AttentionLayout layout,
                        DType dtype = DType::kBF16) {
  AttentionDesc d;
  d.batch = b;
  d.heads_q = hq;
  d.heads_kv = hkv;
  d.seq_q = sq;
  d.seq_kv = skv;
  d.head_dim_qk = dqk;
  d.head_dim_v = dv;
  d.causal = causal;
  d.layout = layout;
  d.dtype = dtype;
  return d;
}

constexpr AttentionLayout kSep = AttentionLayout::kSeparate;
constexpr AttentionLayout kFused = AttentionLayout::kFusedQKV;

class AttentionVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionVsReference, ForwardBackwardDeterministic) {
  Context ctx;
  AttentionCache cache;
  const AttentionDesc& d = GetParam().desc;
  const AttentionPlan& plan = cache.get(ctx, d);
  std::printf("%s\n  forward %s (workspace %zu B), backward %s (workspace %zu B)\n",
              d.describe().c_str(), plan.forward_engine().c_str(), plan.forward_workspace_bytes(),
              plan.backward_engine().c_str(), plan.backward_workspace_bytes());

  const Problem p = make_problem(d, 1000);
  Buffers b(plan, p);
  forward(ctx, plan, b);
  backward(ctx, plan, b);
  const std::vector<float> o = b.o_host(), stats = b.stats.download();
  const Qkv g = b.grads_host();

  const reference::AttentionShape s = shape_of(d);
  const std::vector<double> q = test::to_double(p.in.q), k = test::to_double(p.in.k),
                            v = test::to_double(p.in.v), d_o = test::to_double(p.d_o);
  std::vector<double> o_ref(o_elems(d)), lse_ref(stats_elems(d));
  reference::attention_forward(s, q.data(), k.data(), v.data(), o_ref.data(), lse_ref.data());
  std::vector<double> dq_ref(q_elems(d)), dk_ref(k_elems(d)), dv_ref(v_elems(d));
  reference::attention_backward(s, q.data(), k.data(), v.data(), d_o.data(), dq_ref.data(),
                                dk_ref.data(), dv_ref.data());

  const std::string key = dtype_key(d.dtype);
  EXPECT_TRUE(close_scaled("o", o, o_ref, test::tolerance("attention.fwd." + key)));
  EXPECT_TRUE(test::all_close("stats (log-sum-exp)", stats, lse_ref,
                              test::tolerance("attention.lse.fp32")));
  const test::Tolerance bwd = test::tolerance("attention.bwd." + key);
  EXPECT_TRUE(close_scaled("dq", g.q, dq_ref, bwd));
  EXPECT_TRUE(close_scaled("dk", g.k, dk_ref, bwd));
  EXPECT_TRUE(close_scaled("dv", g.v, dv_ref, bwd));

  // Bit-reproducible: the same calls again give the same bits (deterministic backward: no atomics).
  const std::vector<uint16_t> o_bits = b.o.download(), dqkv_bits = b.dqkv.download();
  forward(ctx, plan, b);
  backward(ctx, plan, b);
  EXPECT_TRUE(same_bits("o, second run", b.o.download(), o_bits));
  EXPECT_TRUE(same_bits("stats, second run", b.stats.download(), stats));
  EXPECT_TRUE(same_bits("dq/dk/dv, second run", b.dqkv.download(), dqkv_bits));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionVsReference,
    ::testing::Values(
        Case{"d64_mha_causal_s256", make_desc(2, 8, 8, 256, 0, 64, 0, true, kSep)},
        Case{"d64_gqa4_s128_fused", make_desc(2, 8, 2, 128, 0, 64, 0, false, kFused)},
        Case{"d128_mqa16_causal_s512_fused", make_desc(2, 16, 1, 512, 0, 128, 0, true, kFused)},
        Case{"d128_mha_s384", make_desc(2, 4, 4, 384, 0, 128, 0, false, kSep)},
        Case{"d128_gqa4_causal_s256_fused", make_desc(2, 8, 2, 256, 0, 128, 0, true, kFused)},
        Case{"d192v128_causal_s256", make_desc(2, 4, 4, 256, 0, 192, 128, true, kSep)},
        Case{"d192v128_gqa4_s128_fused", make_desc(2, 8, 2, 128, 0, 192, 128, false, kFused)},
        Case{"d64_cross_sq192_skv77", make_desc(2, 4, 4, 192, 77, 64, 0, false, kSep)},
        Case{"d128_gqa2_causal_s256_fp16",
             make_desc(2, 4, 2, 256, 0, 128, 0, true, kSep, DType::kFP16)}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// --- dropout -------------------------------------------------------------------------------------

AttentionDesc dropout_desc(float p) {
  AttentionDesc d = make_desc(2, 4, 2, 128, 0, 64, 0, false, kSep);
  d.dropout = p;
  return d;
}

// A device RNG slot; `set` waits for queued work (which may still read the slot), then writes it.
struct Slot {
  DeviceBuffer<PhiloxSlot> buffer{1};
  void set(uint64_t seed, uint64_t offset) {
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
    buffer.upload({PhiloxSlot{seed, offset}});
  }
  RngArgs args(uint64_t op_offset) const { return {buffer.get(), op_offset}; }
};

TEST(AttentionDropout, SameSlotSameBitsDifferentPositionDifferentMask) {
  Context ctx;
  AttentionCache cache;
  const AttentionPlan& plan = cache.get(ctx, dropout_desc(0.2f));
  const Problem p = make_problem(plan.desc(), 2000);
  Buffers b(plan, p);
  Slot slot;

  slot.set(42, 5);
  forward(ctx, plan, b, slot.args(2));
  backward(ctx, plan, b, slot.args(2));
  const std::vector<uint16_t> o1 = b.o.download(), g1 = b.dqkv.download();

  // Same slot state and op_offset: the same mask, bit for bit, forward and backward.
  forward(ctx, plan, b, slot.args(2));
  backward(ctx, plan, b, slot.args(2));
  EXPECT_TRUE(same_bits("o, same slot", b.o.download(), o1));
  EXPECT_TRUE(same_bits("dq/dk/dv, same slot", b.dqkv.download(), g1));

  // The position is slot->offset + op_offset: {3, 4} is the same position as {5, 2}.
  slot.set(42, 3);
  forward(ctx, plan, b, slot.args(4));
  EXPECT_TRUE(same_bits("o, same position", b.o.download(), o1));

  // Next position (the slot advanced one step): a fresh mask changes almost every output.
  auto fraction_changed = [&](const std::vector<uint16_t>& x) {
    size_t changed = 0;
    for (size_t i = 0; i < x.size(); ++i) changed += x[i] != o1[i];
    return static_cast<double>(changed) / static_cast<double>(x.size());
  };
  slot.set(42, 6);
  forward(ctx, plan, b, slot.args(2));
  EXPECT_GT(fraction_changed(b.o.download()), 0.9) << "next position";
  slot.set(43, 5);
  forward(ctx, plan, b, slot.args(2));
  EXPECT_GT(fraction_changed(b.o.download()), 0.9) << "another seed";
}

// E[dropout(P) / (1 - p)] = P, so the mean output over many masks approaches the output without
// dropout: the averaged error is several times smaller than one draw's.
TEST(AttentionDropout, MeanOverMasksApproachesNoDropout) {
  Context ctx;
  AttentionCache cache;
  const AttentionPlan& plan = cache.get(ctx, dropout_desc(0.1f));
  const AttentionPlan& plain = cache.get(ctx, make_desc(2, 4, 2, 128, 0, 64, 0, false, kSep));
  const Problem p = make_problem(plan.desc(), 3000);
  Buffers b(plan, p), c(plain, p);
  forward(ctx, plain, c);
  const std::vector<float> o_plain = c.o_host();
  Slot slot;
  const int draws = 64;
  std::vector<double> mean(o_plain.size(), 0.0);
  double single_error = 0.0;
  for (int i = 0; i < draws; ++i) {
    slot.set(7, static_cast<uint64_t>(i));
    forward(ctx, plan, b, slot.args(0));
    const std::vector<float> o = b.o_host();
    for (size_t j = 0; j < o.size(); ++j) {
      mean[j] += o[j] / draws;
      if (i == 0) single_error += std::fabs(o[j] - o_plain[j]) / o.size();
    }
  }
  double mean_error = 0.0;
  for (size_t j = 0; j < mean.size(); ++j)
    mean_error += std::fabs(mean[j] - o_plain[j]) / mean.size();
  std::printf("dropout 0.1: mean |o - o_plain| one draw %.4g, mean of %d draws %.4g\n",
              single_error, draws, mean_error);
  EXPECT_GT(single_error, 1e-2);              // dropout does something
  EXPECT_LT(mean_error, 0.3 * single_error);  // ~1/sqrt(64) = 0.125 expected
}

// With a fixed mask A (dropout included) the output is linear in v: o = A v, and the backward
// computes dv = A^T d_o. With d_o = o, sum(dv * v) = sum(o * A v) = sum(o * o) exactly, and no
// cancellation blurs it. Under another mask A', sum(dv * v) = sum(o * A' v) falls short of |o|^2 by
// about half of
// |(A - A') v|^2: a clear gap, so the check has power.
TEST(AttentionDropout, BackwardUsesTheForwardMask) {
  Context ctx;
  AttentionCache cache;
  const AttentionPlan& plan = cache.get(ctx, dropout_desc(0.2f));
  const Problem p = make_problem(plan.desc(), 4000);
  Buffers b(plan, p);
  Slot slot;
  auto relative_gap = [&](uint64_t forward_offset, uint64_t backward_offset) {
    slot.set(99, forward_offset);
    forward(ctx, plan, b, slot.args(1));
    const std::vector<uint16_t> o_bits = b.o.download();
    b.d_o.upload(o_bits);
    slot.set(99, backward_offset);
    backward(ctx, plan, b, slot.args(1));
    const std::vector<float> o = from_storage(o_bits, plan.desc().dtype);
    const Qkv g = b.grads_host();
    double oo = 0.0, dvv = 0.0;
    for (float x : o) oo += static_cast<double>(x) * x;
    for (size_t i = 0; i < g.v.size(); ++i) dvv += static_cast<double>(g.v[i]) * p.in.v[i];
    return std::fabs(oo - dvv) / oo;
  };
  const double same = relative_gap(10, 10), other = relative_gap(10, 11);
  std::printf("|o|^2 vs sum(dv*v): relative gap %.3g with the forward's mask, %.3g with another\n",
              same, other);
  EXPECT_LT(same, 5e-3);
  EXPECT_GT(other, 3e-2);
}

// --- streams, capture, errors --------------------------------------------------------------------

// Forward and backward captured on a side stream replay to the same bits as eager calls on the work
// stream: everything runs on the stream passed in, with no allocation or synchronization inside.
TEST(Attention, CapturedOnCallerStreamMatchesEager) {
  Context ctx;
  AttentionCache cache;
  AttentionDesc d = make_desc(1, 8, 2, 256, 0, 128, 0, true, kFused);
  d.dropout = 0.1f;
  const AttentionPlan& plan = cache.get(ctx, d);
  const Problem p = make_problem(d, 5000);
  Buffers eager(plan, p), graphed(plan, p);
  Slot slot;
  slot.set(1234, 77);

  forward(ctx, plan, eager, slot.args(3));
  backward(ctx, plan, eager, slot.args(3));

  cudaStream_t side = ctx.side_stream(0);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(side, cudaStreamCaptureModeGlobal), cudaSuccess);
  forward(ctx, plan, graphed, slot.args(3), side);
  backward(ctx, plan, graphed, slot.args(3), side);
  ASSERT_EQ(cudaStreamEndCapture(side, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, side), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  cudaStream_t bound = nullptr;
  ASSERT_EQ(cudnnGetStream(ctx.cudnn(), &bound), CUDNN_STATUS_SUCCESS);
  EXPECT_EQ(bound, ctx.stream()) << "the cuDNN handle was not pointed back at the work stream";
  EXPECT_TRUE(same_bits("o, graph vs eager", graphed.o.download(), eager.o.download()));
  EXPECT_TRUE(same_bits("stats, graph vs eager", graphed.stats.download(), eager.stats.download()));
  EXPECT_TRUE(same_bits("dqkv, graph vs eager", graphed.dqkv.download(), eager.dqkv.download()));
}

TEST(Attention, UnsupportedConfigurationIsAClearErrorAtPlanTime) {
  Context ctx;
  AttentionCache cache;
  // Head dim 320: a multiple of 8, but beyond what cuDNN's Hopper attention backward supports.
  const AttentionDesc d = make_desc(1, 4, 4, 128, 0, 320, 0, false, kSep);
  try {
    cache.get(ctx, d);
    FAIL() << "no exception for " << d.describe();
  } catch (const Error& e) {
    const std::string what = e.what();
    std::printf("%s\n", what.c_str());
    EXPECT_EQ(e.library(), "cuDNN frontend");
    EXPECT_NE(what.find("Dqk=320"), std::string::npos) << what;
    EXPECT_NE(what.find("failed"), std::string::npos) << what;  // names the stage
  }
  EXPECT_EQ(cache.size(), 0u);

  // Malformed descriptions fail before cuDNN is asked.
  EXPECT_THROW(cache.get(ctx, make_desc(1, 6, 4, 128, 0, 64, 0, false, kSep)), Error);  // GQA ratio
  EXPECT_THROW(cache.get(ctx, make_desc(1, 4, 4, 128, 0, 60, 0, false, kSep)), Error);  // head dim
  EXPECT_THROW(cache.get(ctx, make_desc(1, 4, 4, 128, 64, 64, 0, false, kFused)),
               Error);  // fused Sq!=Skv
}

TEST(Attention, ExecutionChecksWorkspaceAndPointers) {
  Context ctx;
  AttentionCache cache;
  AttentionDesc d = dropout_desc(0.1f);
  const AttentionPlan& plan = cache.get(ctx, d);
  EXPECT_EQ(&cache.get(ctx, d), &plan);  // cached
  EXPECT_GE(cache.max_workspace_bytes(), plan.backward_workspace_bytes());
  const Problem p = make_problem(d, 6000);
  Buffers b(plan, p);
  Slot slot;
  EXPECT_THROW(plan.forward(ctx, ctx.stream(), b.io(), slot.args(0), b.workspace.get(),
                            plan.forward_workspace_bytes() - 1),
               Error);
  AttentionIO misaligned = b.io();
  misaligned.q = static_cast<const uint16_t*>(misaligned.q) + 1;
  EXPECT_THROW(plan.forward(ctx, ctx.stream(), misaligned, slot.args(0), b.workspace.get(),
                            b.workspace.size()),
               Error);
  EXPECT_THROW(forward(ctx, plan, b, RngArgs{}), Error);  // dropout without a slot
}

// --- benchmark shapes ----------------------------------------------------------------------------

// The shapes the suite benchmarks against PyTorch: plans, workspaces and time of forward +
// backward.
TEST(Attention, BenchmarkShapesBuildAndRun) {
  struct Shape {
    const char* name;
    AttentionDesc desc;
  };
  const Shape shapes[] = {
      {"GPT-3 175B TP4", make_desc(1, 24, 24, 2048, 0, 128, 0, true, kFused)},
      {"Llama 3.1 405B TP8", make_desc(1, 16, 1, 8192, 0, 128, 0, true, kFused)},
  };
  Context ctx;
  for (const Shape& s : shapes) {
    AttentionCache cache;
    const AttentionPlan& plan = cache.get(ctx, s.desc);
    const Problem p = make_problem(s.desc, 7000);
    Buffers b(plan, p);
    cudaEvent_t start, stop;
    ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
    auto time_ms = [&](auto&& body, int iterations) {
      for (int i = 0; i < 3; ++i) body();
      cudaEventRecord(start, ctx.stream());
      for (int i = 0; i < iterations; ++i) body();
      cudaEventRecord(stop, ctx.stream());
      cudaEventSynchronize(stop);
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      return ms / iterations;
    };
    const float fwd_ms = time_ms([&] { forward(ctx, plan, b); }, 20);
    const float bwd_ms = time_ms([&] { backward(ctx, plan, b); }, 20);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    // FLOPs: 2 GEMMs forward, 5 backward (2.5x), halved by the causal mask.
    const AttentionDesc& d = s.desc;
    const double fwd_flops =
        4.0 * d.batch * d.heads_q * d.seq_q * d.kv_len() * d.head_dim_qk * (d.causal ? 0.5 : 1.0);
    std::printf(
        "%s: %s\n  forward  %s, workspace %zu B: %.3f ms, %.0f TFLOP/s\n"
        "  backward %s, workspace %zu B: %.3f ms, %.0f TFLOP/s\n",
        s.name, d.describe().c_str(), plan.forward_engine().c_str(), plan.forward_workspace_bytes(),
        fwd_ms, fwd_flops / fwd_ms * 1e-9, plan.backward_engine().c_str(),
        plan.backward_workspace_bytes(), bwd_ms, 2.5 * fwd_flops / bwd_ms * 1e-9);
    for (float x : b.o_host()) ASSERT_TRUE(std::isfinite(x)) << s.name << " o";
    for (float x : b.grads_host().q) ASSERT_TRUE(std::isfinite(x)) << s.name << " dq";
  }
}

}  // namespace
}  // namespace replay
