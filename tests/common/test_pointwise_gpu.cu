// GPU pointwise and normalization kernels against their fp64 CPU references through the tolerance
// table: narrow and wide rows (up to 16384 and 32768), odd row counts, outputs poisoned before
// every launch (DeviceBuffer starts as NaN) so an element left unwritten fails; deterministic
// backward sums; dropout masks bit-equal to the host's Philox draws.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/kernels/activations.h"
#include "common/kernels/dropout.h"
#include "common/kernels/norms.h"
#include "common/kernels/rope.h"
#include "common/philox.h"
#include "common/reference/pointwise.h"
#include "tests/support/compare.h"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;
using Vec = std::vector<double>;
using test::all_close;
using test::tolerance;

// A bf16 device tensor and the exact values it holds, as doubles, for the reference. Built from
// random floats (rounded to bf16) or, given only a size, an output poisoned with NaN.
struct Bf16Tensor {
  Vec host;
  test::DeviceBuffer<bf16> dev;
  explicit Bf16Tensor(const std::vector<float>& v)
      : host(test::to_double(test::round_bf16(v))), dev(test::to_bf16(v)) {}
  explicit Bf16Tensor(size_t n) : dev(n) {}
  bf16* get() const { return dev.get(); }
  std::vector<float> download() const { return test::from_bf16(dev.download()); }
};

std::vector<float> normal(size_t n, uint64_t seed, float mean = 0.0f, float stddev = 1.0f) {
  return test::random_normal(n, seed, mean, stddev);
}

// Values in +-[0.25, 2]: never zero, so a zero output element means "dropped".
std::vector<float> nonzero(size_t n, uint64_t seed) {
  std::vector<float> v = test::random_uniform(n, seed, 0.25f, 2.0f);
  const std::vector<float> sign = test::random_uniform(n, seed + 1, -1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) v[i] = sign[i] < 0 ? -v[i] : v[i];
  return v;
}

std::string shape_name(int64_t rows, int C) {
  return std::to_string(rows) + "x" + std::to_string(C);
}

struct NormShape {
  int64_t rows;
  int C;
};

// Warp-per-row and block-per-row forwards; C = 1032 leaves the last warp partly idle. The row
// counts exceed the backward's persistent grid (one block per SM for wide rows, several for narrow
// ones), so its blocks walk several rows through the cp.async ring, down to a single stage at
// 32768.
const NormShape kNormShapes[] = {{1, 8},      {7, 40},      {5000, 64},   {1000, 1024}, {9, 1032},
                                 {301, 4096}, {140, 12288}, {270, 16384}, {3, 32768}};

// ---------------------------------------------------------------------------------------------------
// LayerNorm and RMSNorm

TEST(PointwiseGpu, LayerNormForwardMatchesReference) {
  uint64_t seed = 1000;
  for (const NormShape s : kNormShapes) {
    const size_t n = s.rows * s.C;
    Bf16Tensor x(normal(n, ++seed, 0.5f, 2.0f)), gamma(normal(s.C, ++seed, 1.0f, 0.5f)),
        beta(normal(s.C, ++seed, 0.0f, 0.5f)), out(n);
    test::DeviceBuffer<float> mean(s.rows), rstd(s.rows);
    layernorm_forward(out.get(), mean.get(), rstd.get(), x.get(), gamma.get(), beta.get(), s.rows,
                      s.C, 1e-5f, nullptr);
    Vec ref(n), ref_mean(s.rows), ref_rstd(s.rows);
    ref::layernorm_forward(ref.data(), ref_mean.data(), ref_rstd.data(), x.host.data(),
                           gamma.host.data(), beta.host.data(), s.rows, s.C, 1e-5);
    const std::string at = " " + shape_name(s.rows, s.C);
    EXPECT_TRUE(
        all_close("layernorm out" + at, out.download(), ref, tolerance("layernorm.fwd.bf16")));
    EXPECT_TRUE(
        all_close("layernorm mean" + at, mean.download(), ref_mean, tolerance("stats.fp32")));
    EXPECT_TRUE(
        all_close("layernorm rstd" + at, rstd.download(), ref_rstd, tolerance("stats.fp32")));
  }
}

TEST(PointwiseGpu, RmsNormForwardMatchesReference) {
  uint64_t seed = 2000;
  for (const NormShape s : kNormShapes) {
    const size_t n = s.rows * s.C;
    Bf16Tensor x(normal(n, ++seed, 0.3f, 1.5f)), gamma(normal(s.C, ++seed, 1.0f, 0.5f)), out(n);
    test::DeviceBuffer<float> rstd(s.rows);
    rmsnorm_forward(out.get(), rstd.get(), x.get(), gamma.get(), s.rows, s.C, 1e-6f, nullptr);
    Vec ref(n), ref_rstd(s.rows);
    ref::rmsnorm_forward(ref.data(), ref_rstd.data(), x.host.data(), gamma.host.data(), s.rows, s.C,
                         1e-6);
    const std::string at = " " + shape_name(s.rows, s.C);
    EXPECT_TRUE(all_close("rmsnorm out" + at, out.download(), ref, tolerance("rmsnorm.fwd.bf16")));
    EXPECT_TRUE(all_close("rmsnorm rstd" + at, rstd.download(), ref_rstd, tolerance("stats.fp32")));
  }
}

// Runs the GPU backward (fed the GPU forward's statistics) in all four overwrite/accumulate modes
// against the reference, and checks that a second run is bit-identical.
template <bool kLayerNorm>
void check_norm_backward(const NormShape s, uint64_t seed) {
  const size_t n = s.rows * s.C;
  const char* name = kLayerNorm ? "layernorm" : "rmsnorm";
  const std::string key = kLayerNorm ? "layernorm" : "rmsnorm";
  const std::string at = std::string(" ") + name + " " + shape_name(s.rows, s.C);
  Bf16Tensor x(normal(n, seed, 0.5f, 2.0f)), gamma(normal(s.C, seed + 1, 1.0f, 0.5f)),
      beta(normal(s.C, seed + 2, 0.0f, 0.5f)), dout(normal(n, seed + 3)), y(n);
  test::DeviceBuffer<float> mean(s.rows), rstd(s.rows);
  if (kLayerNorm)
    layernorm_forward(y.get(), mean.get(), rstd.get(), x.get(), gamma.get(), beta.get(), s.rows,
                      s.C, 1e-5f, nullptr);
  else
    rmsnorm_forward(y.get(), rstd.get(), x.get(), gamma.get(), s.rows, s.C, 1e-5f, nullptr);

  Vec fwd(n), ref_mean(s.rows), ref_rstd(s.rows), ref_dx(n), ref_dgamma(s.C), ref_dbeta(s.C);
  if (kLayerNorm) {
    ref::layernorm_forward(fwd.data(), ref_mean.data(), ref_rstd.data(), x.host.data(),
                           gamma.host.data(), beta.host.data(), s.rows, s.C, 1e-5);
    ref::layernorm_backward(ref_dx.data(), ref_dgamma.data(), ref_dbeta.data(), dout.host.data(),
                            x.host.data(), gamma.host.data(), ref_mean.data(), ref_rstd.data(),
                            s.rows, s.C);
  } else {
    ref::rmsnorm_forward(fwd.data(), ref_rstd.data(), x.host.data(), gamma.host.data(), s.rows, s.C,
                         1e-5);
    ref::rmsnorm_backward(ref_dx.data(), ref_dgamma.data(), dout.host.data(), x.host.data(),
                          gamma.host.data(), ref_rstd.data(), s.rows, s.C);
  }

  const size_t ws_bytes = kLayerNorm ? layernorm_backward_workspace_bytes(s.rows, s.C)
                                     : rmsnorm_backward_workspace_bytes(s.rows, s.C);
  test::DeviceBuffer<unsigned char> ws(ws_bytes);
  std::vector<float> first_dx, first_dgamma;
  for (int mode = 0; mode < 4; ++mode) {
    const bool acc_dx = mode & 1, acc_params = mode & 2;
    const std::vector<float> dx0 = normal(n, seed + 10 + mode);
    const std::vector<float> dg0 = normal(s.C, seed + 20 + mode),
                             db0 = normal(s.C, seed + 30 + mode);
    Bf16Tensor dx = acc_dx ? Bf16Tensor(dx0) : Bf16Tensor(n);
    test::DeviceBuffer<float> dgamma(s.C), dbeta(s.C);
    if (acc_params) {
      dgamma.upload(dg0);
      dbeta.upload(db0);
    }
    if (kLayerNorm)
      layernorm_backward(dx.get(), dgamma.get(), dbeta.get(), dout.get(), x.get(), gamma.get(),
                         mean.get(), rstd.get(), s.rows, s.C, acc_dx, acc_params, ws.get(),
                         ws_bytes, nullptr);
    else
      rmsnorm_backward(dx.get(), dgamma.get(), dout.get(), x.get(), gamma.get(), rstd.get(), s.rows,
                       s.C, acc_dx, acc_params, ws.get(), ws_bytes, nullptr);

    Vec want_dx = ref_dx, want_dg = ref_dgamma, want_db = ref_dbeta;
    const std::vector<float> dx0_rounded = test::round_bf16(dx0);
    if (acc_dx)
      for (size_t i = 0; i < n; ++i) want_dx[i] += dx0_rounded[i];
    if (acc_params)
      for (int c = 0; c < s.C; ++c) {
        want_dg[c] += dg0[c];
        want_db[c] += db0[c];
      }
    const std::string m =
        at + (acc_dx ? " dx+=" : " dx=") + (acc_params ? " params+=" : " params=");
    const std::vector<float> got_dx = dx.download(), got_dg = dgamma.download();
    EXPECT_TRUE(all_close("dx" + m, got_dx, want_dx, tolerance(key + ".bwd.bf16")));
    EXPECT_TRUE(all_close("dgamma" + m, got_dg, want_dg, tolerance(key + ".bwd_param.fp32")));
    if (kLayerNorm)
      EXPECT_TRUE(
          all_close("dbeta" + m, dbeta.download(), want_db, tolerance(key + ".bwd_param.fp32")));
    if (mode == 0) {
      first_dx = got_dx;
      first_dgamma = got_dg;
    }
  }

  // Same inputs again: bit-identical gradients (fixed reduction order, no atomics).
  Bf16Tensor dx(n);
  test::DeviceBuffer<float> dgamma(s.C), dbeta(s.C);
  if (kLayerNorm)
    layernorm_backward(dx.get(), dgamma.get(), dbeta.get(), dout.get(), x.get(), gamma.get(),
                       mean.get(), rstd.get(), s.rows, s.C, false, false, ws.get(), ws_bytes,
                       nullptr);
  else
    rmsnorm_backward(dx.get(), dgamma.get(), dout.get(), x.get(), gamma.get(), rstd.get(), s.rows,
                     s.C, false, false, ws.get(), ws_bytes, nullptr);
  const std::vector<float> again_dx = dx.download(), again_dg = dgamma.download();
  EXPECT_TRUE(
      test::bit_equal("repeat dx" + at, again_dx.data(), first_dx.data(), n * sizeof(float)));
  EXPECT_TRUE(test::bit_equal("repeat dgamma" + at, again_dg.data(), first_dgamma.data(),
                              s.C * sizeof(float)));
}

TEST(PointwiseGpu, LayerNormBackwardMatchesReference) {
  uint64_t seed = 3000;
  for (const NormShape s : kNormShapes) check_norm_backward<true>(s, seed += 100);
}

TEST(PointwiseGpu, RmsNormBackwardMatchesReference) {
  uint64_t seed = 4000;
  for (const NormShape s : kNormShapes) check_norm_backward<false>(s, seed += 100);
}

TEST(PointwiseGpu, NormsRejectBadShapesAndWorkspace) {
  Bf16Tensor x(normal(64, 1)), g(normal(64, 2)), out(64);
  test::DeviceBuffer<float> rstd(8);
  EXPECT_THROW(rmsnorm_forward(out.get(), rstd.get(), x.get(), g.get(), 1, 12, 1e-5f, nullptr),
               Error);  // C not a multiple of 8
  EXPECT_THROW(rmsnorm_forward(out.get(), rstd.get(), x.get() + 1, g.get(), 1, 8, 1e-5f, nullptr),
               Error);  // misaligned
  test::DeviceBuffer<float> dg(64), ws(1);
  EXPECT_THROW(rmsnorm_backward(out.get(), dg.get(), x.get(), x.get(), g.get(), rstd.get(), 8, 8,
                                false, false, ws.get(), 4, nullptr),
               Error);  // workspace too small
}

// ---------------------------------------------------------------------------------------------------
// SwiGLU and GeLU

struct ActShape {
  int64_t M;
  int F;
};
const ActShape kActShapes[] = {{1, 8}, {7, 1376}, {33, 2048}, {5, 12288}, {3, 16384}};

TEST(PointwiseGpu, SwigluForwardAndBackwardMatchReference) {
  uint64_t seed = 5000;
  for (const ActShape s : kActShapes) {
    const size_t n_in = s.M * 2 * s.F, n_out = s.M * s.F;
    Bf16Tensor in(normal(n_in, ++seed, 0.0f, 2.0f)), dout(normal(n_out, ++seed)), out(n_out),
        din(n_in);
    swiglu_forward(out.get(), in.get(), s.M, s.F, nullptr);
    swiglu_backward(din.get(), dout.get(), in.get(), s.M, s.F, nullptr);
    Vec ref_out(n_out), ref_din(n_in);
    ref::swiglu_forward(ref_out.data(), in.host.data(), s.M, s.F);
    ref::swiglu_backward(ref_din.data(), dout.host.data(), in.host.data(), s.M, s.F);
    const std::string at = " " + shape_name(s.M, s.F);
    EXPECT_TRUE(
        all_close("swiglu out" + at, out.download(), ref_out, tolerance("swiglu.fwd.bf16")));
    EXPECT_TRUE(
        all_close("swiglu din" + at, din.download(), ref_din, tolerance("swiglu.bwd.bf16")));
  }
}

TEST(PointwiseGpu, GeluForwardAndBackwardMatchReference) {
  uint64_t seed = 6000;
  for (const ActShape s : kActShapes) {
    const size_t n = s.M * s.F * 4;
    Bf16Tensor x(normal(n, ++seed, 0.0f, 3.0f)), dout(normal(n, ++seed)), out(n), dx(n);
    gelu_forward(out.get(), x.get(), n, nullptr);
    gelu_backward(dx.get(), dout.get(), x.get(), n, nullptr);
    Vec ref_out(n), ref_dx(n);
    ref::gelu_forward(ref_out.data(), x.host.data(), n);
    ref::gelu_backward(ref_dx.data(), dout.host.data(), x.host.data(), n);
    const std::string at = " n " + std::to_string(n);
    EXPECT_TRUE(all_close("gelu out" + at, out.download(), ref_out, tolerance("gelu.fwd.bf16")));
    EXPECT_TRUE(all_close("gelu dx" + at, dx.download(), ref_dx, tolerance("gelu.bwd.bf16")));
  }
}

// ---------------------------------------------------------------------------------------------------
// RoPE

TEST(PointwiseGpu, RopeTableMatchesReference) {
  struct Case {
    int positions, rope_dim;
    double theta;
    RopeScaling scaling;
  };
  const Case cases[] = {{9000, 128, 500000.0, RopeScaling::llama31()},
                        {4096, 64, 10000.0, RopeScaling{}},
                        {300, 16, 10000.0, RopeScaling::llama31()}};
  for (const Case& c : cases) {
    const size_t half = c.rope_dim / 2, n = c.positions * half;
    test::DeviceBuffer<float2> table(n);
    rope_build_table(table.get(), c.positions, c.rope_dim, c.theta, c.scaling, nullptr);
    const std::vector<float2> got = table.download();
    Vec ref_cos(n), ref_sin(n);
    ref::rope_table(ref_cos.data(), ref_sin.data(), c.positions, c.rope_dim, c.theta, c.scaling);
    std::vector<float> got_cos(n), got_sin(n);
    for (size_t i = 0; i < n; ++i) {
      got_cos[i] = got[i].x;
      got_sin[i] = got[i].y;
    }
    const std::string at = " dim " + std::to_string(c.rope_dim) + " positions " +
                           std::to_string(c.positions) + (c.scaling.enabled ? " llama31" : "");
    EXPECT_TRUE(all_close("rope cos" + at, got_cos, ref_cos, tolerance("rope.table.fp32")));
    EXPECT_TRUE(all_close("rope sin" + at, got_sin, ref_sin, tolerance("rope.table.fp32")));
  }
}

TEST(PointwiseGpu, RopeMatchesReferenceInPlaceAndOutOfPlace) {
  struct Case {
    const char* name;
    RopeLayout layout;
    bool explicit_positions;
  };
  // Full rotation (Llama: D = 128); MLA-style partial rotation (64 of 192 channels at offset 128);
  // partial rotation inside the heads of a fused QKV output (token stride wider than the heads).
  std::vector<Case> cases;
  {
    RopeLayout l;
    l.batch = 2, l.seq = 37, l.heads = 3, l.head_dim = 128, l.rope_dim = 128;
    cases.push_back({"llama", l, false});
    cases.push_back({"llama positions", l, true});
  }
  {
    RopeLayout l;
    l.batch = 1, l.seq = 33, l.heads = 4, l.head_dim = 192, l.rope_dim = 64, l.rope_offset = 128;
    cases.push_back({"mla", l, true});
  }
  {
    RopeLayout l;
    l.batch = 3, l.seq = 5, l.heads = 2, l.head_dim = 48, l.rope_dim = 16, l.rope_offset = 8;
    l.token_stride = 4 * 48;
    cases.push_back({"strided", l, false});
  }
  const int max_positions = 4096;
  const double theta = 500000.0;
  const RopeScaling scaling = RopeScaling::llama31();
  uint64_t seed = 7000;
  for (const Case& c : cases) {
    const RopeLayout& l = c.layout;
    test::DeviceBuffer<float2> tab(static_cast<size_t>(max_positions) * l.rope_dim / 2);
    rope_build_table(tab.get(), max_positions, l.rope_dim, theta, scaling, nullptr);
    const std::vector<double> freqs = ref::rope_frequencies(l.rope_dim, theta, scaling);
    const int64_t tokens = l.batch * l.seq;
    const int64_t stride = l.token_stride ? l.token_stride : int64_t{l.heads} * l.head_dim;
    const size_t n = tokens * stride;

    std::vector<int32_t> pos(tokens);
    std::mt19937 gen(++seed);
    for (auto& p : pos) p = std::uniform_int_distribution<int32_t>(0, max_positions - 1)(gen);
    test::DeviceBuffer<int32_t> pos_dev(pos);
    const int32_t* positions = c.explicit_positions ? pos_dev.get() : nullptr;
    const int32_t* host_positions = c.explicit_positions ? pos.data() : nullptr;

    const std::vector<float> xf = normal(n, ++seed);
    Bf16Tensor x(xf), out(n), dx(n), inplace(xf);
    Vec ref_out(n), ref_dx(n);
    ref::rope_forward(ref_out.data(), x.host.data(), freqs, host_positions, l);
    ref::rope_backward(ref_dx.data(), x.host.data(), freqs, host_positions, l);

    rope_forward(out.get(), x.get(), tab.get(), max_positions, positions, l, nullptr);
    rope_backward(dx.get(), x.get(), tab.get(), max_positions, positions, l, nullptr);
    rope_forward(inplace.get(), inplace.get(), tab.get(), max_positions, positions, l, nullptr);

    // Out of place, only the heads' channels are outputs (the stride gap stays poisoned).
    std::vector<float> got_out = out.download(), got_dx = dx.download(),
                       got_in = inplace.download();
    std::vector<float> o, d, ip;
    Vec ro, rd, rip;
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<int64_t>(i % stride) >= int64_t{l.heads} * l.head_dim) {
        // In place, the gap is the input itself, untouched.
        EXPECT_EQ(got_in[i], static_cast<float>(x.host[i])) << c.name << " gap " << i;
        continue;
      }
      o.push_back(got_out[i]);
      d.push_back(got_dx[i]);
      ip.push_back(got_in[i]);
      ro.push_back(ref_out[i]);
      rd.push_back(ref_dx[i]);
    }
    EXPECT_TRUE(
        all_close(std::string("rope forward ") + c.name, o, ro, tolerance("rope.fwd.bf16")));
    EXPECT_TRUE(
        all_close(std::string("rope backward ") + c.name, d, rd, tolerance("rope.bwd.bf16")));
    EXPECT_TRUE(test::bit_equal(std::string("rope in place vs out of place ") + c.name, ip.data(),
                                o.data(), o.size() * sizeof(float)));
  }
}

// ---------------------------------------------------------------------------------------------------
// Dropout

struct DropShape {
  int64_t rows;
  int C;
};
// Every lane of the kernels walks one run of rows (q, q + Q, ...) in batches, and a last batch of
// the rest. On an H100 or H200 the short shapes leave runs of 1-4 rows or none (the last batch
// alone, of every size); 700 x 12288 takes one wave of 88 runs of 7 or 8 rows in both directions
// (full batches, then in the 7-row runs a last batch of 3 rows backward and 1 forward).
const DropShape kDropShapes[] = {{1, 8},      {7, 1032},  {100, 2048}, {260, 4096},
                                 {33, 12288}, {9, 16384}, {700, 12288}};

PhiloxSlot upload_slot(test::DeviceBuffer<PhiloxSlot>& slot, uint64_t seed, uint64_t offset) {
  const PhiloxSlot s{seed, offset};
  slot.upload({s});
  return s;
}

TEST(PointwiseGpu, DropoutResidualForwardMatchesReferenceAndHostMask) {
  uint64_t seed = 8000;
  test::DeviceBuffer<PhiloxSlot> slot(1);
  for (const DropShape s : kDropShapes) {
    for (const float p : {0.1f, 0.5f}) {
      const size_t n = s.rows * s.C;
      const PhiloxSlot st = upload_slot(slot, 0x1234567890ull + seed, 17 * seed);
      const RngArgs rng{slot.get(), 3};
      const uint64_t position = st.offset + rng.op_offset;
      const std::string at = " " + shape_name(s.rows, s.C) + " p " + std::to_string(p);

      // Plain dropout of non-zero values: the kept set is where the output is non-zero, and it must
      // be exactly the host's Philox mask.
      Bf16Tensor x(nonzero(n, ++seed)), plain(n);
      dropout_residual_forward(plain.get(), x.get(), nullptr, nullptr, s.rows, s.C, p, rng,
                               nullptr);
      const std::vector<float> got_plain = plain.download();
      const std::vector<uint8_t> mask = ref::dropout_keep_mask(n, p, st.seed, position);
      int64_t mismatches = 0, kept = 0;
      for (size_t e = 0; e < n; ++e) {
        mismatches += (got_plain[e] != 0.0f) != (mask[e] != 0);
        kept += mask[e];
      }
      EXPECT_EQ(mismatches, 0) << "dropout mask" << at;
      if (n >= 10000) EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.01) << at;

      // Fused bias + dropout + residual, and each optional part alone.
      Bf16Tensor bias(normal(s.C, ++seed)), residual(normal(n, ++seed));
      for (int parts = 0; parts < 4; ++parts) {
        const bool with_bias = parts & 1, with_residual = parts & 2;
        Bf16Tensor out(n);
        dropout_residual_forward(out.get(), x.get(), with_bias ? bias.get() : nullptr,
                                 with_residual ? residual.get() : nullptr, s.rows, s.C, p, rng,
                                 nullptr);
        Vec ref(n);
        ref::dropout_residual_forward(
            ref.data(), x.host.data(), with_bias ? bias.host.data() : nullptr,
            with_residual ? residual.host.data() : nullptr, s.rows, s.C, p, st.seed, position);
        EXPECT_TRUE(all_close(std::string("dropout forward") + (with_bias ? " +bias" : "") +
                                  (with_residual ? " +residual" : "") + at,
                              out.download(), ref, tolerance("dropout_residual.fwd.bf16")));
      }
    }
  }
}

TEST(PointwiseGpu, DropoutIsReproducibleAndMovesWithTheSlotOffset) {
  const int64_t rows = 64;
  const int C = 4096;
  const size_t n = rows * C;
  const float p = 0.3f;
  Bf16Tensor x(nonzero(n, 1)), bias(normal(C, 2)), residual(normal(n, 3));
  test::DeviceBuffer<PhiloxSlot> slot(1);
  auto run = [&](uint64_t offset, uint64_t op_offset) {
    upload_slot(slot, 2024, offset);
    Bf16Tensor out(n);
    dropout_residual_forward(out.get(), x.get(), bias.get(), residual.get(), rows, C, p,
                             RngArgs{slot.get(), op_offset}, nullptr);
    return out.download();
  };
  const std::vector<float> a = run(10, 0), b = run(10, 0), c = run(11, 0), d = run(10, 1);
  EXPECT_TRUE(test::bit_equal("same RngArgs", a.data(), b.data(), n * sizeof(float)));
  // A different position redraws the mask: about 2 p (1 - p) = 42% of the elements change.
  for (const auto* other : {&c, &d}) {
    int64_t differ = 0;
    for (size_t e = 0; e < n; ++e) differ += a[e] != (*other)[e];
    EXPECT_NEAR(static_cast<double>(differ) / n, 2 * p * (1 - p), 0.02);
  }
}

// A sequence-parallel shard: rows [r0, r0 + k) of a [rows, C] tensor with mask_row r0 draw the
// whole tensor's mask there, so forward and backward give the slice of the whole call's output.
TEST(PointwiseGpu, DropoutOfARowShardIsTheSliceOfTheWhole) {
  const int64_t rows = 96, r0 = 40, k = 32;
  const int C = 1024;
  const size_t n = rows * C, nk = k * C;
  const float p = 0.3f;
  test::DeviceBuffer<PhiloxSlot> slot(1);
  upload_slot(slot, 4242, 7);
  const RngArgs rng{slot.get(), 5};
  Bf16Tensor x(nonzero(n, 11)), bias(normal(C, 12)), residual(normal(n, 13)), whole(n);
  dropout_residual_forward(whole.get(), x.get(), bias.get(), residual.get(), rows, C, p, rng,
                           nullptr);
  Bf16Tensor shard(nk);
  dropout_residual_forward(shard.get(), x.get() + r0 * C, bias.get(), residual.get() + r0 * C, k, C,
                           p, rng, nullptr, r0);
  const std::vector<float> w = whole.download(), sh = shard.download();
  EXPECT_TRUE(test::bit_equal("forward shard", sh.data(), w.data() + r0 * C, nk * sizeof(float)));
  // Without the row offset the shard draws the mask of rows 0 .. k - 1 instead: most differ.
  Bf16Tensor wrong(nk);
  dropout_residual_forward(wrong.get(), x.get() + r0 * C, bias.get(), residual.get() + r0 * C, k, C,
                           p, rng, nullptr);
  const std::vector<float> wr = wrong.download();
  int64_t differ = 0;
  for (size_t e = 0; e < nk; ++e) differ += wr[e] != w[r0 * C + e];
  EXPECT_GT(differ, static_cast<int64_t>(nk / 4));

  Bf16Tensor dout(nonzero(n, 14)), dx_whole(n), dx_shard(nk);
  dropout_residual_backward(dx_whole.get(), nullptr, dout.get(), rows, C, p, rng, false, nullptr, 0,
                            nullptr);
  dropout_residual_backward(dx_shard.get(), nullptr, dout.get() + r0 * C, k, C, p, rng, false,
                            nullptr, 0, nullptr, r0);
  const std::vector<float> dw = dx_whole.download(), ds = dx_shard.download();
  EXPECT_TRUE(test::bit_equal("backward shard", ds.data(), dw.data() + r0 * C, nk * sizeof(float)));
}

TEST(PointwiseGpu, DropoutBackwardMatchesReference) {
  uint64_t seed = 9000;
  test::DeviceBuffer<PhiloxSlot> slot(1);
  for (const DropShape s : kDropShapes) {
    const size_t n = s.rows * s.C;
    const float p = 0.2f;
    const PhiloxSlot st = upload_slot(slot, 77 + seed, 5 * seed);
    const RngArgs rng{slot.get(), 9};
    const uint64_t position = st.offset + rng.op_offset;
    Bf16Tensor dout(nonzero(n, ++seed));
    Vec ref_dx(n), ref_dbias(s.C);
    ref::dropout_residual_backward(ref_dx.data(), ref_dbias.data(), dout.host.data(), s.rows, s.C,
                                   p, st.seed, position);
    const size_t ws_bytes = dropout_residual_backward_workspace_bytes(s.rows, s.C);
    test::DeviceBuffer<unsigned char> ws(ws_bytes);
    const std::string at = " " + shape_name(s.rows, s.C);

    for (const bool accumulate : {false, true}) {
      const std::vector<float> db0 = normal(s.C, ++seed);
      Bf16Tensor dx(n);
      test::DeviceBuffer<float> dbias(s.C);
      if (accumulate) dbias.upload(db0);
      dropout_residual_backward(dx.get(), dbias.get(), dout.get(), s.rows, s.C, p, rng, accumulate,
                                ws.get(), ws_bytes, nullptr);
      Vec want_db = ref_dbias;
      if (accumulate)
        for (int c = 0; c < s.C; ++c) want_db[c] += db0[c];
      const std::vector<float> got_dx = dx.download();
      EXPECT_TRUE(
          all_close("dropout dx" + at, got_dx, ref_dx, tolerance("dropout_residual.bwd.bf16")));
      EXPECT_TRUE(all_close(std::string("dropout dbias") + (accumulate ? " +=" : "") + at,
                            dbias.download(), want_db,
                            tolerance("dropout_residual.bwd_bias.fp32")));
      // The regenerated mask is the forward's mask, element for element.
      const std::vector<uint8_t> mask = ref::dropout_keep_mask(n, p, st.seed, position);
      int64_t mismatches = 0;
      for (size_t e = 0; e < n; ++e) mismatches += (got_dx[e] != 0.0f) != (mask[e] != 0);
      EXPECT_EQ(mismatches, 0) << "dropout backward mask" << at;
    }

    // Without dbias no workspace is needed.
    Bf16Tensor dx(n);
    dropout_residual_backward(dx.get(), nullptr, dout.get(), s.rows, s.C, p, rng, false, nullptr, 0,
                              nullptr);
    EXPECT_TRUE(all_close("dropout dx, no dbias" + at, dx.download(), ref_dx,
                          tolerance("dropout_residual.bwd.bf16")));
  }
}

TEST(PointwiseGpu, DropoutWithZeroProbabilityIsExactAndReadsNoRng) {
  const int64_t rows = 19;
  const int C = 1024;
  const size_t n = rows * C;
  Bf16Tensor x(normal(n, 1)), bias(normal(C, 2)), residual(normal(n, 3)), out(n), dx(n);
  const RngArgs no_rng{nullptr, 0};  // p = 0 must not touch the slot
  dropout_residual_forward(out.get(), x.get(), bias.get(), residual.get(), rows, C, 0.0f, no_rng,
                           nullptr);
  const std::vector<float> got = out.download();
  for (size_t e = 0; e < n; ++e) {
    // The kernel's fp32 sum, (x + bias) + residual, rounded once.
    const float want = __bfloat162float(
        __float2bfloat16_rn((static_cast<float>(x.host[e]) + static_cast<float>(bias.host[e % C])) +
                            static_cast<float>(residual.host[e])));
    ASSERT_EQ(got[e], want) << "element " << e;
  }
  const size_t ws_bytes = dropout_residual_backward_workspace_bytes(rows, C);
  test::DeviceBuffer<unsigned char> ws(ws_bytes);
  test::DeviceBuffer<float> dbias(C);
  dropout_residual_backward(dx.get(), dbias.get(), x.get(), rows, C, 0.0f, no_rng, false, ws.get(),
                            ws_bytes, nullptr);
  const std::vector<float> got_dx = dx.download(), want_dx(x.host.begin(), x.host.end());
  EXPECT_TRUE(
      test::bit_equal("p = 0 dx == dout", got_dx.data(), want_dx.data(), n * sizeof(float)));
  Vec want_db(C, 0.0);
  for (size_t e = 0; e < n; ++e) want_db[e % C] += x.host[e];
  EXPECT_TRUE(all_close("p = 0 dbias", dbias.download(), want_db,
                        tolerance("dropout_residual.bwd_bias.fp32")));
}

}  // namespace
}  // namespace replay
