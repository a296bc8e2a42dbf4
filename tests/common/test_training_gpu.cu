// Training kernels on the GPU against the fp64 references (tolerance table keys embedding.*,
// cross_entropy.*, adamw.*, grad_norm.*), plus the properties the step relies on:
// bitwise-reproducible embedding backward and grad norm, an AdamW no-op that touches nothing,
// vocab-parallel cross-entropy equal to the unsharded one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/kernels/cross_entropy.h"
#include "common/kernels/embedding.h"
#include "common/optim/adamw.h"
#include "common/optim/grad_norm.h"
#include "common/reference/training.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using test::all_close;
using test::bit_equal;
using test::DeviceBuffer;
using test::from_bf16;
using test::round_bf16;
using test::to_bf16;
using test::to_double;
using test::tolerance;

constexpr cudaStream_t kStream = nullptr;  // the legacy stream orders the tests' blocking copies

std::vector<int32_t> random_ints(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// ---- embedding -------------------------------------------------------------------------------

struct EmbeddingCase {
  EmbeddingShape shape;
  int32_t token_range;  // tokens drawn from [0, token_range)
  bool position;
};

ref::EmbeddingDims dims(const EmbeddingShape& s) {
  return {s.batch, s.seq, s.channels, s.vocab_start, s.vocab_shard};
}

const EmbeddingCase kEmbeddingCases[] = {
    {{2, 64, 768, 0, 1000}, 1000, true},          // GPT-style, whole vocabulary on one rank
    {{1, 128, 1024, 12576, 12576}, 50304, true},  // rank 1 of a 50304 / 4 vocab split
    {{2, 96, 512, 16000, 16000}, 32000, false},   // Llama: no position table, rank 1 of 2
    {{3, 40, 64, 5, 24}, 40, true},               // many repeats, ids on both sides of the shard
};

TEST(EmbeddingGpu, ForwardMatchesReference) {
  for (const EmbeddingCase& ec : kEmbeddingCases) {
    const EmbeddingShape& s = ec.shape;
    const int64_t rows = s.batch * s.seq, C = s.channels;
    const std::vector<int32_t> tokens = random_ints(rows, 11, 0, ec.token_range - 1);
    const std::vector<float> wte = round_bf16(test::random_normal(s.vocab_shard * C, 12));
    const std::vector<float> wpe = round_bf16(test::random_normal(s.seq * C, 13));
    DeviceBuffer<int32_t> d_tokens(tokens);
    DeviceBuffer<__nv_bfloat16> d_wte(to_bf16(wte)), d_wpe(to_bf16(wpe)), d_out(rows * C);
    embedding_forward(d_out.get(), d_tokens.get(), d_wte.get(), ec.position ? d_wpe.get() : nullptr,
                      s, kStream);
    const std::vector<double> dwte = to_double(wte), dwpe = to_double(wpe);
    std::vector<double> ref(rows * C);
    ref::embedding_forward(ref.data(), tokens.data(), dwte.data(),
                           ec.position ? dwpe.data() : nullptr, dims(s));
    EXPECT_TRUE(all_close("embedding forward C=" + std::to_string(C), from_bf16(d_out.download()),
                          ref, tolerance("embedding.fwd.bf16")));
  }
}

TEST(EmbeddingGpu, BackwardMatchesReferenceOverwriteAndAccumulate) {
  for (const EmbeddingCase& ec : kEmbeddingCases) {
    const EmbeddingShape& s = ec.shape;
    const int64_t rows = s.batch * s.seq, C = s.channels;
    const std::vector<int32_t> tokens = random_ints(rows, 21, 0, ec.token_range - 1);
    const std::vector<float> dout = round_bf16(test::random_normal(rows * C, 22));
    DeviceBuffer<int32_t> d_tokens(tokens);
    DeviceBuffer<__nv_bfloat16> d_dout(to_bf16(dout));
    DeviceBuffer<char> workspace(embedding_backward_workspace_bytes(s));
    for (bool accumulate : {false, true}) {
      // Overwrite starts from NaN-poisoned buffers: every element must be written.
      std::vector<float> wte0(s.vocab_shard * C, NAN), wpe0(s.seq * C, NAN);
      if (accumulate) {
        wte0 = test::random_normal(wte0.size(), 23);
        wpe0 = test::random_normal(wpe0.size(), 24);
      }
      DeviceBuffer<float> d_dwte(wte0), d_dwpe(wpe0);
      embedding_backward(d_dwte.get(), ec.position ? d_dwpe.get() : nullptr, d_dout.get(),
                         d_tokens.get(), s, accumulate, workspace.get(), workspace.size(), kStream);
      std::vector<double> ref_wte = to_double(wte0), ref_wpe = to_double(wpe0);
      ref::embedding_backward(ref_wte.data(), ec.position ? ref_wpe.data() : nullptr,
                              to_double(dout).data(), tokens.data(), dims(s), accumulate);
      const std::string what =
          std::string(accumulate ? "accumulate" : "overwrite") + " C=" + std::to_string(C);
      EXPECT_TRUE(
          all_close("dwte " + what, d_dwte.download(), ref_wte, tolerance("embedding.bwd.fp32")));
      if (ec.position)
        EXPECT_TRUE(
            all_close("dwpe " + what, d_dwpe.download(), ref_wpe, tolerance("embedding.bwd.fp32")));
    }
  }
}

// Most positions hold the same token (long sorted runs); dout values are multiples of 1/16 in
// [-1, 1], so every partial sum is exact in fp32: the result must equal the reference exactly, and
// be bit-identical from run to run.
TEST(EmbeddingGpu, BackwardRepeatedTokensIsExactAndBitwiseReproducible) {
  const EmbeddingShape s{4, 1024, 768, 0, 50304};
  const int64_t rows = s.batch * s.seq, C = s.channels;
  std::vector<int32_t> tokens = random_ints(rows, 31, 0, 7);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (i % 10 != 0) tokens[i] = 50256;  // 90% one token: a run of ~3700 rows
  std::vector<float> dout(rows * C);
  const std::vector<int32_t> q = random_ints(dout.size(), 32, -16, 16);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>(q[i]) / 16.0f;
  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<__nv_bfloat16> d_dout(to_bf16(dout));
  DeviceBuffer<char> workspace(embedding_backward_workspace_bytes(s));
  DeviceBuffer<float> a_wte(s.vocab_shard * C), a_wpe(s.seq * C);
  DeviceBuffer<float> b_wte(s.vocab_shard * C), b_wpe(s.seq * C);
  embedding_backward(a_wte.get(), a_wpe.get(), d_dout.get(), d_tokens.get(), s, false,
                     workspace.get(), workspace.size(), kStream);
  embedding_backward(b_wte.get(), b_wpe.get(), d_dout.get(), d_tokens.get(), s, false,
                     workspace.get(), workspace.size(), kStream);
  const std::vector<float> a = a_wte.download(), b = b_wte.download();
  EXPECT_TRUE(bit_equal("dwte run 1 vs run 2", a.data(), b.data(), a.size() * sizeof(float)));
  const std::vector<float> pa = a_wpe.download(), pb = b_wpe.download();
  EXPECT_TRUE(bit_equal("dwpe run 1 vs run 2", pa.data(), pb.data(), pa.size() * sizeof(float)));

  std::vector<double> ref_wte(a.size()), ref_wpe(pa.size());
  ref::embedding_backward(ref_wte.data(), ref_wpe.data(), to_double(dout).data(), tokens.data(),
                          dims(s), false);
  EXPECT_TRUE(all_close("dwte repeated tokens", a, ref_wte, {0.0, 0.0}));
  EXPECT_TRUE(all_close("dwpe repeated tokens", pa, ref_wpe, {0.0, 0.0}));
}

// ---- cross-entropy ---------------------------------------------------------------------------

std::vector<int32_t> ce_targets(int64_t rows, int32_t vocab, uint64_t seed) {
  std::vector<int32_t> t = random_ints(rows, seed, 0, vocab - 1);
  for (int64_t r = 0; r < rows; r += 7) t[r] = kCrossEntropyIgnoreIndex;
  return t;
}

struct CeOutput {
  std::vector<float> row_loss;
  float mean = 0.0f;
  int32_t count = 0;
  std::vector<float> dlogits;  // [rows, vocab], the shards' columns put back together
};

// Runs stats -> combine -> loss -> backward with the vocabulary split into `widths` (one entry: no
// split). Each shard's logits live in their own buffer, starting `offset` bf16 elements past a
// 256-byte boundary; the backward runs in place. Unsplit, it also runs cross_entropy_forward and
// expects the same statistics, row losses, mean and count, bit for bit.
CeOutput run_cross_entropy(const std::vector<float>& logits, const std::vector<int32_t>& targets,
                           int64_t rows, const std::vector<int64_t>& widths, float dloss,
                           int offset) {
  int64_t vocab = 0;
  for (int64_t w : widths) vocab += w;
  const int shards = static_cast<int>(widths.size());
  DeviceBuffer<int32_t> d_targets(targets);
  DeviceBuffer<float> stacked(shards * cross_entropy_stats_floats(rows));
  DeviceBuffer<float> stats(cross_entropy_stats_floats(rows)), row_loss(rows), mean(1);
  DeviceBuffer<float> d_dloss(std::vector<float>{dloss});
  DeviceBuffer<int32_t> count(1);
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> shard_logits;
  int64_t start = 0;
  for (int k = 0; k < shards; ++k) {
    std::vector<float> slice;
    for (int64_t r = 0; r < rows; ++r)
      slice.insert(slice.end(), logits.begin() + r * vocab + start,
                   logits.begin() + r * vocab + start + widths[k]);
    std::vector<__nv_bfloat16> host(offset, __float2bfloat16(0.0f));
    const std::vector<__nv_bfloat16> b = to_bf16(slice);
    host.insert(host.end(), b.begin(), b.end());
    shard_logits.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(host));
    cross_entropy_stats(stacked.get() + k * cross_entropy_stats_floats(rows),
                        shard_logits[k]->get() + offset, d_targets.get(), {rows, widths[k], start},
                        kStream);
    start += widths[k];
  }
  cross_entropy_combine_stats(stats.get(), stacked.get(), shards, rows, kStream);
  cross_entropy_loss(row_loss.get(), mean.get(), count.get(), stats.get(), d_targets.get(), rows,
                     kStream);
  if (shards == 1) {
    DeviceBuffer<float> f_stats(cross_entropy_stats_floats(rows)), f_row_loss(rows), f_mean(1);
    DeviceBuffer<int32_t> f_count(1);
    cross_entropy_forward(f_stats.get(), f_row_loss.get(), f_mean.get(), f_count.get(),
                          shard_logits[0]->get() + offset, d_targets.get(), {rows, vocab, 0},
                          kStream);
    const std::string what =
        "forward vs stats + loss, rows " + std::to_string(rows) + " vocab " + std::to_string(vocab);
    const std::vector<float> a = f_stats.download(), b = stats.download();
    EXPECT_TRUE(bit_equal(what + ": stats", a.data(), b.data(), a.size() * sizeof(float)));
    const std::vector<float> la = f_row_loss.download(), lb = row_loss.download();
    EXPECT_TRUE(bit_equal(what + ": row loss", la.data(), lb.data(), la.size() * sizeof(float)));
    const float ma = f_mean.download()[0], mb = mean.download()[0];
    EXPECT_TRUE(bit_equal(what + ": mean", &ma, &mb, sizeof(float)));
    EXPECT_EQ(f_count.download()[0], count.download()[0]) << what;
  }
  CeOutput out;
  out.dlogits.resize(rows * vocab);
  start = 0;
  for (int k = 0; k < shards; ++k) {
    __nv_bfloat16* x = shard_logits[k]->get() + offset;
    cross_entropy_backward(x, x, stats.get(), d_targets.get(), count.get(), d_dloss.get(),
                           {rows, widths[k], start}, kStream);
    const std::vector<float> g = from_bf16(shard_logits[k]->download());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < widths[k]; ++i)
        out.dlogits[r * vocab + start + i] = g[offset + r * widths[k] + i];
    start += widths[k];
  }
  out.row_loss = row_loss.download();
  out.mean = mean.download()[0];
  out.count = count.download()[0];
  return out;
}

struct CeReference {
  std::vector<double> row_loss;
  double mean = 0.0;
  int64_t count = 0;
  std::vector<double> grad;  // softmax - onehot, before the dloss / count scale
};

CeReference reference_cross_entropy(const std::vector<float>& logits,
                                    const std::vector<int32_t>& targets, int64_t rows,
                                    int64_t vocab) {
  const std::vector<double> x = to_double(logits);
  std::vector<ref::CrossEntropyRowStats> stats(rows);
  CeReference r;
  r.row_loss.resize(rows);
  r.grad.resize(rows * vocab);
  ref::cross_entropy_stats(stats.data(), x.data(), targets.data(), rows, vocab, 0);
  r.mean = ref::cross_entropy_loss(r.row_loss.data(), &r.count, stats.data(), targets.data(), rows);
  ref::cross_entropy_backward(r.grad.data(), x.data(), stats.data(), targets.data(), 1, 1.0, rows,
                              vocab, 0);
  return r;
}

// The GPU gradient with the dloss / count scale taken out again, to compare with softmax - onehot.
std::vector<float> unscaled(const CeOutput& out, float dloss) {
  std::vector<float> g(out.dlogits.size());
  const double k = static_cast<double>(out.count) / dloss;
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(out.dlogits[i] * k);
  return g;
}

void expect_matches_reference(const CeOutput& out, const CeReference& ref, float dloss,
                              const std::string& what) {
  EXPECT_EQ(out.count, ref.count) << what;
  EXPECT_TRUE(all_close(what + " row loss", out.row_loss, ref.row_loss,
                        tolerance("cross_entropy.loss.fp32")));
  EXPECT_TRUE(all_close(what + " mean loss", &out.mean, &ref.mean, 1,
                        tolerance("cross_entropy.loss.fp32")));
  EXPECT_TRUE(all_close(what + " dlogits", unscaled(out, dloss), ref.grad,
                        tolerance("cross_entropy.bwd.bf16")));
}

TEST(CrossEntropyGpu, MatchesReferenceForAnyWidth) {
  struct Case {
    int64_t rows, vocab;
    int offset;  // bf16 elements past a 16-byte boundary
    float dloss;
  };
  // {3000, 512}, {600, 32000} and {5000, 1001, 3}: more rows than a wave of blocks, at a small, a
  // wide and an odd width (whose rows' 16-byte alignment, and so their unaligned head and tail,
  // change from row to row). The statistics take 5 packs a thread at 12576 (GPT-3's TP4 shard), 8
  // at 16032 (Llama's TP8 shard) and 32000, 4 at 512, and several chunks a row at 50257 and 50304.
  // {2048, 12576} is GPT-3's TP4 shard at its own row count (just over three waves of 5-pack blocks
  // on 132 SMs), and {2048, 8197, 3} as many rows of an odd width.
  const Case cases[] = {{64, 32000, 0, 1.0f},  {32, 12576, 0, 1.0f},   {24, 50257, 0, 1024.0f},
                        {20, 50304, 3, 1.0f},  {16, 13, 0, 1.0f},      {9, 7, 5, 2.0f},
                        {3000, 512, 0, 1.0f},  {600, 32000, 0, 1.0f},  {40, 16032, 0, 1.0f},
                        {5000, 1001, 3, 1.0f}, {2048, 12576, 0, 1.0f}, {2048, 8197, 3, 1.0f}};
  for (const Case& c : cases) {
    const std::vector<float> logits =
        round_bf16(test::random_normal(c.rows * c.vocab, 41, 0.0f, 3.0f));
    const std::vector<int32_t> targets = ce_targets(c.rows, static_cast<int32_t>(c.vocab), 42);
    const std::string what = "rows " + std::to_string(c.rows) + " vocab " +
                             std::to_string(c.vocab) + " offset " + std::to_string(c.offset);
    const CeOutput out = run_cross_entropy(logits, targets, c.rows, {c.vocab}, c.dloss, c.offset);
    expect_matches_reference(out, reference_cross_entropy(logits, targets, c.rows, c.vocab),
                             c.dloss, what);
    for (int64_t r = 0; r < c.rows; r += 7)  // ignored rows: exactly zero gradient
      for (int64_t i = 0; i < c.vocab; ++i) ASSERT_EQ(out.dlogits[r * c.vocab + i], 0.0f) << what;
  }
}

TEST(CrossEntropyGpu, OutOfPlaceEqualsInPlace) {
  const int64_t rows = 12, vocab = 1001;
  const std::vector<float> logits = round_bf16(test::random_normal(rows * vocab, 51, 0.0f, 2.0f));
  const std::vector<int32_t> targets = ce_targets(rows, vocab, 52);
  DeviceBuffer<__nv_bfloat16> x(to_bf16(logits)), y(rows * vocab);
  DeviceBuffer<int32_t> d_targets(targets), count(1);
  DeviceBuffer<float> stats(cross_entropy_stats_floats(rows)), row_loss(rows), mean(1);
  DeviceBuffer<float> dloss(std::vector<float>{1.0f});
  const CrossEntropyShape shape{rows, vocab, 0};
  cross_entropy_stats(stats.get(), x.get(), d_targets.get(), shape, kStream);
  cross_entropy_loss(row_loss.get(), mean.get(), count.get(), stats.get(), d_targets.get(), rows,
                     kStream);
  cross_entropy_backward(y.get(), x.get(), stats.get(), d_targets.get(), count.get(), dloss.get(),
                         shape, kStream);
  cross_entropy_backward(x.get(), x.get(), stats.get(), d_targets.get(), count.get(), dloss.get(),
                         shape, kStream);
  const std::vector<__nv_bfloat16> a = x.download(), b = y.download();
  EXPECT_TRUE(bit_equal("in place vs out of place", a.data(), b.data(), a.size() * 2));
}

// Tensor parallelism emulated on one GPU: each shard sees only its columns; the combined statistics
// give the unsharded loss and gradient (up to fp32 rounding of the different summation order).
TEST(CrossEntropyGpu, EmulatedTensorParallelEqualsUnsharded) {
  struct Case {
    int64_t rows;
    std::vector<int64_t> widths;
  };
  const Case cases[] = {{32, {16000, 16000}},                // 32000, TP=2
                        {24, {25152, 25152}},                // 50304, TP=2
                        {24, {12576, 12576, 12576, 12576}},  // 50304, TP=4
                        {16, {25129, 25128}}};               // 50257, odd widths
  for (const Case& c : cases) {
    int64_t vocab = 0;
    for (int64_t w : c.widths) vocab += w;
    const std::vector<float> logits =
        round_bf16(test::random_normal(c.rows * vocab, 61, 0.0f, 3.0f));
    const std::vector<int32_t> targets = ce_targets(c.rows, static_cast<int32_t>(vocab), 62);
    const std::string what =
        "TP=" + std::to_string(c.widths.size()) + " vocab " + std::to_string(vocab);
    const CeOutput whole = run_cross_entropy(logits, targets, c.rows, {vocab}, 1.0f, 0);
    const CeOutput split = run_cross_entropy(logits, targets, c.rows, c.widths, 1.0f, 0);
    EXPECT_EQ(split.count, whole.count);
    const std::vector<double> whole_loss = to_double(whole.row_loss);
    const double whole_mean = whole.mean;
    EXPECT_TRUE(all_close(what + " row loss vs unsharded", split.row_loss, whole_loss,
                          tolerance("cross_entropy.loss.fp32")));
    EXPECT_TRUE(all_close(what + " mean loss vs unsharded", &split.mean, &whole_mean, 1,
                          tolerance("cross_entropy.loss.fp32")));
    EXPECT_TRUE(all_close(what + " dlogits vs unsharded", unscaled(split, 1.0f),
                          to_double(unscaled(whole, 1.0f)), tolerance("cross_entropy.bwd.bf16")));
    expect_matches_reference(split, reference_cross_entropy(logits, targets, c.rows, vocab), 1.0f,
                             what);
  }
}

// ---- AdamW -----------------------------------------------------------------------------------

// Sizes around the vector width and the chunk size, and a few large ones.
const int64_t kOddSizes[] = {1,     3,     4,     5,     7,     8,      31, 1000, 4095,   4097,
                             16383, 16384, 16385, 32771, 65541, 100003, 2,  6,    250001, 12289};

struct AdamWState {
  std::vector<std::unique_ptr<DeviceBuffer<float>>> master, grad, m, v;
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> model;  // null entries: no bf16 copy
  std::vector<int64_t> numel;
  std::vector<bool> decay;
};

AdamWState make_adamw_state(int tensors, uint64_t seed) {
  AdamWState s;
  for (int i = 0; i < tensors; ++i) {
    const int64_t n = kOddSizes[i % (sizeof(kOddSizes) / sizeof(kOddSizes[0]))];
    const uint64_t k = seed + 10 * i;
    s.numel.push_back(n);
    s.decay.push_back(i % 3 != 0);
    s.master.push_back(std::make_unique<DeviceBuffer<float>>(test::random_normal(n, k)));
    s.grad.push_back(std::make_unique<DeviceBuffer<float>>(test::random_normal(n, k + 1)));
    s.m.push_back(std::make_unique<DeviceBuffer<float>>(test::random_normal(n, k + 2, 0.0f, 0.1f)));
    s.v.push_back(
        std::make_unique<DeviceBuffer<float>>(test::random_uniform(n, k + 3, 1e-6f, 1e-2f)));
    s.model.push_back(i % 4 == 1 ? nullptr : std::make_unique<DeviceBuffer<__nv_bfloat16>>(n));
  }
  return s;
}

struct DeviceTable {
  std::unique_ptr<DeviceBuffer<char>> memory;
  AdamWTable table;
};

DeviceTable build_adamw_table(const AdamWState& s) {
  AdamWTableBuilder builder;
  for (size_t i = 0; i < s.numel.size(); ++i)
    builder.add(s.master[i]->get(), s.model[i] ? s.model[i]->get() : nullptr, s.grad[i]->get(),
                s.m[i]->get(), s.v[i]->get(), s.numel[i], s.decay[i]);
  DeviceTable t;
  t.memory = std::make_unique<DeviceBuffer<char>>(builder.device_bytes());
  t.table = builder.build(t.memory->get(), t.memory->size(), kStream);
  return t;
}

TEST(AdamWGpu, ManyOddTensorsMatchReferenceOverSteps) {
  const int tensors = 47;
  AdamWState s = make_adamw_state(tensors, 1000);
  const DeviceTable t = build_adamw_table(s);
  EXPECT_EQ(t.table.num_tensors, tensors);
  const AdamWHyper hyper{0.9f, 0.95f, 1e-8f, 0.1f};
  const ref::AdamWConfig config{hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay};
  const float lr = 6e-4f, scale = 0.37f;
  DeviceBuffer<float> d_lr(std::vector<float>{lr}), d_scale(std::vector<float>{scale});
  DeviceBuffer<int32_t> noop(std::vector<int32_t>{0});

  for (int64_t step : {1, 2, 9}) {
    // Each step is compared from the GPU's own state before it, so errors do not compound.
    std::vector<std::vector<double>> p(tensors), m(tensors), v(tensors);
    for (int i = 0; i < tensors; ++i) {
      s.grad[i]->upload(test::random_normal(s.numel[i], 5000 + 100 * step + i));
      p[i] = to_double(s.master[i]->download());
      m[i] = to_double(s.m[i]->download());
      v[i] = to_double(s.v[i]->download());
    }
    DeviceBuffer<int64_t> d_step(std::vector<int64_t>{step});
    adamw_step(t.table, hyper, d_lr.get(), d_step.get(), d_scale.get(), noop.get(), kStream);
    for (int i = 0; i < tensors; ++i) {
      const std::vector<double> g = to_double(s.grad[i]->download());
      ref::adamw_step(p[i].data(), m[i].data(), v[i].data(), g.data(), s.numel[i], lr, step, config,
                      s.decay[i], scale);
      const std::string what = "step " + std::to_string(step) + " tensor " + std::to_string(i) +
                               " (" + std::to_string(s.numel[i]) + ")";
      const std::vector<float> master = s.master[i]->download();
      ASSERT_TRUE(all_close(what + " param", master, p[i], tolerance("adamw.param.fp32")));
      ASSERT_TRUE(
          all_close(what + " exp_avg", s.m[i]->download(), m[i], tolerance("adamw.state.fp32")));
      ASSERT_TRUE(
          all_close(what + " exp_avg_sq", s.v[i]->download(), v[i], tolerance("adamw.state.fp32")));
      if (s.model[i]) {  // the bf16 copy is exactly the rounded master weight
        const std::vector<__nv_bfloat16> expect = to_bf16(master), got = s.model[i]->download();
        ASSERT_TRUE(bit_equal(what + " bf16 copy", got.data(), expect.data(), got.size() * 2));
      }
    }
  }
}

TEST(AdamWGpu, NoOpFlagLeavesEverythingBitwiseUnchanged) {
  const int tensors = 23;
  AdamWState s = make_adamw_state(tensors, 2000);
  const DeviceTable t = build_adamw_table(s);
  DeviceBuffer<float> lr(std::vector<float>{1e-3f});
  DeviceBuffer<int64_t> step(std::vector<int64_t>{5});
  DeviceBuffer<int32_t> noop(std::vector<int32_t>{1});
  auto snapshot = [&]() {
    std::vector<std::vector<float>> f;
    std::vector<std::vector<__nv_bfloat16>> h;
    for (int i = 0; i < tensors; ++i) {
      for (auto* b : {s.master[i].get(), s.grad[i].get(), s.m[i].get(), s.v[i].get()})
        f.push_back(b->download());
      if (s.model[i]) h.push_back(s.model[i]->download());
    }
    return std::make_pair(f, h);
  };
  const auto before = snapshot();
  adamw_step(t.table, AdamWHyper{}, lr.get(), step.get(), nullptr, noop.get(), kStream);
  const auto after = snapshot();
  for (size_t i = 0; i < before.first.size(); ++i)
    ASSERT_TRUE(bit_equal("fp32 buffer " + std::to_string(i), before.first[i].data(),
                          after.first[i].data(), before.first[i].size() * 4));
  for (size_t i = 0; i < before.second.size(); ++i)  // still the 0xFF poison: never written
    ASSERT_TRUE(bit_equal("bf16 copy " + std::to_string(i), before.second[i].data(),
                          after.second[i].data(), before.second[i].size() * 2));
}

// The model copy in fp16 and fp32 (UNet-style fp16 weights, fp32 models): the copy is exactly the
// updated master weight rounded to its type, aligned and ragged tensors alike, and the master
// weights follow the same update as with a bf16 copy.
TEST(AdamWGpu, Fp16AndFp32ModelCopiesAreTheRoundedMasterWeights) {
  const int64_t sizes[] = {1, 3, 4, 1000, 16387};
  for (DType dtype : {DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<std::unique_ptr<DeviceBuffer<float>>> master, grad, m, v;
    std::vector<std::unique_ptr<DeviceBuffer<char>>> model;
    AdamWTableBuilder builder;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      const int64_t n = sizes[i];
      master.push_back(std::make_unique<DeviceBuffer<float>>(test::random_normal(n, 70 + i)));
      grad.push_back(std::make_unique<DeviceBuffer<float>>(test::random_normal(n, 80 + i)));
      m.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(n, 0.0f)));
      v.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(n, 0.0f)));
      model.push_back(
          std::make_unique<DeviceBuffer<char>>(static_cast<size_t>(n) * dtype_size(dtype)));
      builder.add(master.back()->get(), TensorView(model.back()->get(), dtype, {n}),
                  grad.back()->get(), m.back()->get(), v.back()->get(), n, i % 2 == 0);
    }
    DeviceBuffer<char> memory(builder.device_bytes());
    const AdamWTable table = builder.build(memory.get(), memory.size(), kStream);
    DeviceBuffer<float> lr(std::vector<float>{1e-2f});
    DeviceBuffer<int64_t> step(std::vector<int64_t>{1});
    adamw_step(table, AdamWHyper{}, lr.get(), step.get(), nullptr, nullptr, kStream);
    for (size_t i = 0; i < master.size(); ++i) {
      const std::vector<float> w = master[i]->download();
      const std::vector<char> got = model[i]->download();
      std::vector<char> expect(got.size());
      for (size_t j = 0; j < w.size(); ++j) {
        if (dtype == DType::kFP16) {
          const __half h = __float2half_rn(w[j]);
          std::memcpy(expect.data() + 2 * j, &h, 2);
        } else {
          std::memcpy(expect.data() + 4 * j, &w[j], 4);
        }
      }
      ASSERT_TRUE(bit_equal("model copy of tensor " + std::to_string(i), got.data(), expect.data(),
                            got.size()));
    }
  }
  // A type the optimizer cannot write is refused at set-up.
  DeviceBuffer<float> f(std::vector<float>(8, 0.0f));
  DeviceBuffer<int32_t> bad(std::vector<int32_t>(8, 0));
  AdamWTableBuilder builder;
  EXPECT_THROW(builder.add(f.get(), TensorView(bad.get(), DType::kINT32, {8}), f.get(), f.get(),
                           f.get(), 8, true),
               Error);
}

// ---- grad norm -------------------------------------------------------------------------------

struct NormRun {
  float norm, grad_scale;
  int32_t found_inf;
};

TEST(GradNormGpu, MatchesReferenceBitwiseReproducibleAndUnscales) {
  const int tensors = 53;
  const float max_norm = 1.0f, loss_scale = 1024.0f;
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> plain, scaled;
  GradNormTableBuilder plain_builder, scaled_builder;
  for (int i = 0; i < tensors; ++i) {
    const int64_t n = kOddSizes[i % (sizeof(kOddSizes) / sizeof(kOddSizes[0]))];
    host.push_back(test::random_normal(n, 7000 + i, 0.0f, 0.01f));
    std::vector<float> times = host.back();
    for (float& x : times) x *= loss_scale;  // exact: a power of two
    plain.push_back(std::make_unique<DeviceBuffer<float>>(host.back()));
    scaled.push_back(std::make_unique<DeviceBuffer<float>>(times));
    plain_builder.add(plain.back()->get(), n);
    scaled_builder.add(scaled.back()->get(), n);
  }
  DeviceBuffer<char> plain_mem(plain_builder.device_bytes()),
      scaled_mem(scaled_builder.device_bytes());
  const GradNormTable plain_table = plain_builder.build(plain_mem.get(), plain_mem.size(), kStream);
  const GradNormTable scaled_table =
      scaled_builder.build(scaled_mem.get(), scaled_mem.size(), kStream);
  DeviceBuffer<char> workspace(grad_norm_workspace_bytes(plain_table));
  DeviceBuffer<float> d_loss_scale(std::vector<float>{loss_scale});

  auto run = [&](const GradNormTable& table, const float* scale, int32_t flag0) {
    DeviceBuffer<float> norm(1), grad_scale(1);
    DeviceBuffer<int32_t> found_inf(std::vector<int32_t>{flag0});
    grad_norm(table, max_norm, scale, norm.get(), grad_scale.get(), found_inf.get(),
              workspace.get(), workspace.size(), kStream);
    return NormRun{norm.download()[0], grad_scale.download()[0], found_inf.download()[0]};
  };

  std::vector<std::vector<double>> ref_grads;
  for (const auto& h : host) ref_grads.push_back(to_double(h));
  const double ref_norm = ref::global_grad_norm(ref_grads);
  const double ref_clip = ref::clip_coefficient(ref_norm, max_norm);
  ASSERT_LT(ref_clip, 1.0);  // the case exercises clipping

  const NormRun a = run(plain_table, nullptr, 0), b = run(plain_table, nullptr, 0);
  EXPECT_TRUE(all_close("grad norm", &a.norm, &ref_norm, 1, tolerance("grad_norm.fp32")));
  EXPECT_TRUE(
      all_close("clip coefficient", &a.grad_scale, &ref_clip, 1, tolerance("grad_norm.fp32")));
  EXPECT_EQ(a.found_inf, 0);
  EXPECT_TRUE(bit_equal("norm run to run", &a.norm, &b.norm, 4));
  EXPECT_TRUE(bit_equal("clip run to run", &a.grad_scale, &b.grad_scale, 4));

  // Gradients carrying a loss scale of 1024: the same norm, and a multiplier that also unscales.
  const NormRun c = run(scaled_table, d_loss_scale.get(), 1);
  EXPECT_TRUE(bit_equal("norm of unscaled gradients", &a.norm, &c.norm, 4));
  const double ref_scaled_multiplier = ref_clip / loss_scale;
  EXPECT_TRUE(all_close("clip / loss scale", &c.grad_scale, &ref_scaled_multiplier, 1,
                        tolerance("grad_norm.fp32")));
  EXPECT_EQ(c.found_inf, 1);  // a set flag is left set

  // No clipping when the norm is under max_norm or clipping is off.
  DeviceBuffer<float> norm(1), grad_scale(1);
  grad_norm(plain_table, 1e6f, nullptr, norm.get(), grad_scale.get(), nullptr, workspace.get(),
            workspace.size(), kStream);
  EXPECT_EQ(grad_scale.download()[0], 1.0f);
  grad_norm(scaled_table, 0.0f, d_loss_scale.get(), norm.get(), grad_scale.get(), nullptr,
            workspace.get(), workspace.size(), kStream);
  EXPECT_EQ(grad_scale.download()[0], 1.0f / loss_scale);
}

TEST(GradNormGpu, NonFiniteGradientSetsTheFlag) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> g = test::random_normal(40000, 81);
    g[33333] = bad;
    DeviceBuffer<float> d_ok(test::random_normal(1000, 82)), d_bad(g);
    GradNormTableBuilder builder;
    builder.add(d_ok.get(), 1000);
    builder.add(d_bad.get(), static_cast<int64_t>(g.size()));
    DeviceBuffer<char> mem(builder.device_bytes());
    const GradNormTable table = builder.build(mem.get(), mem.size(), kStream);
    DeviceBuffer<char> workspace(grad_norm_workspace_bytes(table));
    DeviceBuffer<float> norm(1), grad_scale(1);
    DeviceBuffer<int32_t> found_inf(std::vector<int32_t>{0});
    grad_norm(table, 1.0f, nullptr, norm.get(), grad_scale.get(), found_inf.get(), workspace.get(),
              workspace.size(), kStream);
    EXPECT_EQ(found_inf.download()[0], 1) << bad;
    EXPECT_FALSE(std::isfinite(norm.download()[0])) << bad;
  }
}

}  // namespace
}  // namespace replay
