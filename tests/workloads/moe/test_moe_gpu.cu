// The MoE router, balancing and dispatch kernels (workloads/moe) against the fp64 CPU references
// at the tiny preset's sizes and DeepSeek-V3's (4096 tokens, 256 experts in 8 groups, top-4
// groups, top-8, hidden 7168 reduced to 1024 where the reference must run): exact ties, the
// selection where it is not a near tie, weights and gradients, expert counts and the bias update
// (and a skewed input that it evens out), the auxiliary loss and its gradient, the sort's integers
// exactly in both modes (drops, padding, indices out of range), gather/combine and their backward;
// bit-identical reruns; one CUDA graph of router + dispatch + combine + their backward + the bias
// update replayed with new inputs against eager runs; the capacity-padded batched expert GEMM
// against the reference. Timings at DeepSeek-V3 sizes are printed, not asserted.
//
// Tolerances. The router's arithmetic is fp32 against fp64 on the same inputs: a score carries a
// few ulps (expf, one division), a weight a few more (a sum of 8, a division), so weights are
// checked to 1e-6 + 1e-5 relative; router gradients, which subtract two such terms, to 1e-6 +
// 1e-4 relative. The selection is compared only on tokens whose reference margin (the smallest gap
// between two values whose order decides it) exceeds 1e-5, 100x the fp32 error of a biased score;
// near ties may legitimately resolve either way and are counted. The auxiliary loss is a sum of
// fp32 partials: 1e-5 relative; its gradient 1e-4 relative plus 1e-5 of its largest element. bf16
// outputs (combine, its backward's dy, gather backward) are one rounding of an fp32 sum: 1e-3 +
// 8e-3 relative (2^-8 is the bf16 spacing); dweights is an fp32 dot of `hidden` bf16 products:
// 1e-3 + 1e-4 relative. Gather is a copy and the sort's outputs are integers: exact.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/context.h"
#include "common/gemm.h"
#include "common/reference/gemm.h"
#include "tests/support/compare.h"
#include "workloads/moe/dispatch.h"
#include "workloads/moe/expert_gemm.h"
#include "workloads/moe/moe_reference.h"
#include "workloads/moe/router.h"

namespace replay::moe {
namespace {

using bf16 = __nv_bfloat16;
using test::DeviceBuffer;
using test::Tolerance;

constexpr Tolerance kWeightTol{1e-6, 1e-5};
constexpr Tolerance kRouterGradTol{1e-6, 1e-4};
constexpr Tolerance kBf16Tol{1e-3, 8e-3};
constexpr Tolerance kDotTol{1e-3, 1e-4};
constexpr double kNearTie = 1e-5;

std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  void sync() const { REPLAY_CUDA_CHECK(cudaStreamSynchronize(s)); }
};

RouterShape router_shape(int64_t tokens, int E, int G, int topk_groups, int topk,
                         float scale = 2.5f) {
  RouterShape s;
  s.tokens = tokens;
  s.experts = E;
  s.groups = G;
  s.topk_groups = topk_groups;
  s.topk = topk;
  s.route_scale = scale;
  return s;
}

std::string describe(const RouterShape& s) {
  return "T" + std::to_string(s.tokens) + " E" + std::to_string(s.experts) + " G" +
         std::to_string(s.groups) + " top" + std::to_string(s.topk_groups) + " k" +
         std::to_string(s.topk);
}

// Logits N(0, 1.5) with a per-expert offset of up to `skew` (a load imbalance), bias U(-0.05,
// 0.05).
std::vector<float> router_logits(const RouterShape& s, uint64_t seed, float skew = 0.0f) {
  auto x = test::random_normal(s.tokens * s.experts, seed, 0.0f, 1.5f);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int e = 0; e < s.experts; ++e)
      x[t * s.experts + e] += skew * (2.0f * e / std::max(1, s.experts - 1) - 1.0f);
  return x;
}

DispatchShape dispatch_shape(int64_t tokens, int E, int topk, DispatchMode mode,
                             int64_t capacity = 0) {
  DispatchShape s;
  s.tokens = tokens;
  s.experts = E;
  s.topk = topk;
  s.mode = mode;
  s.capacity = capacity;
  return s;
}

std::string describe(const DispatchShape& s) {
  return std::string(s.mode == DispatchMode::kCapacity ? "capacity " : "dropless ") + "T" +
         std::to_string(s.tokens) + " E" + std::to_string(s.experts) + " k" +
         std::to_string(s.topk) +
         (s.mode == DispatchMode::kCapacity ? " C" + std::to_string(s.capacity) : "");
}

// Distinct experts per token drawn with weights 1 + 3 [e < E/8] (weighted sampling without
// replacement), so the first eighth of the experts is over-subscribed and a capacity drops.
std::vector<int32_t> skewed_routes(int64_t tokens, int E, int topk, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int32_t> idx;
  std::vector<std::pair<double, int32_t>> keys(E);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < E; ++e) {
      const double w = e < std::max(1, E / 8) ? 4.0 : 1.0;
      keys[e] = {-std::pow(u(rng), 1.0 / w), e};
    }
    std::partial_sort(keys.begin(), keys.begin() + topk, keys.end());
    for (int j = 0; j < topk; ++j) idx.push_back(keys[j].second);
  }
  return idx;
}

// The dispatch's device outputs and workspace.
struct DeviceDispatch {
  DispatchShape shape;
  DeviceBuffer<int32_t> routed, kept, offsets, slot_row, row_source, dropped;
  DeviceBuffer<unsigned char> workspace;

  explicit DeviceDispatch(const DispatchShape& s)
      : shape(s),
        routed(s.experts),
        kept(s.experts),
        offsets(s.experts + 1),
        slot_row(s.assignments()),
        row_source(s.rows()),
        dropped(1),
        workspace(moe_dispatch_workspace_bytes(s)) {}
  DispatchIndex index() const {
    DispatchIndex d;
    d.routed_counts = routed.get();
    d.expert_counts = kept.get();
    d.expert_offsets = offsets.get();
    d.slot_row = slot_row.get();
    d.row_source = row_source.get();
    d.dropped = dropped.get();
    return d;
  }
  void run(const int32_t* indices, cudaStream_t stream) {
    moe_dispatch_index(index(), indices, shape, workspace.get(), workspace.size(), stream);
  }
  // The same structure as the reference's, from the device.
  ref::Dispatch download() const {
    ref::Dispatch d;
    d.routed_counts = routed.download();
    d.expert_counts = kept.download();
    d.expert_offsets = offsets.download();
    d.slot_row = slot_row.download();
    d.row_source = row_source.download();
    d.dropped = dropped.download()[0];
    return d;
  }
};

template <typename F>
double time_us(cudaStream_t stream, int reps, F&& f) {
  f();  // warm-up
  cudaEvent_t a, b;
  REPLAY_CUDA_CHECK(cudaEventCreate(&a));
  REPLAY_CUDA_CHECK(cudaEventCreate(&b));
  REPLAY_CUDA_CHECK(cudaEventRecord(a, stream));
  for (int r = 0; r < reps; ++r) f();
  REPLAY_CUDA_CHECK(cudaEventRecord(b, stream));
  REPLAY_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.0f;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1e3 * ms / reps;
}

// ---------------------------------------------------------------------------------------------------
// Router.

void check_router(const RouterShape& s, uint64_t seed) {
  SCOPED_TRACE(describe(s));
  Stream stream;
  const auto x = router_logits(s, seed);
  const auto bias = test::random_uniform(s.experts, seed + 1, -0.05f, 0.05f);
  const auto dw = test::random_normal(s.tokens * s.topk, seed + 2);
  DeviceBuffer<float> d_x(x), d_bias(bias), d_dw(dw);
  DeviceBuffer<int32_t> d_idx(s.tokens * s.topk);
  DeviceBuffer<float> d_w(s.tokens * s.topk), d_dx(s.tokens * s.experts);
  router_forward(d_idx.get(), d_w.get(), d_x.get(), d_bias.get(), s, stream.s);
  router_backward(d_dx.get(), d_dw.get(), d_x.get(), d_idx.get(), s, false, stream.s);
  const auto idx = d_idx.download();
  const auto w = d_w.download();
  const auto dx = d_dx.download();

  const auto xd = to_double(x), bd = to_double(bias);
  std::vector<int32_t> ref_idx(idx.size());
  std::vector<double> margin(s.tokens);
  ref::router_select(ref_idx.data(), margin.data(), xd.data(), bd.data(), s);
  int64_t near_ties = 0, differing = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const bool same = std::equal(idx.begin() + t * s.topk, idx.begin() + (t + 1) * s.topk,
                                 ref_idx.begin() + t * s.topk);
    if (margin[t] <= kNearTie) {
      ++near_ties;
      continue;
    }
    if (!same && differing++ < 3)
      ADD_FAILURE() << "token " << t << " (margin " << margin[t] << "): GPU expert "
                    << idx[t * s.topk] << "..., reference " << ref_idx[t * s.topk] << "...";
  }
  EXPECT_EQ(differing, 0);
  EXPECT_LE(near_ties, s.tokens / 20) << "too many near ties for a random case";

  // Weights and gradients from the GPU's own selection (so every token is compared).
  std::vector<double> ref_w(w.size()), ref_dx(dx.size());
  ref::router_weights(ref_w.data(), xd.data(), idx.data(), s);
  ref::router_backward(ref_dx.data(), to_double(dw).data(), xd.data(), idx.data(), s);
  EXPECT_TRUE(test::all_close("router weights", w, ref_w, kWeightTol));
  EXPECT_TRUE(test::all_close("router dlogits", dx, ref_dx, kRouterGradTol));

  // accumulate: added to what dlogits holds, bit for bit the fp32 sum.
  std::vector<float> base(dx.size(), 0.25f);
  d_dx.upload(base);
  router_backward(d_dx.get(), d_dw.get(), d_x.get(), d_idx.get(), s, true, stream.s);
  const auto acc = d_dx.download();
  std::vector<float> want(dx.size());
  for (size_t i = 0; i < dx.size(); ++i) want[i] = 0.25f + dx[i];
  EXPECT_TRUE(test::bit_equal("router dlogits accumulated", acc.data(), want.data(),
                              acc.size() * sizeof(float)));
  std::printf("  router %-24s near ties %lld of %lld tokens\n", describe(s).c_str(),
              static_cast<long long>(near_ties), static_cast<long long>(s.tokens));
}

TEST(MoeRouterGpu, MatchesReference) {
  check_router(router_shape(256, 8, 1, 1, 2), 1);          // tiny, no groups
  check_router(router_shape(256, 8, 2, 1, 2), 2);          // tiny, 2 groups, 1 kept
  check_router(router_shape(512, 64, 4, 2, 6), 3);         // two experts a lane
  check_router(router_shape(300, 320, 8, 3, 10, 1.f), 4);  // 16 experts a lane, partial warps
  check_router(router_shape(4096, 256, 8, 4, 8), 5);       // DeepSeek-V3
}

TEST(MoeRouterGpu, ExactTiesPickTheLowerIndex) {
  Stream stream;
  const RouterShape s = router_shape(3, 256, 8, 4, 8);
  std::vector<float> x(3 * 256, 0.0f);
  // Token 1: experts 200.. higher, so groups 6 and 7 lead; groups 0..5 tie (groups 0 and 1 kept),
  // and the selection is the 8 lowest of the raised experts.
  for (int e = 200; e < 256; ++e) x[256 + e] = 1.0f;
  // Token 2: one raised expert in each of groups 3 and 5, equal: their groups lead by it, the
  // other groups tie (0 and 1 kept), then experts 100 and 170 and the lowest of the rest.
  x[512 + 100] = 2.0f;
  x[512 + 170] = 2.0f;
  DeviceBuffer<float> d_x(x);
  DeviceBuffer<int32_t> d_idx(3 * 8);
  DeviceBuffer<float> d_w(3 * 8);
  router_forward(d_idx.get(), d_w.get(), d_x.get(), nullptr, s, stream.s);
  const auto idx = d_idx.download();
  const std::vector<int32_t> want = {0,   1,   2,   3,   4,   5,   6,   7,    // all equal
                                     200, 201, 202, 203, 204, 205, 206, 207,  // groups 0, 1, 6, 7
                                     100, 170, 0,   1,   2,   3,   4,   5};
  EXPECT_EQ(idx, want);
  std::vector<int32_t> ref_idx(want.size());
  ref::router_select(ref_idx.data(), nullptr, to_double(x).data(), nullptr, s);
  EXPECT_EQ(ref_idx, want);
  const auto w = d_w.download();
  for (int j = 0; j < 8; ++j) EXPECT_FLOAT_EQ(w[j], 2.5f / 8.0f);
}

// ---------------------------------------------------------------------------------------------------
// Balancing.

TEST(MoeBalanceGpu, CountsAndBiasUpdate) {
  Stream stream;
  const RouterShape s = router_shape(4096, 256, 8, 4, 8);
  const auto idx_a = skewed_routes(s.tokens, s.experts, s.topk, 31);
  const auto idx_b = skewed_routes(s.tokens, s.experts, s.topk, 32);
  DeviceBuffer<int32_t> d_a(idx_a), d_b(idx_b), d_load(s.experts);
  const auto bias = test::random_uniform(s.experts, 33, -0.1f, 0.1f);
  DeviceBuffer<float> d_bias(bias);
  moe_count_experts(d_load.get(), d_a.get(), s.tokens, s.topk, s.experts, false, stream.s);
  const auto load_a = d_load.download();
  moe_count_experts(d_load.get(), d_b.get(), s.tokens, s.topk, s.experts, true, stream.s);
  const auto load_ab = d_load.download();
  const auto ref_a = ref::count_experts(idx_a.data(), s.tokens, s.topk, s.experts);
  const auto ref_b = ref::count_experts(idx_b.data(), s.tokens, s.topk, s.experts);
  std::vector<int64_t> ref_ab(s.experts);
  for (int e = 0; e < s.experts; ++e) {
    EXPECT_EQ(load_a[e], ref_a[e]) << "expert " << e;
    ref_ab[e] = ref_a[e] + ref_b[e];
    EXPECT_EQ(load_ab[e], ref_ab[e]) << "expert " << e;
  }
  router_bias_update(d_bias.get(), d_load.get(), s.experts, 1e-3f, true, stream.s);
  const auto got = d_bias.download();
  const int64_t total = std::accumulate(ref_ab.begin(), ref_ab.end(), int64_t{0});
  for (int e = 0; e < s.experts; ++e) {
    const int64_t error = total - s.experts * ref_ab[e];
    const float want = bias[e] + 1e-3f * (error > 0 ? 1.0f : error < 0 ? -1.0f : 0.0f);
    EXPECT_EQ(got[e], want) << "expert " << e;
  }
  for (int32_t v : d_load.download()) EXPECT_EQ(v, 0) << "reset_load";
}

// Skewed logits load the high experts; 400 steps of route, count and update at rate 1e-3 (the
// bias moves 0.4 at most) even the load out.
TEST(MoeBalanceGpu, BiasUpdateEvensASkewedLoad) {
  Stream stream;
  const RouterShape s = router_shape(2048, 16, 1, 1, 2);
  const auto x = router_logits(s, 41, 1.0f);
  DeviceBuffer<float> d_x(x), d_bias(std::vector<float>(s.experts, 0.0f)), d_w(s.tokens * 2);
  DeviceBuffer<int32_t> d_idx(s.tokens * 2), d_load(std::vector<int32_t>(s.experts, 0));
  auto imbalance = [&] {  // max |load - mean| / mean of the current routing
    router_forward(d_idx.get(), d_w.get(), d_x.get(), d_bias.get(), s, stream.s);
    const auto load = ref::count_experts(d_idx.download().data(), s.tokens, s.topk, s.experts);
    const double mean = static_cast<double>(s.tokens * s.topk) / s.experts;
    double worst = 0.0;
    for (int64_t l : load) worst = std::max(worst, std::abs(l - mean) / mean);
    return worst;
  };
  const double before = imbalance();
  for (int step = 0; step < 400; ++step) {
    router_forward(d_idx.get(), d_w.get(), d_x.get(), d_bias.get(), s, stream.s);
    moe_count_experts(d_load.get(), d_idx.get(), s.tokens, s.topk, s.experts, true, stream.s);
    router_bias_update(d_bias.get(), d_load.get(), s.experts, 1e-3f, true, stream.s);
  }
  const double after = imbalance();
  std::printf("  bias update over 400 steps: max load error %.3f -> %.3f of the mean\n", before,
              after);
  EXPECT_GT(before, 0.5);
  EXPECT_LT(after, 0.5 * before);
}

// ---------------------------------------------------------------------------------------------------
// Auxiliary loss.

void check_aux(const RouterShape& rs, int64_t seq_len, uint64_t seed) {
  SCOPED_TRACE(describe(rs) + " seq " + std::to_string(seq_len));
  Stream stream;
  AuxLossShape s;
  s.tokens = rs.tokens;
  s.seq_len = seq_len;
  s.experts = rs.experts;
  s.topk = rs.topk;
  s.coeff = 0.01f;
  const auto x = router_logits(rs, seed, 0.5f);
  DeviceBuffer<float> d_x(x), d_w(rs.tokens * rs.topk), d_loss(1), d_scale(std::vector<float>{2.f});
  DeviceBuffer<float> d_dx(rs.tokens * rs.experts);
  DeviceBuffer<int32_t> d_idx(rs.tokens * rs.topk);
  DeviceBuffer<unsigned char> ws(router_aux_loss_workspace_bytes(s));
  router_forward(d_idx.get(), d_w.get(), d_x.get(), nullptr, rs, stream.s);
  router_aux_loss_forward(d_loss.get(), d_x.get(), d_idx.get(), s, ws.get(), ws.size(), stream.s);
  router_aux_loss_backward(d_dx.get(), d_scale.get(), d_x.get(), s, false, ws.get(), ws.size(),
                           stream.s);
  const float loss = d_loss.download()[0];
  const auto dx = d_dx.download();
  const auto idx = d_idx.download();
  std::vector<double> ref_dx(dx.size());
  const double ref_loss = ref::aux_loss(to_double(x).data(), idx.data(), s, ref_dx.data(), 2.0);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "aux loss";
  double largest = 0.0;
  for (double v : ref_dx) largest = std::max(largest, std::abs(v));
  EXPECT_TRUE(test::all_close("aux dlogits", dx, ref_dx, Tolerance{1e-5 * largest, 1e-4}));
  // accumulate adds onto the router's gradient.
  d_dx.upload(std::vector<float>(dx.size(), 1.0f));
  router_aux_loss_backward(d_dx.get(), d_scale.get(), d_x.get(), s, true, ws.get(), ws.size(),
                           stream.s);
  const auto acc = d_dx.download();
  std::vector<float> want(dx.size());
  for (size_t i = 0; i < dx.size(); ++i) want[i] = 1.0f + dx[i];
  EXPECT_TRUE(test::bit_equal("aux dlogits accumulated", acc.data(), want.data(),
                              acc.size() * sizeof(float)));
  std::printf("  aux loss %-24s seq %lld: %.6f (reference %.6f)\n", describe(rs).c_str(),
              static_cast<long long>(seq_len), loss, ref_loss);
}

TEST(MoeAuxLossGpu, MatchesReference) {
  check_aux(router_shape(256, 8, 1, 1, 2), 64, 51);
  check_aux(router_shape(300, 64, 4, 2, 6), 150, 52);  // a sequence of two parts, one partial
  check_aux(router_shape(4096, 256, 8, 4, 8), 2048, 53);
}

// ---------------------------------------------------------------------------------------------------
// Dispatch.

void expect_same(const ref::Dispatch& got, const ref::Dispatch& want) {
  EXPECT_EQ(got.routed_counts, want.routed_counts);
  EXPECT_EQ(got.expert_counts, want.expert_counts);
  EXPECT_EQ(got.expert_offsets, want.expert_offsets);
  EXPECT_EQ(got.slot_row, want.slot_row);
  EXPECT_EQ(got.row_source, want.row_source);
  EXPECT_EQ(got.dropped, want.dropped);
}

void check_dispatch_index(const DispatchShape& s, uint64_t seed, bool invalid) {
  SCOPED_TRACE(describe(s));
  Stream stream;
  auto idx = skewed_routes(s.tokens, s.experts, s.topk, seed);
  if (invalid) {  // not experts: never counted, always dropped
    idx[3] = -1;
    idx[idx.size() / 2] = s.experts;
  }
  DeviceBuffer<int32_t> d_idx(idx);
  DeviceDispatch d(s);
  d.run(d_idx.get(), stream.s);
  const auto got = d.download();
  const auto want = ref::dispatch_index(idx.data(), s);
  expect_same(got, want);
  std::printf("  dispatch %-34s dropped %d of %lld, largest expert %d rows\n", describe(s).c_str(),
              got.dropped, static_cast<long long>(s.assignments()),
              *std::max_element(got.routed_counts.begin(), got.routed_counts.end()));
}

TEST(MoeDispatchGpu, IndexMatchesReference) {
  check_dispatch_index(dispatch_shape(256, 8, 2, DispatchMode::kDropless), 61, true);
  check_dispatch_index(
      dispatch_shape(256, 8, 2, DispatchMode::kCapacity, moe_capacity(1.0, 256, 2, 8)), 62, true);
  check_dispatch_index(
      dispatch_shape(256, 8, 2, DispatchMode::kCapacity, moe_capacity(0.5, 256, 2, 8)), 63, false);
  check_dispatch_index(dispatch_shape(1000, 8, 2, DispatchMode::kCapacity, 1000), 64, false);
  check_dispatch_index(dispatch_shape(4096, 256, 8, DispatchMode::kDropless), 65, false);
  check_dispatch_index(
      dispatch_shape(4096, 256, 8, DispatchMode::kCapacity, moe_capacity(1.0, 4096, 8, 256)), 66,
      false);
  check_dispatch_index(
      dispatch_shape(4096, 256, 8, DispatchMode::kCapacity, moe_capacity(1.25, 4096, 8, 256)), 67,
      true);
}

// The data movement against the reference on the sort's own (verified) permutation.
void check_dispatch_data(const DispatchShape& s, int64_t H, uint64_t seed) {
  SCOPED_TRACE(describe(s) + " H" + std::to_string(H));
  Stream stream;
  const auto idx = skewed_routes(s.tokens, s.experts, s.topk, seed);
  DeviceBuffer<int32_t> d_idx(idx);
  DeviceDispatch d(s);
  d.run(d_idx.get(), stream.s);
  const auto perm = d.download();

  const auto x = test::round_bf16(test::random_normal(s.tokens * H, seed + 1));
  const auto y = test::round_bf16(test::random_normal(s.rows() * H, seed + 2));
  const auto dout = test::round_bf16(test::random_normal(s.tokens * H, seed + 3));
  const auto w = test::random_uniform(s.assignments(), seed + 4, 0.05f, 0.6f);
  const auto base = test::round_bf16(test::random_normal(s.tokens * H, seed + 5));
  DeviceBuffer<bf16> d_x(test::to_bf16(x)), d_y(test::to_bf16(y)), d_dout(test::to_bf16(dout));
  DeviceBuffer<bf16> d_xs(s.rows() * H), d_out(s.tokens * H), d_dy(s.rows() * H);
  DeviceBuffer<bf16> d_dx(s.tokens * H), d_acc(test::to_bf16(base));
  DeviceBuffer<float> d_w(w), d_dw(s.assignments());
  moe_gather(d_xs.get(), d_x.get(), d.slot_row.get(), d.row_source.get(), s, H, stream.s);
  moe_combine(d_out.get(), d_y.get(), d_w.get(), d.slot_row.get(), s, H, false, stream.s);
  moe_combine(d_acc.get(), d_y.get(), d_w.get(), d.slot_row.get(), s, H, true, stream.s);
  moe_combine_backward(d_dy.get(), d_dw.get(), d_dout.get(), d_y.get(), d_w.get(), d.slot_row.get(),
                       d.row_source.get(), s, H, stream.s);
  moe_gather_backward(d_dx.get(), d_y.get(), d.slot_row.get(), s, H, false, stream.s);

  const auto xd = to_double(x), yd = to_double(y), doutd = to_double(dout), wd = to_double(w);
  std::vector<double> xs(s.rows() * H), out(s.tokens * H), dy(s.rows() * H), dw(s.assignments());
  std::vector<double> dx(s.tokens * H);
  ref::gather(xs.data(), xd.data(), perm, s, H);
  ref::combine(out.data(), yd.data(), wd.data(), perm, s, H);
  ref::combine_backward(dy.data(), dw.data(), doutd.data(), yd.data(), wd.data(), perm, s, H);
  ref::gather_backward(dx.data(), yd.data(), perm, s, H);
  std::vector<double> acc(out);
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += base[i];

  const auto xs_gpu = test::from_bf16(d_xs.download());
  std::vector<float> xs_want(xs.begin(), xs.end());
  EXPECT_TRUE(test::bit_equal("gather", xs_gpu.data(), xs_want.data(), xs_gpu.size() * 4));
  EXPECT_TRUE(test::all_close("combine", test::from_bf16(d_out.download()), out, kBf16Tol));
  EXPECT_TRUE(
      test::all_close("combine accumulate", test::from_bf16(d_acc.download()), acc, kBf16Tol));
  EXPECT_TRUE(
      test::all_close("combine backward dy", test::from_bf16(d_dy.download()), dy, kBf16Tol));
  EXPECT_TRUE(test::all_close("combine backward dweights", d_dw.download(), dw, kDotTol));
  EXPECT_TRUE(test::all_close("gather backward", test::from_bf16(d_dx.download()), dx, kBf16Tol));
}

// Expert parallelism's reordering (moe_ep_permute) against the reference, both directions, with
// counts below, at and past nothing of the capacity: a copy, so bit-exact, and every row past its
// count zero whatever the input holds there.
TEST(MoeDispatchGpu, ExpertParallelPermuteMatchesReference) {
  for (const EpLayout e : {EpLayout{2, 4, 6}, EpLayout{4, 2, 9}, EpLayout{1, 8, 5}}) {
    SCOPED_TRACE("ranks " + std::to_string(e.ranks));
    Stream stream;
    const int64_t H = 64;
    std::vector<int32_t> counts(static_cast<size_t>(e.ranks) * e.local_experts);
    for (size_t i = 0; i < counts.size(); ++i)
      counts[i] = static_cast<int32_t>((i * 7 + 3) % static_cast<size_t>(e.capacity + 1));
    const auto x = test::round_bf16(test::random_normal(e.rows() * H, 81));
    DeviceBuffer<bf16> d_x(test::to_bf16(x)), d_out(e.rows() * H);
    DeviceBuffer<int32_t> d_counts(counts);
    for (const bool to_local : {true, false}) {
      moe_ep_permute(d_out.get(), d_x.get(), d_counts.get(), e, H, to_local, stream.s);
      stream.sync();
      const auto want = ref::ep_permute(to_double(x), counts, e, H, to_local);
      const auto got = test::from_bf16(d_out.download());
      std::vector<float> wantf(want.begin(), want.end());
      EXPECT_TRUE(test::bit_equal(to_local ? "to local" : "to exchange", got.data(), wantf.data(),
                                  got.size() * 4));
    }
  }
}

// Expert parallelism's whole exchange on one GPU, the all-to-all done by block copies: per
// simulated rank the sort over every global expert and the gather into the send buffer, the blocks
// and counts moved as the all-to-all moves them, the reordering into the local experts' layout;
// against the host model of the exchange (ref::ep_exchange: which assignment sits in which row)
// bit for bit, for 2 and 4 ranks at capacity factor 1 (assignments dropped on the sending rank).
// What the MoE model runs per block with --ep, less NCCL.
TEST(MoeDispatchGpu, ExpertParallelExchangeOnOneGpuMatchesTheHostModel) {
  const int E = 32, k = 4;
  const int64_t T = 256, H = 64;
  for (const int N : {2, 4}) {
    SCOPED_TRACE("ranks " + std::to_string(N));
    Stream stream;
    const int L = E / N;
    const int64_t Cs = moe_capacity(1.0, T, k, E);
    const DispatchShape ds = dispatch_shape(T, E, k, DispatchMode::kCapacity, Cs);
    const EpLayout layout{N, L, Cs};
    const size_t block = static_cast<size_t>(L * Cs * H);  // elements per (source, destination)
    std::vector<std::vector<int32_t>> idx;
    std::vector<std::vector<float>> x;
    std::vector<std::unique_ptr<DeviceDispatch>> d;
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> send, recv, local;
    std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> received;
    for (int r = 0; r < N; ++r) {
      idx.push_back(skewed_routes(T, E, k, 90 + r));
      x.push_back(test::round_bf16(test::random_normal(T * H, 95 + r)));
      d.push_back(std::make_unique<DeviceDispatch>(ds));
      send.push_back(std::make_unique<DeviceBuffer<bf16>>(ds.rows() * H));
      recv.push_back(std::make_unique<DeviceBuffer<bf16>>(ds.rows() * H));
      local.push_back(std::make_unique<DeviceBuffer<bf16>>(ds.rows() * H));
      received.push_back(std::make_unique<DeviceBuffer<int32_t>>(static_cast<size_t>(E)));
    }
    std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> d_idx;
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> d_x;
    for (int r = 0; r < N; ++r) {
      d_idx.push_back(std::make_unique<DeviceBuffer<int32_t>>(idx[r]));
      d_x.push_back(std::make_unique<DeviceBuffer<bf16>>(test::to_bf16(x[r])));
      d[r]->run(d_idx[r]->get(), stream.s);
      moe_gather(send[r]->get(), d_x[r]->get(), d[r]->slot_row.get(), d[r]->row_source.get(), ds, H,
                 stream.s);
    }
    // The all-to-all: block dst of rank src's buffers to block src of rank dst's.
    for (int src = 0; src < N; ++src)
      for (int dst = 0; dst < N; ++dst) {
        REPLAY_CUDA_CHECK(cudaMemcpyAsync(recv[dst]->get() + src * block,
                                          send[src]->get() + dst * block, block * sizeof(bf16),
                                          cudaMemcpyDeviceToDevice, stream.s));
        REPLAY_CUDA_CHECK(cudaMemcpyAsync(received[dst]->get() + src * L,
                                          d[src]->kept.get() + dst * L, L * sizeof(int32_t),
                                          cudaMemcpyDeviceToDevice, stream.s));
      }
    for (int r = 0; r < N; ++r)
      moe_ep_permute(local[r]->get(), recv[r]->get(), received[r]->get(), layout, H, true,
                     stream.s);
    stream.sync();

    const ref::EpExchange ex = ref::ep_exchange(idx, T, k, E, N, Cs);
    int64_t dropped = 0;
    for (int r = 0; r < N; ++r) {
      dropped += ex.send[r].dropped;
      EXPECT_EQ(d[r]->dropped.download()[0], ex.send[r].dropped) << "rank " << r;
      EXPECT_EQ(received[r]->download(), ex.received[r]) << "rank " << r;
      std::vector<float> want(static_cast<size_t>(ds.rows() * H), 0.0f);
      for (int64_t row = 0; row < ds.rows(); ++row) {
        const auto [src, a] = ex.local_rows[r][static_cast<size_t>(row)];
        if (src < 0) continue;
        for (int64_t h = 0; h < H; ++h) want[row * H + h] = x[src][(a / k) * H + h];
      }
      const auto got = test::from_bf16(local[r]->download());
      EXPECT_TRUE(test::bit_equal("rank " + std::to_string(r) + "'s local experts' rows",
                                  got.data(), want.data(), got.size() * 4));
    }
    EXPECT_GT(dropped, 0);  // the skewed routes overflow capacity factor 1
  }
}

TEST(MoeDispatchGpu, DataMatchesReference) {
  check_dispatch_data(dispatch_shape(256, 8, 2, DispatchMode::kDropless), 64, 71);
  check_dispatch_data(dispatch_shape(256, 8, 2, DispatchMode::kCapacity, 40), 64, 72);
  check_dispatch_data(dispatch_shape(4096, 256, 8, DispatchMode::kDropless), 1024, 73);
  check_dispatch_data(
      dispatch_shape(4096, 256, 8, DispatchMode::kCapacity, moe_capacity(1.0, 4096, 8, 256)), 1024,
      74);
}

// ---------------------------------------------------------------------------------------------------
// One MoE layer's routing and data movement, forward and backward, with identity experts
// (y_sorted = x_sorted): what the determinism and graph tests run.

struct Layer {
  RouterShape rs;
  DispatchShape ds;
  AuxLossShape as;
  int64_t H;
  DeviceBuffer<float> x_logits, bias, weights, dweights, dlogits, aux_loss, dloss;
  DeviceBuffer<int32_t> indices, load;
  DeviceBuffer<bf16> x, x_sorted, out, dout, dy_sorted, dx;
  DeviceBuffer<unsigned char> aux_ws;
  DeviceDispatch dispatch;

  Layer(const RouterShape& r, DispatchMode mode, double factor, int64_t hidden, int64_t seq_len)
      : rs(r),
        ds(dispatch_shape(r.tokens, r.experts, r.topk, mode,
                          moe_capacity(factor, r.tokens, r.topk, r.experts))),
        as(aux_shape(r, seq_len)),
        H(hidden),
        x_logits(r.tokens * r.experts),
        bias(r.experts),
        weights(r.tokens * r.topk),
        dweights(r.tokens * r.topk),
        dlogits(r.tokens * r.experts),
        aux_loss(1),
        dloss(std::vector<float>{1.0f}),
        indices(r.tokens * r.topk),
        load(std::vector<int32_t>(r.experts, 0)),
        x(r.tokens * hidden),
        x_sorted(ds.rows() * hidden),
        out(r.tokens * hidden),
        dout(r.tokens * hidden),
        dy_sorted(ds.rows() * hidden),
        dx(r.tokens * hidden),
        aux_ws(router_aux_loss_workspace_bytes(as)),
        dispatch(ds) {}

  static AuxLossShape aux_shape(const RouterShape& r, int64_t seq_len) {
    AuxLossShape a;
    a.tokens = r.tokens;
    a.seq_len = seq_len;
    a.experts = r.experts;
    a.topk = r.topk;
    return a;
  }

  void upload_inputs(uint64_t seed) {
    x_logits.upload(router_logits(rs, seed, 0.5f));
    x.upload(test::to_bf16(test::random_normal(rs.tokens * H, seed + 1)));
    dout.upload(test::to_bf16(test::random_normal(rs.tokens * H, seed + 2)));
    bias.upload(test::random_uniform(rs.experts, seed + 3, -0.02f, 0.02f));
  }

  void forward_backward(cudaStream_t st) {
    router_forward(indices.get(), weights.get(), x_logits.get(), bias.get(), rs, st);
    router_aux_loss_forward(aux_loss.get(), x_logits.get(), indices.get(), as, aux_ws.get(),
                            aux_ws.size(), st);
    dispatch.run(indices.get(), st);
    moe_gather(x_sorted.get(), x.get(), dispatch.slot_row.get(), dispatch.row_source.get(), ds, H,
               st);
    moe_combine(out.get(), x_sorted.get(), weights.get(), dispatch.slot_row.get(), ds, H, false,
                st);
    moe_combine_backward(dy_sorted.get(), dweights.get(), dout.get(), x_sorted.get(), weights.get(),
                         dispatch.slot_row.get(), dispatch.row_source.get(), ds, H, st);
    moe_gather_backward(dx.get(), dy_sorted.get(), dispatch.slot_row.get(), ds, H, false, st);
    router_backward(dlogits.get(), dweights.get(), x_logits.get(), indices.get(), rs, false, st);
    router_aux_loss_backward(dlogits.get(), dloss.get(), x_logits.get(), as, true, aux_ws.get(),
                             aux_ws.size(), st);
    moe_count_experts(load.get(), indices.get(), rs.tokens, rs.topk, rs.experts, true, st);
    router_bias_update(bias.get(), load.get(), rs.experts, 1e-3f, true, st);
  }

  // Every output, as bytes, in a fixed order.
  std::vector<std::vector<unsigned char>> outputs() const {
    std::vector<std::vector<unsigned char>> r;
    auto add = [&](const auto& buf) {
      const auto v = buf.download();
      std::vector<unsigned char> bytes(v.size() * sizeof(v[0]));
      std::memcpy(bytes.data(), v.data(), bytes.size());
      r.push_back(std::move(bytes));
    };
    add(indices), add(weights), add(aux_loss), add(dispatch.routed), add(dispatch.kept);
    add(dispatch.offsets), add(dispatch.slot_row), add(dispatch.row_source), add(dispatch.dropped);
    add(x_sorted), add(out), add(dy_sorted), add(dweights), add(dx), add(dlogits), add(bias);
    add(load);
    return r;
  }

  // Fills every output with `byte`, so that a run must write all of them to compare equal.
  void poison(int byte) {
    const std::pair<void*, size_t> bufs[] = {
        {indices.get(), indices.size() * 4},
        {weights.get(), weights.size() * 4},
        {aux_loss.get(), 4},
        {x_sorted.get(), x_sorted.size() * 2},
        {out.get(), out.size() * 2},
        {dy_sorted.get(), dy_sorted.size() * 2},
        {dweights.get(), dweights.size() * 4},
        {dx.get(), dx.size() * 2},
        {dlogits.get(), dlogits.size() * 4},
        {dispatch.routed.get(), dispatch.routed.size() * 4},
        {dispatch.kept.get(), dispatch.kept.size() * 4},
        {dispatch.offsets.get(), dispatch.offsets.size() * 4},
        {dispatch.slot_row.get(), dispatch.slot_row.size() * 4},
        {dispatch.row_source.get(), dispatch.row_source.size() * 4},
        {dispatch.dropped.get(), 4}};
    for (const auto& [p, n] : bufs) REPLAY_CUDA_CHECK(cudaMemset(p, byte, n));
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

void expect_equal_outputs(const std::vector<std::vector<unsigned char>>& a,
                          const std::vector<std::vector<unsigned char>>& b,
                          const std::string& what) {
  static const char* names[] = {
      "indices",  "weights",    "aux_loss", "routed_counts", "kept_counts", "offsets",
      "slot_row", "row_source", "dropped",  "x_sorted",      "out",         "dy_sorted",
      "dweights", "dx",         "dlogits",  "bias",          "load"};
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size());
    EXPECT_TRUE(test::bit_equal(what + " " + names[i], a[i].data(), b[i].data(), a[i].size()));
  }
}

TEST(MoeLayerGpu, RerunsAreBitIdentical) {
  for (const auto mode : {DispatchMode::kDropless, DispatchMode::kCapacity}) {
    Stream stream;
    Layer layer(router_shape(4096, 256, 8, 4, 8), mode, 1.0, 1024, 2048);
    layer.upload_inputs(81);
    layer.poison(0xFF);
    layer.forward_backward(stream.s);
    stream.sync();
    const auto first = layer.outputs();
    layer.upload_inputs(81);  // the same inputs (and bias) again
    layer.poison(0x00);
    REPLAY_CUDA_CHECK(cudaMemset(layer.load.get(), 0, layer.load.size() * 4));
    layer.forward_backward(stream.s);
    stream.sync();
    expect_equal_outputs(first, layer.outputs(),
                         mode == DispatchMode::kCapacity ? "capacity" : "dropless");
  }
}

TEST(MoeLayerGpu, GraphReplaysMatchEager) {
  for (const auto mode : {DispatchMode::kDropless, DispatchMode::kCapacity}) {
    SCOPED_TRACE(mode == DispatchMode::kCapacity ? "capacity" : "dropless");
    Stream stream;
    Layer layer(router_shape(4096, 256, 8, 4, 8), mode, 1.25, 1024, 4096);
    layer.upload_inputs(90);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
    layer.forward_backward(stream.s);
    REPLAY_CUDA_CHECK(cudaStreamEndCapture(stream.s, &graph));
    REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      layer.upload_inputs(91 + replay);  // new logits, tokens, gradients and bias
      layer.poison(0xFF);
      REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, stream.s));
      stream.sync();
      const auto graphed = layer.outputs();
      layer.upload_inputs(91 + replay);
      layer.poison(0x00);
      layer.forward_backward(stream.s);
      stream.sync();
      expect_equal_outputs(graphed, layer.outputs(), "replay " + std::to_string(replay));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// ---------------------------------------------------------------------------------------------------
// Expert GEMMs: the capacity-padded strided batch against the reference, padding rows zero.

class MoeExpertGemmGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ctx_ = std::make_unique<Context>();
    cache_ = std::make_unique<GemmCache>(*ctx_);
  }
  static void TearDownTestSuite() {
    cache_.reset();
    ctx_.reset();
  }
  static inline std::unique_ptr<Context> ctx_;
  static inline std::unique_ptr<GemmCache> cache_;
};

TEST_F(MoeExpertGemmGpu, PaddedBatchMatchesReference) {
  const int64_t E = 4, C = 64, in = 128, out = 256;
  const std::vector<int64_t> counts = {64, 10, 0, 33};
  const LinearGemms g = expert_linear_gemms(E, C, in, out, false);
  auto x = test::round_bf16(test::random_uniform(E * C * in, 101));
  for (int64_t e = 0; e < E; ++e)  // padding rows are zero, as the gather leaves them
    std::fill(x.begin() + (e * C + counts[e]) * in, x.begin() + (e + 1) * C * in, 0.0f);
  const auto w = test::round_bf16(test::random_uniform(E * out * in, 102, -0.1f, 0.1f));
  auto dy = test::round_bf16(test::random_uniform(E * C * out, 103));
  for (int64_t e = 0; e < E; ++e)
    std::fill(dy.begin() + (e * C + counts[e]) * out, dy.begin() + (e + 1) * C * out, 0.0f);
  DeviceBuffer<bf16> d_x(test::to_bf16(x)), d_w(test::to_bf16(w)), d_dy(test::to_bf16(dy));
  DeviceBuffer<bf16> d_y(E * C * out);
  DeviceBuffer<float> d_dw(E * out * in);
  GemmPlan& fwd = cache_->get(g.forward);
  GemmPlan& wgrad = cache_->get(g.wgrad);
  DeviceBuffer<unsigned char> ws(std::max<size_t>(cache_->max_workspace_bytes(), 256));
  GemmArgs a;
  a.a = d_x.get(), a.b = d_w.get(), a.d = d_y.get(), a.workspace = ws.get();
  a.workspace_bytes = ws.size();
  fwd.run(ctx_->stream(), a);
  GemmArgs b;
  b.a = d_dy.get(), b.b = d_x.get(), b.d = d_dw.get(), b.workspace = ws.get();
  b.workspace_bytes = ws.size();
  wgrad.run(ctx_->stream(), b);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream()));

  std::vector<double> y(E * C * out), dw(E * out * in);
  const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  replay::ref::GemmRefArgs ra;
  ra.a = xd.data(), ra.b = wd.data(), ra.d = y.data();
  replay::ref::gemm(g.forward.normalized(), ra);
  replay::ref::GemmRefArgs rb;
  rb.a = dyd.data(), rb.b = xd.data(), rb.d = dw.data();
  replay::ref::gemm(g.wgrad.normalized(), rb);
  const auto y_gpu = test::from_bf16(d_y.download());
  EXPECT_TRUE(test::all_close("expert forward", y_gpu, y, Tolerance{2e-3, 8e-3}));
  EXPECT_TRUE(test::all_close("expert wgrad", d_dw.download(), dw, Tolerance{1e-4, 1e-4}));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = (e * C + counts[e]) * out; i < (e + 1) * C * out; ++i)
      ASSERT_EQ(y_gpu[i], 0.0f) << "padding row output, expert " << e;
  std::printf("  expert forward: %s\n", fwd.algo_info().to_string().c_str());
}

// The one-GPU shard of the 671b-ep32 layout: 8 local experts at 4096 rows each, hidden 7168,
// expert FFN 2048 (gate+up fused: 4096), against one dense GEMM of the same total shape.
TEST_F(MoeExpertGemmGpu, TimingShardShapes) {
  const int64_t E = 8, C = 4096, H = 7168, F = 2048;
  struct Case {
    const char* name;
    int64_t in, out;
  };
  const Case cases[] = {{"gate+up", H, 2 * F}, {"down", F, H}};
  DeviceBuffer<bf16> d_x(E * C * H), d_w(E * 2 * F * H), d_y(E * C * H);
  REPLAY_CUDA_CHECK(cudaMemset(d_x.get(), 0x3c, d_x.size() * 2));  // small finite bf16 values
  REPLAY_CUDA_CHECK(cudaMemset(d_w.get(), 0x3c, d_w.size() * 2));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  for (const Case& c : cases) {
    const LinearGemms batched = expert_linear_gemms(E, C, c.in, c.out, false);
    const LinearGemms dense = linear_gemms(E * C, c.in, c.out, false, false);
    GemmPlan& pb = cache_->get(batched.forward);
    GemmPlan& pd = cache_->get(dense.forward);
    DeviceBuffer<unsigned char> ws(std::max<size_t>(cache_->max_workspace_bytes(), 256));
    GemmArgs a;
    a.a = d_x.get(), a.b = d_w.get(), a.d = d_y.get(), a.workspace = ws.get();
    a.workspace_bytes = ws.size();
    const double us_b = time_us(ctx_->stream(), 10, [&] { pb.run(ctx_->stream(), a); });
    const double us_d = time_us(ctx_->stream(), 10, [&] { pd.run(ctx_->stream(), a); });
    const double flops = expert_gemm_flops(E * C, c.in, c.out);
    std::printf(
        "  expert %-8s 8 x %lld x %lld x %lld: batched %.1f us (%.0f TFLOP/s), dense "
        "%.1f us (%.0f TFLOP/s), ratio %.3f\n",
        c.name, static_cast<long long>(C), static_cast<long long>(c.out),
        static_cast<long long>(c.in), us_b, flops / us_b * 1e-6, us_d, flops / us_d * 1e-6,
        us_d / us_b);
  }
}

// ---------------------------------------------------------------------------------------------------
// Timings at DeepSeek-V3 sizes: 4096 tokens (one sequence), 256 experts, top-8, hidden 7168.

TEST(MoeTimingGpu, DeepSeekV3Sizes) {
  Stream stream;
  const int64_t H = 7168;
  const RouterShape rs = router_shape(4096, 256, 8, 4, 8);
  for (const auto mode : {DispatchMode::kDropless, DispatchMode::kCapacity}) {
    Layer layer(rs, mode, 1.0, H, 4096);
    layer.upload_inputs(111);
    layer.forward_backward(stream.s);
    const DispatchShape& ds = layer.ds;
    const cudaStream_t st = stream.s;
    auto report = [&](const char* what, double us, double bytes) {
      if (bytes > 0)
        std::printf("  %-9s %-26s %8.1f us  %6.0f GB/s\n",
                    mode == DispatchMode::kCapacity ? "capacity" : "dropless", what, us,
                    bytes / us * 1e-3);
      else
        std::printf("  %-9s %-26s %8.1f us\n",
                    mode == DispatchMode::kCapacity ? "capacity" : "dropless", what, us);
    };
    // Bytes each kernel must move at least: every row it writes, and every distinct row it reads
    // (a token's row read for each of its k copies counts once: L2 serves the repeats).
    const double row = 2.0 * H;
    const auto kept_counts = layer.dispatch.kept.download();
    const double kept = std::accumulate(kept_counts.begin(), kept_counts.end(), 0.0);
    const double rows = static_cast<double>(ds.rows()), tokens = static_cast<double>(rs.tokens);
    if (mode == DispatchMode::kDropless) {
      report("router forward",
             time_us(st, 20,
                     [&] {
                       router_forward(layer.indices.get(), layer.weights.get(),
                                      layer.x_logits.get(), layer.bias.get(), rs, st);
                     }),
             0);
      report("router backward",
             time_us(st, 20,
                     [&] {
                       router_backward(layer.dlogits.get(), layer.dweights.get(),
                                       layer.x_logits.get(), layer.indices.get(), rs, false, st);
                     }),
             0);
      report("aux loss forward",
             time_us(st, 20,
                     [&] {
                       router_aux_loss_forward(layer.aux_loss.get(), layer.x_logits.get(),
                                               layer.indices.get(), layer.as, layer.aux_ws.get(),
                                               layer.aux_ws.size(), st);
                     }),
             0);
      report("aux loss backward",
             time_us(st, 20,
                     [&] {
                       router_aux_loss_backward(layer.dlogits.get(), layer.dloss.get(),
                                                layer.x_logits.get(), layer.as, true,
                                                layer.aux_ws.get(), layer.aux_ws.size(), st);
                     }),
             0);
      report("count + bias update",
             time_us(st, 20,
                     [&] {
                       moe_count_experts(layer.load.get(), layer.indices.get(), rs.tokens, rs.topk,
                                         rs.experts, true, st);
                       router_bias_update(layer.bias.get(), layer.load.get(), rs.experts, 1e-3f,
                                          true, st);
                     }),
             0);
    }
    report("dispatch index (sort)",
           time_us(st, 20, [&] { layer.dispatch.run(layer.indices.get(), st); }), 0);
    report("gather",
           time_us(st, 20,
                   [&] {
                     moe_gather(layer.x_sorted.get(), layer.x.get(), layer.dispatch.slot_row.get(),
                                layer.dispatch.row_source.get(), ds, H, st);
                   }),
           row * (tokens + rows));
    report("combine",
           time_us(st, 20,
                   [&] {
                     moe_combine(layer.out.get(), layer.x_sorted.get(), layer.weights.get(),
                                 layer.dispatch.slot_row.get(), ds, H, false, st);
                   }),
           row * (kept + tokens));
    report("combine backward",
           time_us(st, 20,
                   [&] {
                     moe_combine_backward(layer.dy_sorted.get(), layer.dweights.get(),
                                          layer.dout.get(), layer.x_sorted.get(),
                                          layer.weights.get(), layer.dispatch.slot_row.get(),
                                          layer.dispatch.row_source.get(), ds, H, st);
                   }),
           row * (tokens + kept + rows));
    report("gather backward",
           time_us(st, 20,
                   [&] {
                     moe_gather_backward(layer.dx.get(), layer.dy_sorted.get(),
                                         layer.dispatch.slot_row.get(), ds, H, false, st);
                   }),
           row * (kept + tokens));
  }
}

}  // namespace
}  // namespace replay::moe
