// GPU tests of the cuBLASLt GEMM layer against the fp64 reference: every layout, every epilogue,
// batched and padded layouts, beta 1 accumulation into fp32, fp16 and fp8 inputs, the linear-layer
// triplet, a GPT-3-sized shape (sampled), bitwise reproducibility (same plan, fresh plan, graph
// replay), the epilogue support table, autotune, the plan cache, and clear errors at plan and call
// time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/context.h"
#include "common/gemm.h"
#include "common/reference/gemm.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using test::DeviceBuffer;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // GemmOptions' default limit: every plan fits

// Host encoding of float values into a storage type, and back.
std::vector<uint8_t> encode(DType t, const std::vector<float>& x) {
  const size_t es = dtype_size(t);
  std::vector<uint8_t> out(x.size() * es);
  for (size_t i = 0; i < x.size(); ++i) {
    uint8_t* p = out.data() + i * es;
    if (t == DType::kBF16) {
      const __nv_bfloat16 v = __float2bfloat16_rn(x[i]);
      std::memcpy(p, &v, es);
    } else if (t == DType::kFP16) {
      const __half v = __float2half_rn(x[i]);
      std::memcpy(p, &v, es);
    } else if (t == DType::kFP8E4M3) {
      const __nv_fp8_e4m3 v(x[i]);
      std::memcpy(p, &v, es);
    } else {
      std::memcpy(p, &x[i], es);
    }
  }
  return out;
}

std::vector<float> decode(DType t, const std::vector<uint8_t>& bytes) {
  const size_t es = dtype_size(t);
  std::vector<float> out(bytes.size() / es);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t* p = bytes.data() + i * es;
    if (t == DType::kBF16) {
      __nv_bfloat16 v;
      std::memcpy(&v, p, es);
      out[i] = __bfloat162float(v);
    } else if (t == DType::kFP16) {
      __half v;
      std::memcpy(&v, p, es);
      out[i] = __half2float(v);
    } else if (t == DType::kFP8E4M3) {
      __nv_fp8_e4m3 v;
      std::memcpy(&v, p, es);
      out[i] = static_cast<float>(v);
    } else {
      std::memcpy(&out[i], p, es);
    }
  }
  return out;
}

// Random values exactly representable in `t` (what the GPU reads is what the reference reads).
std::vector<float> random_in(DType t, size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return decode(t, encode(t, test::random_uniform(n, seed, lo, hi)));
}

// A typed device buffer; starts as 0xFF bytes (NaN in every float type).
class Buf {
 public:
  Buf(DType t, size_t n) : type_(t), dev_(n * dtype_size(t)) {}
  Buf(DType t, const std::vector<float>& values) : Buf(t, values.size()) {
    dev_.upload(encode(t, values));
  }
  void* get() const { return dev_.get(); }
  std::vector<uint8_t> bytes() const { return dev_.download(); }
  void poison() const { REPLAY_CUDA_CHECK(cudaMemset(dev_.get(), 0xFF, dev_.size())); }
  void upload(const std::vector<float>& values) { dev_.upload(encode(type_, values)); }

 private:
  DType type_;
  DeviceBuffer<uint8_t> dev_;
};

const char* tolerance_key(DType t) {
  return t == DType::kFP32 ? "gemm.fp32" : "gemm.bf16";
}
// fp8 products accumulate on Hopper's tensor cores with less than fp32 precision, whatever D is.
const char* tolerance_key(const GemmDesc& g) {
  return g.a_type == DType::kFP8E4M3 ? "gemm.fp8" : tolerance_key(g.d_type);
}

size_t a_elems(const GemmDesc& g) {
  return size_t((g.batch - 1) * g.stride_a + g.a_rows() * g.lda);
}
size_t b_elems(const GemmDesc& g) {
  return size_t((g.batch - 1) * g.stride_b + g.b_rows() * g.ldb);
}
size_t d_elems(const GemmDesc& g) {
  return size_t((g.batch - 1) * g.stride_d + g.m * g.ldd);
}

class GemmGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ctx_ = std::make_unique<Context>();
    cache_ = std::make_unique<GemmCache>(*ctx_);
    workspace_ = std::make_unique<DeviceBuffer<uint8_t>>(kWorkspaceBytes);
  }
  static void TearDownTestSuite() {
    workspace_.reset();
    cache_.reset();
    ctx_.reset();
  }
  static Context& ctx() { return *ctx_; }
  static GemmCache& cache() { return *cache_; }
  static cudaStream_t stream() { return ctx_->stream(); }

  static inline std::unique_ptr<Context> ctx_;
  static inline std::unique_ptr<GemmCache> cache_;
  static inline std::unique_ptr<DeviceBuffer<uint8_t>> workspace_;

 public:
  static GemmArgs with_workspace(GemmArgs args) {
    args.workspace = workspace_->get();
    args.workspace_bytes = kWorkspaceBytes;
    return args;
  }
};

struct Outputs {
  std::vector<uint8_t> d, aux, bias_grad;
};

// One GEMM problem with random inputs on the device, its outputs, and the check against the
// reference.
class Problem {
 public:
  Problem(const GemmDesc& desc, uint64_t seed, bool separate_c = false)
      : g_(desc.normalized()), separate_c_(separate_c) {
    const Epilogue e = g_.epilogue;
    a_ = random_in(g_.a_type, a_elems(g_), seed);
    b_ = random_in(g_.b_type, b_elems(g_), seed + 1);
    da_ = std::make_unique<Buf>(g_.a_type, a_);
    db_ = std::make_unique<Buf>(g_.b_type, b_);
    dd_ = std::make_unique<Buf>(g_.d_type, d_elems(g_));
    if (g_.beta != 0.0f) {
      c_ = random_in(g_.d_type, d_elems(g_), seed + 2);
      if (separate_c_) dc_ = std::make_unique<Buf>(g_.d_type, c_);
    }
    const size_t bias_n = size_t(epilogue_bias_length(e, g_.m, g_.n));
    if (epilogue_reads_bias(e)) {
      bias_ = random_in(g_.bias_type, bias_n, seed + 3);
      dbias_ = std::make_unique<Buf>(g_.bias_type, bias_);
    }
    if (epilogue_writes_bias_grad(e)) dbgrad_ = std::make_unique<Buf>(g_.bias_type, bias_n);
    const size_t aux_n = size_t(g_.batch * g_.m * g_.n);
    if (epilogue_reads_aux(e)) {
      aux_in_ = random_in(g_.d_type, aux_n, seed + 4, -3.0f, 3.0f);
      daux_ = std::make_unique<Buf>(g_.d_type, aux_in_);
    }
    if (epilogue_writes_aux(e)) daux_ = std::make_unique<Buf>(g_.d_type, aux_n);
    reset_outputs();
  }

  GemmArgs args() const {
    GemmArgs a;
    a.a = da_->get(), a.b = db_->get(), a.d = dd_->get();
    if (dc_) a.c = dc_->get();
    if (dbias_) a.bias = dbias_->get();
    if (dbgrad_) a.bias_grad = dbgrad_->get();
    if (daux_) a.aux = daux_->get();
    return GemmGpu::with_workspace(a);
  }

  // D back to its initial contents (poison, or C when accumulating in place); outputs poisoned.
  void reset_outputs() const {
    if (g_.beta != 0.0f && !separate_c_) {
      dd_->upload(c_);
    } else {
      dd_->poison();
    }
    if (dbgrad_) dbgrad_->poison();
    if (daux_ && epilogue_writes_aux(g_.epilogue)) daux_->poison();
    // Uploads and memsets ran on the legacy stream; the GEMM runs on a non-blocking one.
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  }

  Outputs download() const {
    Outputs o;
    o.d = dd_->bytes();
    if (daux_ && epilogue_writes_aux(g_.epilogue)) o.aux = daux_->bytes();
    if (dbgrad_) o.bias_grad = dbgrad_->bytes();
    return o;
  }

  Outputs run(GemmPlan& plan, cudaStream_t stream) const {
    reset_outputs();
    plan.run(stream, args());
    return download();
  }

  void check(const Outputs& out) const {
    const GemmDesc& g = g_;
    const std::string what = describe(g);
    const size_t nd = d_elems(g);
    std::vector<double> a = test::to_double(a_), b = test::to_double(b_), c = test::to_double(c_);
    std::vector<double> bias = test::to_double(bias_), aux_in = test::to_double(aux_in_);
    std::vector<double> d(nd), aux(size_t(g.batch * g.m * g.n)),
        bgrad(size_t(epilogue_bias_length(g.epilogue, g.m, g.n)));
    ref::GemmRefArgs r;
    r.a = a.data(), r.b = b.data(), r.d = d.data();
    if (g.beta != 0.0f) r.c = c.data();
    if (epilogue_reads_bias(g.epilogue)) r.bias = bias.data();
    if (epilogue_reads_aux(g.epilogue)) r.aux_in = aux_in.data();
    if (epilogue_writes_aux(g.epilogue)) r.aux_out = aux.data();
    if (epilogue_writes_bias_grad(g.epilogue)) r.bias_grad = bgrad.data();
    ref::gemm(g, r);

    // D inside the matrices against the reference; every other element of the buffer unchanged.
    const std::vector<float> got_all = decode(g.d_type, out.d);
    const std::vector<uint8_t> initial = g.beta != 0.0f && !separate_c_
                                             ? encode(g.d_type, c_)
                                             : std::vector<uint8_t>(out.d.size(), 0xFF);
    std::vector<bool> inside(nd, false);
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t bt = 0; bt < g.batch; ++bt)
      for (int64_t i = 0; i < g.m; ++i)
        for (int64_t j = 0; j < g.n; ++j) {
          const size_t idx = size_t(bt * g.stride_d + i * g.ldd + j);
          inside[idx] = true;
          got.push_back(got_all[idx]);
          want.push_back(d[idx]);
        }
    EXPECT_TRUE(test::all_close(what + " D", got, want, test::tolerance(tolerance_key(g))));
    const size_t es = dtype_size(g.d_type);
    for (size_t idx = 0; idx < nd; ++idx) {
      if (inside[idx]) continue;
      ASSERT_EQ(std::memcmp(out.d.data() + idx * es, initial.data() + idx * es, es), 0)
          << what << ": D element " << idx << " outside the matrices was written";
    }
    if (epilogue_writes_aux(g.epilogue)) {
      EXPECT_TRUE(test::all_close(what + " aux", decode(g.d_type, out.aux), aux,
                                  test::tolerance(tolerance_key(g.d_type))));
    }
    if (g.epilogue == Epilogue::kDGeluBGrad) {
      // cuBLASLt sums the epilogue's output after rounding it to D's type, so each of the m
      // summands carries D's rounding error: allow 2^-8 (bf16) of the column's sum of magnitudes on
      // top.
      const std::vector<float> got_bgrad = decode(g.bias_type, out.bias_grad);
      const test::Tolerance tol = test::tolerance(tolerance_key(g.bias_type));
      const double unit = g.d_type == DType::kFP32   ? 0.0
                          : g.d_type == DType::kFP16 ? 1.0 / 2048
                                                     : 1.0 / 256;
      for (int64_t j = 0; j < g.n; ++j) {
        double magnitude = 0;
        for (int64_t i = 0; i < g.m; ++i) magnitude += std::fabs(d[size_t(i * g.ldd + j)]);
        const double allowed = tol.atol + tol.rtol * std::fabs(bgrad[j]) + unit * magnitude;
        EXPECT_LE(std::fabs(got_bgrad[j] - bgrad[j]), allowed)
            << what << " bias_grad[" << j << "] got " << got_bgrad[j] << " ref " << bgrad[j];
      }
    } else if (epilogue_writes_bias_grad(g.epilogue)) {
      EXPECT_TRUE(test::all_close(what + " bias_grad", decode(g.bias_type, out.bias_grad), bgrad,
                                  test::tolerance(tolerance_key(g.bias_type))));
    }
  }

 private:
  GemmDesc g_;
  bool separate_c_;
  std::vector<float> a_, b_, c_, bias_, aux_in_;
  std::unique_ptr<Buf> da_, db_, dc_, dd_, dbias_, dbgrad_, daux_;
};

GemmDesc make(int64_t m, int64_t n, int64_t k, bool ta, bool tb, Epilogue e = Epilogue::kNone,
              DType d_type = DType::kBF16) {
  GemmDesc g;
  g.m = m, g.n = n, g.k = k, g.trans_a = ta, g.trans_b = tb, g.epilogue = e, g.d_type = d_type;
  return g;
}

void run_and_check(GemmCache& cache, const GemmDesc& desc, uint64_t seed, cudaStream_t stream,
                   bool separate_c = false) {
  SCOPED_TRACE(describe(desc));
  const Problem p(desc, seed, separate_c);
  p.check(p.run(cache.get(desc), stream));
}

// m, n, k: multiples of 8 (16-byte rows for 16-bit types), none a multiple of 64.
constexpr int64_t kM = 136, kN = 200, kK = 72, kTokens = 264;

TEST_F(GemmGpu, EveryLayout) {
  uint64_t seed = 100;
  for (DType d_type : {DType::kBF16, DType::kFP32})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        run_and_check(cache(), make(kM, kN, kK, ta, tb, Epilogue::kNone, d_type), seed++, stream());
}

TEST_F(GemmGpu, Fp16AndFp8Inputs) {
  for (DType d_type : {DType::kFP16, DType::kFP32}) {
    GemmDesc g = make(kM, kN, kK, false, false, Epilogue::kNone, d_type);
    g.a_type = g.b_type = DType::kFP16;
    run_and_check(cache(), g, 200, stream());
  }
  for (DType d_type : {DType::kBF16, DType::kFP32}) {
    GemmDesc g = make(128, 192, 256, false, true, Epilogue::kNone, d_type);  // fp8 runs as X W^T
    g.a_type = g.b_type = DType::kFP8E4M3;
    run_and_check(cache(), g, 210, stream());
  }
}

TEST_F(GemmGpu, ForwardEpilogues) {
  uint64_t seed = 300;
  for (Epilogue e : {Epilogue::kBias, Epilogue::kGelu, Epilogue::kGeluAux, Epilogue::kBiasGelu,
                     Epilogue::kBiasGeluAux})
    run_and_check(cache(), make(kM, kN, kK, false, true, e), seed++, stream());
}

TEST_F(GemmGpu, BackwardEpilogues) {
  // dgrad through the GeLU: dH[T,4C] = dY W2, times gelu'(aux), and fc1's bias gradient.
  run_and_check(cache(), make(kM, kN, kK, false, false, Epilogue::kDGelu), 400, stream());
  run_and_check(cache(), make(kM, kN, kK, false, false, Epilogue::kDGeluBGrad), 401, stream());
  // wgrad dW[out,in] = dY^T X with db[out] = column sums of dY: fp32 (as linear_gemms) and bf16.
  GemmDesc w = make(kN, kM, kTokens, true, false, Epilogue::kBGradA, DType::kFP32);
  w.bias_type = DType::kFP32;
  run_and_check(cache(), w, 402, stream());
  run_and_check(cache(), make(kN, kM, kTokens, true, false, Epilogue::kBGradA), 403, stream());
}

// The transposed wgrad, dW^T[in,out] = X^T dY, takes the bias gradient from B. cuBLASLt's support
// for this side is not documented for every layout: a refusal at plan time is reported as a skip.
TEST_F(GemmGpu, BiasGradientFromB) {
  GemmDesc g = make(kM, kN, kTokens, true, false, Epilogue::kBGradB, DType::kFP32);
  g.bias_type = DType::kFP32;
  try {
    cache().get(g);
  } catch (const Error& e) {
    GTEST_SKIP() << "cuBLASLt refuses it at plan time: " << e.what();
  }
  run_and_check(cache(), g, 450, stream());
}

TEST_F(GemmGpu, Batched) {
  GemmDesc plain = make(kM, kN, kK, false, false);
  plain.batch = 3;
  run_and_check(cache(), plain, 500, stream());
  for (Epilogue e : {Epilogue::kBias, Epilogue::kGeluAux}) {  // bias broadcast over the batch
    GemmDesc g = make(kM, kN, kK, false, true, e);
    g.batch = 3;
    run_and_check(cache(), g, 510, stream());
  }
  // Padded rows and gaps between the matrices of the batch (all multiples of 8 elements).
  GemmDesc g = make(72, 88, 56, false, false);
  g.batch = 3;
  g.lda = 64, g.ldb = 96, g.ldd = 104;
  g.stride_a = 72 * 64 + 64, g.stride_b = 56 * 96 + 32, g.stride_d = 72 * 104 + 8;
  run_and_check(cache(), g, 520, stream());
}

TEST_F(GemmGpu, AccumulateIntoFp32) {
  for (Epilogue e : {Epilogue::kNone, Epilogue::kBGradA}) {
    GemmDesc g = make(kN, kM, kTokens, true, false, e, DType::kFP32);
    g.bias_type = DType::kFP32;
    g.beta = 1.0f;
    run_and_check(cache(), g, 600, stream(), /*separate_c=*/false);  // dW += dY^T X in place
    run_and_check(cache(), g, 601, stream(), /*separate_c=*/true);   // D = dY^T X + C
  }
}

TEST_F(GemmGpu, LinearLayerTriplet) {
  const LinearGemms lin = linear_gemms(/*tokens=*/256, /*in=*/192, /*out=*/320, /*bias=*/true,
                                       /*accumulate_wgrad=*/true);
  run_and_check(cache(), lin.forward, 700, stream());
  run_and_check(cache(), lin.dgrad, 701, stream());
  run_and_check(cache(), lin.wgrad, 702, stream());
  for (const GemmDesc* g : {&lin.forward, &lin.dgrad, &lin.wgrad})
    EXPECT_LE(cache().get(*g).workspace_bytes(), cache().max_workspace_bytes());
}

// GPT-3 175B at TP4, QKV forward: [2048,12288] x [9216,12288]^T. Checked on a 16 x 16 sample of the
// output (rows and columns drawn at random) and run twice for bitwise equality.
TEST_F(GemmGpu, Gpt3ShapeSampled) {
  const int64_t m = 2048, n = 9216, k = 12288, s = 16;
  const GemmDesc g = make(m, n, k, false, true);
  GemmPlan& plan = cache().get(g);
  std::printf("%s: %s\n", describe(g).c_str(), plan.algo_info().to_string().c_str());
  const std::vector<float> x = random_in(DType::kBF16, size_t(m * k), 800);
  const std::vector<float> w = random_in(DType::kBF16, size_t(n * k), 801);
  const Buf dx(DType::kBF16, x), dw(DType::kBF16, w), dd(DType::kBF16, size_t(m * n));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  GemmArgs args;
  args.a = dx.get(), args.b = dw.get(), args.d = dd.get();
  plan.run(stream(), with_workspace(args));
  const std::vector<uint8_t> first = dd.bytes();
  dd.poison();
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  plan.run(stream(), with_workspace(args));
  const std::vector<uint8_t> second = dd.bytes();
  EXPECT_TRUE(test::bit_equal("GPT-3 QKV D, two runs", first.data(), second.data(), first.size()));

  std::mt19937_64 gen(802);
  std::vector<int64_t> rows(s), cols(s);
  for (auto& r : rows) r = int64_t(gen() % uint64_t(m));
  for (auto& c : cols) c = int64_t(gen() % uint64_t(n));
  std::vector<double> xs(size_t(s * k)), ws(size_t(s * k)), ref_d(size_t(s * s));
  for (int64_t i = 0; i < s; ++i)
    for (int64_t kk = 0; kk < k; ++kk) {
      xs[size_t(i * k + kk)] = x[size_t(rows[size_t(i)] * k + kk)];
      ws[size_t(i * k + kk)] = w[size_t(cols[size_t(i)] * k + kk)];
    }
  ref::GemmRefArgs r;
  r.a = xs.data(), r.b = ws.data(), r.d = ref_d.data();
  ref::gemm(make(s, s, k, false, true), r);
  const std::vector<float> all = decode(DType::kBF16, first);
  std::vector<float> got(size_t(s * s));
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < s; ++j)
      got[size_t(i * s + j)] = all[size_t(rows[size_t(i)] * n + cols[size_t(j)])];
  EXPECT_TRUE(test::all_close("GPT-3 QKV D sample", got, ref_d, test::tolerance("gemm.bf16")));
}

// Shapes that invite split-K (small m, n; long k) and a bias-gradient reduction, run twice with one
// plan and once with a plan from a fresh cache: identical algorithm, identical bits.
TEST_F(GemmGpu, BitwiseReproducible) {
  GemmDesc wgrad = make(kN, kM, 8192, true, false, Epilogue::kBGradA, DType::kFP32);
  wgrad.bias_type = DType::kFP32;
  const GemmDesc descs[] = {make(64, 64, 16384, false, true),
                            make(64, 64, 16384, false, true, Epilogue::kNone, DType::kFP32),
                            make(kM, kN, 2048, false, false, Epilogue::kDGeluBGrad), wgrad};
  uint64_t seed = 900;
  for (const GemmDesc& g : descs) {
    SCOPED_TRACE(describe(g));
    GemmPlan& plan = cache().get(g);
    const GemmAlgoInfo info = plan.algo_info();
    std::printf("%s: %s\n", describe(g).c_str(), info.to_string().c_str());
    EXPECT_NE(info.reduction_scheme, uint32_t{CUBLASLT_REDUCTION_SCHEME_INPLACE})
        << "the in-place split-K scheme must never be chosen";
    if (g.d_type != DType::kFP32) {
      EXPECT_NE(info.reduction_scheme, uint32_t{CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE})
          << "a 16-bit output must not hold split-K partial sums";
    }

    const Problem p(g, seed++);
    const Outputs first = p.run(plan, stream());
    p.check(first);
    const Outputs again = p.run(plan, stream());
    GemmCache fresh(ctx());
    GemmPlan& replanned = fresh.get(g);
    EXPECT_EQ(replanned.algo_info().to_string(), info.to_string());
    const Outputs other = p.run(replanned, stream());
    for (const Outputs* o : {&again, &other}) {
      EXPECT_TRUE(test::bit_equal("D", first.d.data(), o->d.data(), first.d.size()));
      EXPECT_TRUE(test::bit_equal("bias_grad", first.bias_grad.data(), o->bias_grad.data(),
                                  first.bias_grad.size()));
    }
  }
}

TEST_F(GemmGpu, GraphReplayMatchesEager) {
  const GemmDesc g = make(256, 512, 384, false, true, Epilogue::kBiasGeluAux);
  GemmPlan& plan = cache().get(g);
  const Problem p(g, 1000);
  const Outputs eager = p.run(plan, stream());
  p.check(eager);

  p.reset_outputs();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
  plan.run(stream(), p.args());
  REPLAY_CUDA_CHECK(cudaStreamEndCapture(stream(), &graph));
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, stream()));
  const Outputs graphed = p.download();
  REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
  REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_TRUE(test::bit_equal("D", eager.d.data(), graphed.d.data(), eager.d.size()));
  EXPECT_TRUE(test::bit_equal("aux", eager.aux.data(), graphed.aux.data(), eager.aux.size()));
}

// Every epilogue in every layout: prints which ones cuBLASLt plans; the ones a transformer layer
// needs must be among them, and every refusal must be a replay::Error at plan time naming the
// problem.
TEST_F(GemmGpu, EpilogueSupportTable) {
  const Epilogue epilogues[] = {Epilogue::kNone,    Epilogue::kBias,       Epilogue::kGelu,
                                Epilogue::kGeluAux, Epilogue::kBiasGelu,   Epilogue::kBiasGeluAux,
                                Epilogue::kDGelu,   Epilogue::kDGeluBGrad, Epilogue::kBGradA,
                                Epilogue::kBGradB};
  const std::pair<const char*, std::pair<bool, bool>> layouts[] = {
      {"NN", {false, false}}, {"NT", {false, true}}, {"TN", {true, false}}, {"TT", {true, true}}};
  const std::set<std::pair<Epilogue, std::string>> needed = {
      {Epilogue::kNone, "NN"},  {Epilogue::kNone, "NT"},       {Epilogue::kNone, "TN"},
      {Epilogue::kBias, "NT"},  {Epilogue::kGeluAux, "NT"},    {Epilogue::kBiasGeluAux, "NT"},
      {Epilogue::kDGelu, "NN"}, {Epilogue::kDGeluBGrad, "NN"}, {Epilogue::kBGradA, "TN"}};
  std::string table = "epilogue        NN      NT      TN      TT\n";
  for (Epilogue e : epilogues) {
    char row[128];
    std::snprintf(row, sizeof(row), "%-15s", epilogue_name(e));
    table += row;
    for (const auto& [name, t] : layouts) {
      const GemmDesc g = make(256, 256, 256, t.first, t.second, e);
      std::string cell = "ok";
      try {
        GemmPlan plan(ctx().cublaslt(), g);
      } catch (const Error& err) {
        cell = "refused";
        const std::string msg = err.what();
        EXPECT_NE(msg.find(describe(g)), std::string::npos) << msg;
        EXPECT_EQ(needed.count({e, name}), 0u) << "needed but refused: " << msg;
      }
      std::snprintf(row, sizeof(row), " %-7s", cell.c_str());
      table += row;
    }
    table += "\n";
  }
  std::printf("cuBLASLt %zu, bf16 in/out, 256^3:\n%s", cublasLtGetVersion(), table.c_str());
}

TEST_F(GemmGpu, Autotune) {
  GemmOptions options;
  options.selection = GemmAlgoSelection::kAutotune;
  options.autotune_candidates = 4;
  GemmCache tuned(ctx(), options);
  const GemmDesc g = make(512, 768, 1024, false, true, Epilogue::kBias);
  GemmPlan& plan = tuned.get(g);
  EXPECT_GE(plan.candidate_count(), 1);
  EXPECT_LE(plan.candidate_count(), 4);
  const Problem p(g, 1100);
  plan.autotune(stream(), p.args());
  std::printf("autotuned %s: %s\n", describe(g).c_str(), plan.algo_info().to_string().c_str());
  EXPECT_LE(plan.algo_info().workspace_bytes, plan.workspace_bytes());
  p.check(p.run(plan, stream()));
  // The default (heuristic) plan refuses to autotune.
  EXPECT_THROW(cache().get(g).autotune(stream(), p.args()), Error);
}

TEST_F(GemmGpu, CacheKeysAndSeal) {
  GemmCache c(ctx());
  const GemmDesc g = make(kM, kN, kK, false, true);
  GemmDesc explicit_ld = g;
  explicit_ld.lda = kK, explicit_ld.ldb = kK, explicit_ld.ldd = kN;
  GemmPlan& p1 = c.get(g);
  EXPECT_EQ(&c.get(explicit_ld), &p1) << "packed and explicit leading dimensions are one problem";
  GemmPlan& p2 = c.get(make(kM, kN, kK, false, false));
  EXPECT_NE(&p1, &p2);
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.max_workspace_bytes(), std::max(p1.workspace_bytes(), p2.workspace_bytes()));
  c.seal();
  EXPECT_EQ(&c.get(g), &p1);
  try {
    c.get(make(kM, kN, kK, true, false));
    ADD_FAILURE() << "a sealed cache built a plan";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sealed"), std::string::npos) << e.what();
  }
}

TEST_F(GemmGpu, PlanErrorsAreClear) {
  auto expect_refused = [&](const GemmDesc& g, const std::string& needle) {
    try {
      GemmPlan plan(ctx().cublaslt(), g);
      ADD_FAILURE() << "accepted " << describe(g);
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
      EXPECT_NE(msg.find(describe(g)), std::string::npos) << msg;
    }
  };
  GemmDesc fp8 = make(128, 128, 128, false, false);
  fp8.a_type = fp8.b_type = DType::kFP8E4M3;
  expect_refused(fp8, "(trans_b)");
  GemmDesc acc_gelu = make(128, 128, 128, false, true, Epilogue::kGeluAux);
  acc_gelu.beta = 1.0f;
  expect_refused(acc_gelu, "beta 1");
  GemmDesc half_beta = make(128, 128, 128, false, false);
  half_beta.beta = 0.5f;
  expect_refused(half_beta, "beta must be 0 or 1");
  expect_refused(make(128, 128, 100, false, false), "16 bytes");  // lda = 100 bf16 = 200 bytes
  GemmDesc batched_bgrad = make(128, 128, 128, true, false, Epilogue::kBGradA);
  batched_bgrad.batch = 2;
  expect_refused(batched_bgrad, "batch 1");
  GemmDesc mixed = make(128, 128, 128, false, false);
  mixed.a_type = mixed.b_type = DType::kFP16;  // fp16 inputs cannot produce bf16
  expect_refused(mixed, "D must be");
  expect_refused(make(128, 100, 128, false, true, Epilogue::kGeluAux, DType::kFP32),
                 "multiple of 8");
  GemmDesc loose = make(128, 128, 128, false, false);
  loose.alignment = 8;
  expect_refused(loose, "alignment");

  // Call-time checks happen on the host, before anything is enqueued.
  const GemmDesc g = make(128, 128, 128, false, true, Epilogue::kBias);
  GemmPlan& plan = cache().get(g);
  const Problem p(g, 1200);
  auto expect_call_error = [&](GemmArgs args, const std::string& needle) {
    try {
      plan.run(stream(), args);
      ADD_FAILURE() << "run accepted bad arguments";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GemmArgs no_bias = p.args();
  no_bias.bias = nullptr;
  expect_call_error(no_bias, "bias must be given");
  GemmArgs misaligned = p.args();
  misaligned.a = static_cast<const char*>(misaligned.a) + 16;
  expect_call_error(misaligned, "aligned");
  GemmArgs stray_c = p.args();
  stray_c.c = stray_c.d;
  expect_call_error(stray_c, "C is only read with beta 1");
  if (plan.workspace_bytes() > 0) {
    GemmArgs small = p.args();
    small.workspace_bytes = plan.workspace_bytes() - 1;
    expect_call_error(small, "workspace");
  }
}

}  // namespace
}  // namespace replay
