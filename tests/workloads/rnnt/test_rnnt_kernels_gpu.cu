// The RNN-T model's hand kernels (workloads/rnnt/rnnt_kernels.h) against CPU references: the
// int32 fill, the casts, the one-hot rows and the dropout bitwise (the same Philox rule on the
// host); the joint's broadcast add + ReLU + dropout bitwise, and its backward reductions against
// an fp64 sum; in fp16 and bf16, with ragged sizes that are not multiples of the block.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/check.h"
#include "common/kernels/dropout.h"
#include "workloads/rnnt/rnnt_kernels.h"

namespace replay::rnnt {
namespace {

uint16_t bits16(float v, DType t) {
  if (t == DType::kFP16) {
    const __half h = __float2half_rn(v);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

float float16(uint16_t b, DType t) {
  if (t == DType::kFP16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    REPLAY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)));
    // Poisoned, so that a word a kernel should write and does not fails the value checks (and
    // compute-sanitizer's initcheck sees no reads of never-written memory in the downloads).
    REPLAY_CUDA_CHECK(cudaMemset(p, 0xA5, std::max<size_t>(1, n) * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { up(h); }
  ~Dev() { cudaFree(p); }
  void up(const std::vector<T>& h) {
    REPLAY_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> down() const {
    std::vector<T> h(n);
    REPLAY_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<uint16_t> random16(size_t n, DType t, uint32_t seed, float lo = -2.0f,
                               float hi = 2.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = bits16(d(g), t);
  return v;
}

bool keep_ref(const PhiloxSlot& s, uint64_t op_offset, uint32_t threshold, int64_t e) {
  if (threshold == 0) return true;
  const Philox4 r = philox_block(s.seed, s.offset + op_offset, static_cast<uint64_t>(e) / 4);
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  return w[e % 4] >= threshold;
}

class RnntKernels : public ::testing::TestWithParam<DType> {};

TEST(RnntKernelsInt, FillAndOneHot) {
  Dev<int32_t> d(1000);
  fill_int32(d.p, 77, 1000, nullptr);
  for (int32_t v : d.down()) ASSERT_EQ(v, 77);
  const int64_t rows = 37, V = 40;
  std::vector<int32_t> tok(rows);
  for (int64_t r = 0; r < rows; ++r) tok[r] = static_cast<int32_t>((r * 7) % 45) - 2;  // some out
  Dev<int32_t> dt(tok);
  Dev<uint16_t> out(static_cast<size_t>(rows * V));
  one_hot(out.p, DType::kFP16, dt.p, rows, V, nullptr);
  const std::vector<uint16_t> h = out.down();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t want = std::min<int64_t>(std::max<int64_t>(tok[r], 0), V - 1);
    for (int64_t v = 0; v < V; ++v)
      ASSERT_EQ(h[r * V + v], bits16(v == want ? 1.0f : 0.0f, DType::kFP16)) << r << " " << v;
  }
}

TEST_P(RnntKernels, CastsRoundTripAndRoundToNearest) {
  const DType t = GetParam();
  const size_t n = 1237;
  std::mt19937 g(5);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> src(n);
  for (float& x : src) x = d(g);
  Dev<float> ds(src);
  Dev<uint16_t> h(n);
  cast_from_fp32(h.p, t, ds.p, static_cast<int64_t>(n), nullptr);
  const std::vector<uint16_t> hb = h.down();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(hb[i], bits16(src[i], t)) << i;
  Dev<float> back(n);
  cast_to_fp32(back.p, h.p, t, static_cast<int64_t>(n), nullptr);
  const std::vector<float> bb = back.down();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(bb[i], float16(hb[i], t)) << i;
}

TEST_P(RnntKernels, DropoutMatchesTheHostRuleBitwise) {
  const DType t = GetParam();
  const int64_t n = 10007;
  const float p = 0.3f;
  const PhiloxSlot slot{1234, 56};
  Dev<PhiloxSlot> ds(std::vector<PhiloxSlot>{slot});
  const RngArgs rng{ds.p, 9};
  const std::vector<uint16_t> x = random16(static_cast<size_t>(n), t, 1);
  Dev<uint16_t> dx(x), out(static_cast<size_t>(n));
  dropout_forward(out.p, dx.p, t, n, p, rng, nullptr);
  const std::vector<uint16_t> o = out.down();
  const uint32_t th = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);
  int64_t kept = 0;
  for (int64_t e = 0; e < n; ++e) {
    const bool k = keep_ref(slot, 9, th, e);
    kept += k;
    ASSERT_EQ(o[e], bits16(k ? float16(x[e], t) * scale : 0.0f, t)) << e;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.7, 0.02);
  // The backward applies the same mask (in place).
  dropout_backward(dx.p, dx.p, t, n, p, rng, nullptr);
  EXPECT_EQ(dx.down(), o);
  // p = 0 is exact and reads no slot.
  dropout_forward(out.p, dx.p, t, n, 0.0f, RngArgs{}, nullptr);
  EXPECT_EQ(out.down(), dx.down());
}

TEST_P(RnntKernels, JointForwardBitwiseAndBackwardAgainstFp64) {
  const DType t = GetParam();
  JointShape s;
  s.batch = 3, s.frames = 7, s.positions = 5, s.hidden = 24;
  const int64_t B = s.batch, Tn = s.frames, P = s.positions, J = s.hidden;
  const float p = 0.25f;
  const PhiloxSlot slot{99, 3};
  Dev<PhiloxSlot> ds(std::vector<PhiloxSlot>{slot});
  const RngArgs rng{ds.p, 2};
  const std::vector<uint16_t> enc = random16(static_cast<size_t>(B * Tn * J), t, 2);
  const std::vector<uint16_t> pred = random16(static_cast<size_t>(B * P * J), t, 3);
  const std::vector<uint16_t> dh = random16(static_cast<size_t>(s.elements()), t, 4);
  Dev<uint16_t> de(enc), dp(pred), h(static_cast<size_t>(s.elements())), ddh(dh);
  Dev<uint16_t> denc(static_cast<size_t>(B * Tn * J)), dpred(static_cast<size_t>(B * P * J));
  joint_hidden_forward(h.p, de.p, dp.p, t, s, p, rng, nullptr);
  joint_hidden_backward(denc.p, dpred.p, ddh.p, de.p, dp.p, t, s, p, rng, nullptr);
  const std::vector<uint16_t> hh = h.down(), ge = denc.down(), gp = dpred.down();
  const uint32_t th = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);
  std::vector<double> re(static_cast<size_t>(B * Tn * J), 0.0),
      rp(static_cast<size_t>(B * P * J), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t tt = 0; tt < Tn; ++tt)
      for (int64_t u = 0; u < P; ++u)
        for (int64_t j = 0; j < J; ++j) {
          const int64_t e = ((b * Tn + tt) * P + u) * J + j;
          const float sum =
              float16(enc[(b * Tn + tt) * J + j], t) + float16(pred[(b * P + u) * J + j], t);
          const bool k = keep_ref(slot, 2, th, e);
          const float r = sum > 0.0f ? sum : 0.0f;
          ASSERT_EQ(hh[e], bits16(k ? r * scale : 0.0f, t)) << e;
          const double g = (sum > 0.0f && k) ? static_cast<double>(float16(dh[e], t)) * scale : 0;
          re[(b * Tn + tt) * J + j] += g;
          rp[(b * P + u) * J + j] += g;
        }
  const double rtol = t == DType::kFP16 ? 2e-3 : 1.6e-2;
  for (size_t i = 0; i < re.size(); ++i)
    ASSERT_NEAR(float16(ge[i], t), re[i], rtol * std::fabs(re[i]) + 1e-3) << "denc " << i;
  for (size_t i = 0; i < rp.size(); ++i)
    ASSERT_NEAR(float16(gp[i], t), rp[i], rtol * std::fabs(rp[i]) + 1e-3) << "dpred " << i;
}

INSTANTIATE_TEST_SUITE_P(Types, RnntKernels, ::testing::Values(DType::kFP16, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace replay::rnnt

// ---- The EMA of the weights ---------------------------------------------------------------------

namespace replay::rnnt {
namespace {

TEST(RnntKernelsEma, MatchesTheHostFormula) {
  const int64_t n = 5003;
  std::mt19937 g(21);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> ema(static_cast<size_t>(n)), w(static_cast<size_t>(n));
  for (float& x : ema) x = d(g);
  for (float& x : w) x = d(g);
  Dev<float> de(ema), dw(w);
  const float decay = 0.999f;
  ema_update(de.p, dw.p, n, decay, nullptr);
  const std::vector<float> got = de.down();
  for (int64_t i = 0; i < n; ++i) {
    const double want = decay * static_cast<double>(ema[i]) + (1.0 - decay) * w[i];
    ASSERT_NEAR(got[i], want, 1e-6 * (std::fabs(want) + 1.0)) << i;
  }
}

}  // namespace
}  // namespace replay::rnnt

// ---- Greedy decoding's kernels against a CPU model of one step ----------------------------------

namespace replay::rnnt {
namespace {

TEST_P(RnntKernels, DecodeStepMatchesTheCpuRules) {
  const DType t = GetParam();
  DecodeShape s;
  s.batch = 6, s.vocab = 40, s.layers = 2, s.hidden = 24, s.blank = 39;
  s.max_per_frame = 3, s.max_symbols = 5;
  const int64_t B = s.batch, V = s.vocab, L = s.layers, H = s.hidden, Tn = 4, J = 16;
  Dev<int32_t> ints(static_cast<size_t>(5 * B + 1)), tokens(static_cast<size_t>(B * 5)),
      lens(static_cast<size_t>(B));
  DecodeState st;
  st.label = ints.p, st.frame = ints.p + B, st.at_frame = ints.p + 2 * B;
  st.active = ints.p + 3 * B, st.flag = ints.p + 5 * B, st.tokens = tokens.p, st.lengths = lens.p;
  const std::vector<int32_t> frames = {4, 0, 2, 1, 3, 4};  // utterance 1 is empty
  Dev<int32_t> dframes(frames);
  Dev<uint16_t> h(static_cast<size_t>(L * B * H)), c(static_cast<size_t>(L * B * H));
  decode_init(st, h.p, c.p, t, dframes.p, s, nullptr);
  std::vector<int32_t> hi = ints.down();
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(hi[b], s.blank);
    EXPECT_EQ(hi[3 * B + b], frames[b] > 0 ? 1 : 0);
  }
  EXPECT_EQ(hi[5 * B], 1);
  for (uint16_t x : h.down()) ASSERT_EQ(float16(x, t), 0.0f);
  for (int32_t k : tokens.down()) ASSERT_EQ(k, -1);  // the hypotheses start empty

  // The embedding row of each label, and the joint at each utterance's frame: bitwise.
  const std::vector<uint16_t> table = random16(static_cast<size_t>(V * H), t, 11);
  Dev<uint16_t> dtable(table), x(static_cast<size_t>(B * H));
  std::vector<int32_t> lab = {0, 5, 39, 17, 2, 38};
  Dev<int32_t> dlab(lab);
  decode_embed(x.p, dtable.p, dlab.p, t, s, H, nullptr);
  const std::vector<uint16_t> xh = x.down();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < H; ++j) ASSERT_EQ(xh[b * H + j], table[lab[b] * H + j]);
  const std::vector<uint16_t> enc = random16(static_cast<size_t>(B * Tn * J), t, 12);
  const std::vector<uint16_t> q = random16(static_cast<size_t>(B * J), t, 13);
  std::vector<int32_t> fr = {0, 3, 1, 7, 2, 3};  // 7 is clamped to T - 1
  Dev<uint16_t> denc(enc), dq(q), hj(static_cast<size_t>(B * J));
  Dev<int32_t> dfr(fr);
  decode_joint(hj.p, denc.p, dq.p, dfr.p, t, B, Tn, J, nullptr);
  const std::vector<uint16_t> hjh = hj.down();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < J; ++j) {
      const int64_t tt = std::min<int64_t>(fr[b], Tn - 1);
      const float sum = float16(enc[(b * Tn + tt) * J + j], t) + float16(q[b * J + j], t);
      ASSERT_EQ(hjh[b * J + j], bits16(sum > 0.0f ? sum : 0.0f, t)) << b << " " << j;
    }

  // Updates from a hand-set state: the argmax (ties to the lowest index), emit or advance, the
  // per-frame and per-utterance limits, the committed LSTM state, the flag.
  std::vector<int32_t> state(static_cast<size_t>(5 * B + 1), 0);
  auto set = [&](int64_t b, int32_t label, int32_t frame, int32_t at, int32_t active) {
    state[b] = label, state[B + b] = frame, state[2 * B + b] = at, state[3 * B + b] = active;
  };
  set(0, 39, 0, 0, 1);  // emits 7 (a tie with 9: the lowest index wins)
  set(1, 39, 0, 0, 0);  // inactive: untouched
  set(2, 39, 1, 0, 1);  // blank wins: advances to frame 2 = its length, done
  set(3, 4, 0, 2, 1);   // emits its third symbol at this frame: advances to 1 = its length, done
  set(4, 39, 0, 0, 1);  // its transcript is full after this symbol (length 4 of 5): done
  set(5, 39, 1, 0, 1);  // emits
  ints.up(state);
  std::vector<int32_t> len0 = {0, 0, 0, 2, 4, 1};
  lens.up(len0);
  std::vector<float> logits(static_cast<size_t>(B * V));
  std::mt19937 g(14);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (float& v : logits) v = d(g);
  const int32_t winner[6] = {7, 3, 39, 12, 20, 0};
  for (int64_t b = 0; b < B; ++b) logits[b * V + winner[b]] = 5.0f;
  logits[0 * V + 9] = 5.0f;  // the tie
  std::vector<uint16_t> lg(logits.size());
  for (size_t i = 0; i < lg.size(); ++i) lg[i] = bits16(logits[i], t);
  Dev<uint16_t> dlg(lg);
  const std::vector<uint16_t> hy = random16(static_cast<size_t>(L * B * H), t, 15);
  const std::vector<uint16_t> cy = random16(static_cast<size_t>(L * B * H), t, 16);
  Dev<uint16_t> dhy(hy), dcy(cy);
  const std::vector<int32_t> ulen = {4, 0, 2, 1, 3, 4};
  Dev<int32_t> dulen(ulen);
  decode_update(st, dlg.p, h.p, c.p, dhy.p, dcy.p, t, dulen.p, s, nullptr);
  const std::vector<int32_t> out = ints.down(), ln = lens.down(), tk = tokens.down();
  const std::vector<uint16_t> hh = h.down(), ch = c.down();
  struct Want {
    int32_t label, frame, at, active, len, token;
    bool commit;
  };
  const Want want[6] = {{7, 0, 1, 1, 1, 7, true},    {39, 0, 0, 0, 0, -1, false},
                        {39, 2, 0, 0, 0, -1, false}, {12, 1, 0, 0, 3, 12, true},
                        {20, 0, 1, 0, 5, 20, true},  {0, 1, 1, 1, 2, 0, true}};
  for (int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE(b);
    EXPECT_EQ(out[b], want[b].label);
    EXPECT_EQ(out[B + b], want[b].frame);
    EXPECT_EQ(out[2 * B + b], want[b].at);
    EXPECT_EQ(out[3 * B + b], want[b].active);
    EXPECT_EQ(ln[b], want[b].len);
    if (want[b].token >= 0) EXPECT_EQ(tk[b * 5 + ln[b] - 1], want[b].token);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < H; ++j) {
        const size_t i = static_cast<size_t>((l * B + b) * H + j);
        ASSERT_EQ(hh[i], want[b].commit ? hy[i] : bits16(0.0f, t));
        ASSERT_EQ(ch[i], want[b].commit ? cy[i] : bits16(0.0f, t));
      }
  }
  EXPECT_EQ(out[5 * B], 1);  // utterances 0 and 5 are still active

  // The store: slot counter mod slots, then the counter advances.
  Dev<int32_t> otk(static_cast<size_t>(2 * B * 5)), oln(static_cast<size_t>(2 * B)),
      counter(std::vector<int32_t>{3});
  decode_store(otk.p, oln.p, counter.p, 2, st, s, nullptr);
  const std::vector<int32_t> ol = oln.down();
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(ol[B + b], ln[b]);  // slot 3 mod 2 = 1
  EXPECT_EQ(counter.down()[0], 4);
}

}  // namespace
}  // namespace replay::rnnt

// ---- The device stopwatch against CUDA events ---------------------------------------------------

namespace replay::rnnt {
namespace {

__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// mark(-1) spin 2 ms, mark(0), spin 1 ms, mark(1), spin 0.5 ms, mark(-1), spin 3 ms, mark(0):
// slot 0 holds 5 ms, slot 1 1 ms, and the 0.5 ms between went nowhere.
void clock_sequence(uint64_t* clock, cudaStream_t s) {
  clock_mark(clock, -1, 2, s);
  spin_kernel<<<1, 1, 0, s>>>(2000000);
  clock_mark(clock, 0, 2, s);
  spin_kernel<<<1, 1, 0, s>>>(1000000);
  clock_mark(clock, 1, 2, s);
  spin_kernel<<<1, 1, 0, s>>>(500000);
  clock_mark(clock, -1, 2, s);
  spin_kernel<<<1, 1, 0, s>>>(3000000);
  clock_mark(clock, 0, 2, s);
}

TEST(RnntKernelsClock, SumsPhasesEagerAndInGraphs) {
  cudaStream_t s = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  REPLAY_CUDA_CHECK(cudaEventCreate(&e0));
  REPLAY_CUDA_CHECK(cudaEventCreate(&e1));
  Dev<uint64_t> clock(std::vector<uint64_t>{0, 0, 0});
  // Once untimed: the first launch of each kernel loads its module (lazy loading), a gap on the
  // host that the marks would count.
  clock_sequence(clock.p, s);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  clock.up({0, 0, 0});
  REPLAY_CUDA_CHECK(cudaEventRecord(e0, s));
  clock_sequence(clock.p, s);
  REPLAY_CUDA_CHECK(cudaEventRecord(e1, s));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  float ms = 0;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<uint64_t> c = clock.down();
  // The spins are lower bounds; launch gaps between kernels add a little (well under 0.3 ms).
  EXPECT_GE(c[1], 5000000u);
  EXPECT_LT(c[1], 5300000u);
  EXPECT_GE(c[2], 1000000u);
  EXPECT_LT(c[2], 1300000u);
  // Against the events: the whole sequence, 6.5 ms, holds both slots and the unassigned 0.5 ms.
  EXPECT_GE(ms * 1e6, static_cast<double>(c[1] + c[2]) + 500000.0 - 50000.0);
  EXPECT_LT(ms, 7.5f);

  // Captured into a graph and replayed twice: the slots keep adding.
  clock.up({0, 0, 0});
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  clock_sequence(clock.p, s);
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  REPLAY_CUDA_CHECK(cudaGraphLaunch(ge, s));
  REPLAY_CUDA_CHECK(cudaGraphLaunch(ge, s));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  c = clock.down();
  EXPECT_GE(c[1], 10000000u);
  EXPECT_LT(c[1], 10600000u);
  EXPECT_GE(c[2], 2000000u);
  EXPECT_LT(c[2], 2600000u);
  EXPECT_THROW(clock_mark(clock.p, 2, 2, s), Error);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace replay::rnnt
