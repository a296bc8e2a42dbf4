// block_reference.cpp: the fp64 residual block and spatial transformer (block_reference.h).
#include "workloads/unet/block_reference.h"

#include <algorithm>
#include <cmath>

#include "workloads/unet/pointwise_reference.h"
#include "workloads/unet/unet_reference.h"

namespace replay::unet::ref {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
Vec silu(const Vec& x) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sigmoid(x[i]);
  return y;
}
// dx = dy * silu'(x)
Vec silu_grad(const Vec& dy, const Vec& x) {
  Vec dx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double s = sigmoid(x[i]);
    dx[i] = dy[i] * s * (1.0 + x[i] * (1.0 - s));
  }
  return dx;
}
void add_to(Vec& a, const Vec& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
}

// GroupNorm (or LayerNorm: rows samples of one pixel, one group) with its statistics kept.
struct Norm {
  Vec out, mean, rstd;
  void forward(const Vec& x, const Vec& g, const Vec& b, int64_t N, int64_t HW, int64_t C, int G,
               double eps) {
    out.assign(x.size(), 0.0);
    mean.assign(static_cast<size_t>(N * G), 0.0);
    rstd.assign(mean.size(), 0.0);
    group_norm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), N, HW,
                       static_cast<int>(C), G, eps, false);
  }
  void backward(Vec& dx, Vec& dg, Vec& db, const Vec& dout, const Vec& x, const Vec& g,
                const Vec& b, int64_t N, int64_t HW, int64_t C, int G) const {
    dx.assign(x.size(), 0.0);
    dg.assign(static_cast<size_t>(C), 0.0);
    db.assign(dg.size(), 0.0);
    group_norm_backward(dx.data(), dg.data(), db.data(), dout.data(), x.data(), g.data(), b.data(),
                        mean.data(), rstd.data(), N, HW, static_cast<int>(C), G, false);
  }
};

Vec linear(const Vec& x, const Vec& w, const Vec& b, int64_t rows, int64_t in, int64_t out) {
  Vec y(static_cast<size_t>(rows * out));
  linear_forward(y.data(), x.data(), w, b, rows, in, out);
  return y;
}

ConvShape conv_shape(const ResnetDims& d, int64_t cin, int64_t cout, int64_t kernel) {
  ConvShape s;
  s.n = d.N, s.h = d.H, s.w = d.W, s.c = cin, s.k = cout, s.kernel = kernel, s.stride = 1;
  s.padding = kernel / 2;
  return s;
}

Vec conv(const Vec& x, const Vec& w, const Vec& b, const ConvShape& s) {
  Vec y(static_cast<size_t>(s.n * s.p() * s.q() * s.k));
  conv2d_forward(y.data(), x.data(), w.data(), b.data(), s);
  return y;
}
// dw, db and (when dx is not null) dx of a convolution.
void conv_back(Vec* dx, Vec& dw, Vec& db, const Vec& dy, const Vec& x, const Vec& w,
               const ConvShape& s) {
  dw.assign(w.size(), 0.0);
  db.assign(static_cast<size_t>(s.k), 0.0);
  conv2d_wgrad(dw.data(), dy.data(), x.data(), s);
  bias_grad(db.data(), dy.data(), s.n * s.p() * s.q(), s.k);
  if (dx) {
    dx->assign(x.size(), 0.0);
    conv2d_dgrad(dx->data(), dy.data(), w.data(), s);
  }
}

}  // namespace

void linear_forward(double* y, const double* x, const Vec& w, const Vec& b, int64_t rows,
                    int64_t in, int64_t out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[static_cast<size_t>(o * in + i)];
      y[r * out + o] = acc;
    }
}

void linear_backward(double* dx, Vec& dw, Vec& db, const double* dy, const double* x, const Vec& w,
                     int64_t rows, int64_t in, int64_t out) {
  dw.assign(static_cast<size_t>(out * in), 0.0);
  db.assign(static_cast<size_t>(out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      const double g = dy[r * out + o];
      db[static_cast<size_t>(o)] += g;
      for (int64_t i = 0; i < in; ++i) dw[static_cast<size_t>(o * in + i)] += g * x[r * in + i];
    }
  if (dx == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i) {
      double acc = 0.0;
      for (int64_t o = 0; o < out; ++o) acc += dy[r * out + o] * w[static_cast<size_t>(o * in + i)];
      dx[r * in + i] = acc;
    }
}

void attention_forward(double* o, const double* q, const double* k, const double* v, int64_t N,
                       int64_t Sq, int64_t Skv, int64_t C, int64_t heads) {
  const int64_t d = C / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Vec p(static_cast<size_t>(Skv));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qi = q + (n * Sq + i) * C + h * d;
        double mx = -1e300;
        for (int64_t j = 0; j < Skv; ++j) {
          const double* kj = k + (n * Skv + j) * C + h * d;
          double s = 0.0;
          for (int64_t c = 0; c < d; ++c) s += qi[c] * kj[c];
          p[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0.0;
        for (double& x : p) sum += (x = std::exp(x - mx));
        double* oi = o + (n * Sq + i) * C + h * d;
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j < Skv; ++j)
            acc += p[static_cast<size_t>(j)] / sum * v[(n * Skv + j) * C + h * d + c];
          oi[c] = acc;
        }
      }
}

void attention_backward(double* dq, double* dk, double* dv, const double* d_o, const double* q,
                        const double* k, const double* v, int64_t N, int64_t Sq, int64_t Skv,
                        int64_t C, int64_t heads) {
  const int64_t d = C / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::fill(dq, dq + N * Sq * C, 0.0);
  std::fill(dk, dk + N * Skv * C, 0.0);
  std::fill(dv, dv + N * Skv * C, 0.0);
  Vec p(static_cast<size_t>(Skv)), dp(p.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qi = q + (n * Sq + i) * C + h * d;
        const double* doi = d_o + (n * Sq + i) * C + h * d;
        double mx = -1e300;
        for (int64_t j = 0; j < Skv; ++j) {
          double s = 0.0;
          for (int64_t c = 0; c < d; ++c) s += qi[c] * k[(n * Skv + j) * C + h * d + c];
          p[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0.0;
        for (double& x : p) sum += (x = std::exp(x - mx));
        for (double& x : p) x /= sum;
        double rowdot = 0.0;
        for (int64_t j = 0; j < Skv; ++j) {
          double g = 0.0;
          for (int64_t c = 0; c < d; ++c) g += doi[c] * v[(n * Skv + j) * C + h * d + c];
          dp[static_cast<size_t>(j)] = g;
          rowdot += g * p[static_cast<size_t>(j)];
        }
        for (int64_t j = 0; j < Skv; ++j) {
          const double pj = p[static_cast<size_t>(j)];
          const double ds = pj * (dp[static_cast<size_t>(j)] - rowdot) * scale;
          for (int64_t c = 0; c < d; ++c) {
            const int64_t kv = (n * Skv + j) * C + h * d + c;
            dv[kv] += pj * doi[c];
            dq[(n * Sq + i) * C + h * d + c] += ds * k[kv];
            dk[kv] += ds * qi[c];
          }
        }
      }
}

// ---- Residual block -----------------------------------------------------------------------------

std::vector<Vec*> ResnetParams::all() {
  return {&norm1_w, &norm1_b, &conv1_w, &conv1_b, &temb_w,  &temb_b,
          &norm2_w, &norm2_b, &conv2_w, &conv2_b, &short_w, &short_b};
}

ResnetParams ResnetParams::shaped_like(const ResnetDims& d) {
  auto z = [](int64_t n) { return Vec(static_cast<size_t>(n), 0.0); };
  ResnetParams p;
  p.norm1_w = z(d.Cin), p.norm1_b = z(d.Cin);
  p.conv1_w = z(d.Cout * 9 * d.Cin), p.conv1_b = z(d.Cout);
  p.temb_w = z(d.Cout * d.T), p.temb_b = z(d.Cout);
  p.norm2_w = z(d.Cout), p.norm2_b = z(d.Cout);
  p.conv2_w = z(d.Cout * 9 * d.Cout), p.conv2_b = z(d.Cout);
  if (d.shortcut()) p.short_w = z(d.Cout * d.Cin), p.short_b = z(d.Cout);
  return p;
}

namespace {

struct ResnetCache {
  Norm n1, n2;
  Vec a1, c1, t_act, tp, h, a2;
};

Vec resnet_run(ResnetCache& k, const ResnetDims& d, const ResnetParams& p, const Vec& x,
               const Vec& temb) {
  const int64_t P = d.H * d.W;
  k.n1.forward(x, p.norm1_w, p.norm1_b, d.N, P, d.Cin, d.G, 1e-5);
  k.a1 = silu(k.n1.out);
  k.c1 = conv(k.a1, p.conv1_w, p.conv1_b, conv_shape(d, d.Cin, d.Cout, 3));
  k.t_act = silu(temb);
  k.tp = linear(k.t_act, p.temb_w, p.temb_b, d.N, d.T, d.Cout);
  k.h = k.c1;
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t q = 0; q < P; ++q)
      for (int64_t c = 0; c < d.Cout; ++c)
        k.h[static_cast<size_t>((n * P + q) * d.Cout + c)] +=
            k.tp[static_cast<size_t>(n * d.Cout + c)];
  k.n2.forward(k.h, p.norm2_w, p.norm2_b, d.N, P, d.Cout, d.G, 1e-5);
  k.a2 = silu(k.n2.out);
  Vec out = conv(k.a2, p.conv2_w, p.conv2_b, conv_shape(d, d.Cout, d.Cout, 3));
  add_to(out, d.shortcut() ? conv(x, p.short_w, p.short_b, conv_shape(d, d.Cin, d.Cout, 1)) : x);
  return out;
}

}  // namespace

void resnet_forward(Vec& out, const ResnetDims& d, const ResnetParams& p, const Vec& x,
                    const Vec& temb) {
  ResnetCache k;
  out = resnet_run(k, d, p, x, temb);
}

void resnet_backward(ResnetParams& g, Vec& dx, Vec& dtemb, const ResnetDims& d,
                     const ResnetParams& p, const Vec& x, const Vec& temb, const Vec& dout) {
  ResnetCache k;
  resnet_run(k, d, p, x, temb);
  const int64_t P = d.H * d.W;
  g = ResnetParams::shaped_like(d);
  Vec da2, dn2, dh, da1, dn1;
  conv_back(&da2, g.conv2_w, g.conv2_b, dout, k.a2, p.conv2_w, conv_shape(d, d.Cout, d.Cout, 3));
  dn2 = silu_grad(da2, k.n2.out);
  k.n2.backward(dh, g.norm2_w, g.norm2_b, dn2, k.h, p.norm2_w, p.norm2_b, d.N, P, d.Cout, d.G);
  Vec dtp(static_cast<size_t>(d.N * d.Cout), 0.0);
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t q = 0; q < P; ++q)
      for (int64_t c = 0; c < d.Cout; ++c)
        dtp[static_cast<size_t>(n * d.Cout + c)] +=
            dh[static_cast<size_t>((n * P + q) * d.Cout + c)];
  Vec dt_act(static_cast<size_t>(d.N * d.T));
  linear_backward(dt_act.data(), g.temb_w, g.temb_b, dtp.data(), k.t_act.data(), p.temb_w, d.N, d.T,
                  d.Cout);
  dtemb = silu_grad(dt_act, temb);
  conv_back(&da1, g.conv1_w, g.conv1_b, dh, k.a1, p.conv1_w, conv_shape(d, d.Cin, d.Cout, 3));
  dn1 = silu_grad(da1, k.n1.out);
  k.n1.backward(dx, g.norm1_w, g.norm1_b, dn1, x, p.norm1_w, p.norm1_b, d.N, P, d.Cin, d.G);
  if (d.shortcut()) {
    Vec ds;
    conv_back(&ds, g.short_w, g.short_b, dout, x, p.short_w, conv_shape(d, d.Cin, d.Cout, 1));
    add_to(dx, ds);
  } else {
    add_to(dx, dout);
  }
}

// ---- Spatial transformer ------------------------------------------------------------------------

std::vector<Vec*> TransformerParams::all() {
  return {&norm_w, &norm_b, &proj_in_w, &proj_in_b, &ln1_w, &ln1_b, &qkv_w,      &out1_w,
          &out1_b, &ln2_w,  &ln2_b,     &q_w,       &k_w,   &v_w,   &out2_w,     &out2_b,
          &ln3_w,  &ln3_b,  &ff1_w,     &ff1_b,     &ff2_w, &ff2_b, &proj_out_w, &proj_out_b};
}

TransformerParams TransformerParams::shaped_like(const TransformerDims& d) {
  auto z = [](int64_t n) { return Vec(static_cast<size_t>(n), 0.0); };
  const int64_t C = d.C;
  TransformerParams p;
  p.norm_w = z(C), p.norm_b = z(C), p.proj_in_w = z(C * C), p.proj_in_b = z(C);
  p.ln1_w = z(C), p.ln1_b = z(C), p.qkv_w = z(3 * C * C), p.out1_w = z(C * C), p.out1_b = z(C);
  p.ln2_w = z(C), p.ln2_b = z(C), p.q_w = z(C * C), p.k_w = z(C * d.D), p.v_w = z(C * d.D);
  p.out2_w = z(C * C), p.out2_b = z(C), p.ln3_w = z(C), p.ln3_b = z(C);
  p.ff1_w = z(8 * C * C), p.ff1_b = z(8 * C), p.ff2_w = z(C * 4 * C), p.ff2_b = z(C);
  p.proj_out_w = z(C * C), p.proj_out_b = z(C);
  return p;
}

namespace {

struct TransformerCache {
  Norm gn, ln1, ln2, ln3;
  Vec h0, qkv, q1, k1, v1, o1, h1, q2, k2, v2, o2, h2, f1, f2, h3;
};

Vec transformer_run(TransformerCache& k, const TransformerDims& d, const TransformerParams& p,
                    const Vec& x, const Vec& ctx) {
  const int64_t R = d.N * d.S, C = d.C, L = d.L, D = d.D;
  const Vec none;
  k.gn.forward(x, p.norm_w, p.norm_b, d.N, d.S, C, d.G, 1e-6);
  k.h0 = linear(k.gn.out, p.proj_in_w, p.proj_in_b, R, C, C);
  k.ln1.forward(k.h0, p.ln1_w, p.ln1_b, R, 1, C, 1, 1e-5);
  k.qkv = linear(k.ln1.out, p.qkv_w, none, R, C, 3 * C);
  k.q1.assign(static_cast<size_t>(R * C), 0.0);
  k.k1 = k.q1, k.v1 = k.q1;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      k.q1[static_cast<size_t>(r * C + c)] = k.qkv[static_cast<size_t>(r * 3 * C + c)];
      k.k1[static_cast<size_t>(r * C + c)] = k.qkv[static_cast<size_t>(r * 3 * C + C + c)];
      k.v1[static_cast<size_t>(r * C + c)] = k.qkv[static_cast<size_t>(r * 3 * C + 2 * C + c)];
    }
  k.o1.assign(static_cast<size_t>(R * C), 0.0);
  attention_forward(k.o1.data(), k.q1.data(), k.k1.data(), k.v1.data(), d.N, d.S, d.S, C, d.heads);
  k.h1 = linear(k.o1, p.out1_w, p.out1_b, R, C, C);
  add_to(k.h1, k.h0);
  k.ln2.forward(k.h1, p.ln2_w, p.ln2_b, R, 1, C, 1, 1e-5);
  k.q2 = linear(k.ln2.out, p.q_w, none, R, C, C);
  k.k2 = linear(ctx, p.k_w, none, d.N * L, D, C);
  k.v2 = linear(ctx, p.v_w, none, d.N * L, D, C);
  k.o2.assign(static_cast<size_t>(R * C), 0.0);
  attention_forward(k.o2.data(), k.q2.data(), k.k2.data(), k.v2.data(), d.N, d.S, L, C, d.heads);
  k.h2 = linear(k.o2, p.out2_w, p.out2_b, R, C, C);
  add_to(k.h2, k.h1);
  k.ln3.forward(k.h2, p.ln3_w, p.ln3_b, R, 1, C, 1, 1e-5);
  k.f1 = linear(k.ln3.out, p.ff1_w, p.ff1_b, R, C, 8 * C);
  k.f2.assign(static_cast<size_t>(R * 4 * C), 0.0);
  geglu_forward(k.f2.data(), k.f1.data(), R, 4 * C);
  k.h3 = linear(k.f2, p.ff2_w, p.ff2_b, R, 4 * C, C);
  add_to(k.h3, k.h2);
  Vec out = linear(k.h3, p.proj_out_w, p.proj_out_b, R, C, C);
  add_to(out, x);
  return out;
}

}  // namespace

void transformer_forward(Vec& out, const TransformerDims& d, const TransformerParams& p,
                         const Vec& x, const Vec& context) {
  TransformerCache k;
  out = transformer_run(k, d, p, x, context);
}

void transformer_backward(TransformerParams& g, Vec& dx, const TransformerDims& d,
                          const TransformerParams& p, const Vec& x, const Vec& ctx,
                          const Vec& dout) {
  TransformerCache k;
  transformer_run(k, d, p, x, ctx);
  const int64_t R = d.N * d.S, C = d.C, L = d.L, D = d.D;
  g = TransformerParams::shaped_like(d);
  Vec unused;
  auto sized = [](int64_t n) { return Vec(static_cast<size_t>(n), 0.0); };
  // out = proj_out(h3) + x
  Vec dh3 = sized(R * C);
  linear_backward(dh3.data(), g.proj_out_w, g.proj_out_b, dout.data(), k.h3.data(), p.proj_out_w, R,
                  C, C);
  // h3 = ff2(geglu(ff1(ln3(h2)))) + h2
  Vec df2 = sized(R * 4 * C), df1 = sized(R * 8 * C), dl3 = sized(R * C), dh2;
  linear_backward(df2.data(), g.ff2_w, g.ff2_b, dh3.data(), k.f2.data(), p.ff2_w, R, 4 * C, C);
  geglu_backward(df1.data(), df2.data(), k.f1.data(), R, 4 * C);
  linear_backward(dl3.data(), g.ff1_w, g.ff1_b, df1.data(), k.ln3.out.data(), p.ff1_w, R, C, 8 * C);
  k.ln3.backward(dh2, g.ln3_w, g.ln3_b, dl3, k.h2, p.ln3_w, p.ln3_b, R, 1, C, 1);
  add_to(dh2, dh3);
  // h2 = out2(attn(q(ln2(h1)), k(ctx), v(ctx))) + h1
  Vec do2 = sized(R * C), dq2 = sized(R * C), dk2 = sized(d.N * L * C), dv2 = dk2;
  linear_backward(do2.data(), g.out2_w, g.out2_b, dh2.data(), k.o2.data(), p.out2_w, R, C, C);
  attention_backward(dq2.data(), dk2.data(), dv2.data(), do2.data(), k.q2.data(), k.k2.data(),
                     k.v2.data(), d.N, d.S, L, C, d.heads);
  linear_backward(nullptr, g.k_w, unused, dk2.data(), ctx.data(), p.k_w, d.N * L, D, C);
  linear_backward(nullptr, g.v_w, unused, dv2.data(), ctx.data(), p.v_w, d.N * L, D, C);
  Vec dl2 = sized(R * C), dh1;
  linear_backward(dl2.data(), g.q_w, unused, dq2.data(), k.ln2.out.data(), p.q_w, R, C, C);
  k.ln2.backward(dh1, g.ln2_w, g.ln2_b, dl2, k.h1, p.ln2_w, p.ln2_b, R, 1, C, 1);
  add_to(dh1, dh2);
  // h1 = out1(attn(qkv(ln1(h0)))) + h0
  Vec do1 = sized(R * C), dq1 = sized(R * C), dk1 = dq1, dv1 = dq1;
  linear_backward(do1.data(), g.out1_w, g.out1_b, dh1.data(), k.o1.data(), p.out1_w, R, C, C);
  attention_backward(dq1.data(), dk1.data(), dv1.data(), do1.data(), k.q1.data(), k.k1.data(),
                     k.v1.data(), d.N, d.S, d.S, C, d.heads);
  Vec dqkv = sized(R * 3 * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      dqkv[static_cast<size_t>(r * 3 * C + c)] = dq1[static_cast<size_t>(r * C + c)];
      dqkv[static_cast<size_t>(r * 3 * C + C + c)] = dk1[static_cast<size_t>(r * C + c)];
      dqkv[static_cast<size_t>(r * 3 * C + 2 * C + c)] = dv1[static_cast<size_t>(r * C + c)];
    }
  Vec dl1 = sized(R * C), dh0;
  linear_backward(dl1.data(), g.qkv_w, unused, dqkv.data(), k.ln1.out.data(), p.qkv_w, R, C, 3 * C);
  k.ln1.backward(dh0, g.ln1_w, g.ln1_b, dl1, k.h0, p.ln1_w, p.ln1_b, R, 1, C, 1);
  add_to(dh0, dh1);
  // h0 = proj_in(groupnorm(x)); out = ... + x
  Vec dgn = sized(R * C);
  linear_backward(dgn.data(), g.proj_in_w, g.proj_in_b, dh0.data(), k.gn.out.data(), p.proj_in_w, R,
                  C, C);
  k.gn.backward(dx, g.norm_w, g.norm_b, dgn, x, p.norm_w, p.norm_b, d.N, d.S, C, d.G);
  add_to(dx, dout);
}

}  // namespace replay::unet::ref
