// gpt_reference.cpp: the fp64 GPT shard, forward and backward, from common/reference's ops.
#include "tests/workloads/gpt_reference.h"

#include "common/reference/gemm.h"
#include "common/reference/pointwise.h"
#include "tests/workloads/reference_util.h"

namespace replay::test {

namespace {

struct LayerCache {
  Vec x, mean1, rstd1, h1, q, k, v, o, lse, x_mid, mean2, rstd2, h2, act, preact;
};

struct Cache {
  std::vector<LayerCache> layers;
  Vec x_final, meanf, rstdf, hf, logits;
  CrossEntropy ce;
};

// out = residual + x + bias (the bias-dropout-residual kernel with p = 0).
Vec add_residual(const Vec& residual, const Vec& x, const Vec& bias, int64_t C) {
  Vec out(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    out[i] = residual[i] + x[i] + bias[i % static_cast<size_t>(C)];
  return out;
}

Vec column_sums(const Vec& x, int64_t C) {
  Vec s(static_cast<size_t>(C), 0.0);
  for (size_t i = 0; i < x.size(); ++i) s[i % static_cast<size_t>(C)] += x[i];
  return s;
}

reference::AttentionShape attention_shape(const GptDims& d) {
  return causal_attention_shape(d.batch, d.seq, d.heads, d.heads, d.head_dim);
}

ref::EmbeddingDims embedding_dims(const GptDims& d) {
  return test::embedding_dims(d.batch, d.seq, d.hidden, d.vocab);
}

Cache forward(const GptDims& d, const GptParams& p, const int32_t* tokens, const int32_t* targets) {
  const int64_t M = d.tokens(), C = d.hidden, A = d.attn(), F = d.ffn, V = d.vocab;
  const int iC = static_cast<int>(C);
  auto P = [&](int i) -> const Vec& { return p.t.at(static_cast<size_t>(i)); };
  Cache c;
  Vec x(static_cast<size_t>(M * C));
  ref::embedding_forward(x.data(), tokens, P(GptParams::wte()).data(), P(GptParams::wpe()).data(),
                         embedding_dims(d));
  for (int64_t l = 0; l < d.layers; ++l) {
    auto W = [&](LayerTensor k) -> const Vec& { return P(GptParams::layer(l, k)); };
    LayerCache lc;
    lc.x = x;
    lc.h1.resize(x.size()), lc.mean1.resize(M), lc.rstd1.resize(M);
    ref::layernorm_forward(lc.h1.data(), lc.mean1.data(), lc.rstd1.data(), x.data(),
                           W(kLn1W).data(), W(kLn1B).data(), M, iC, d.eps);
    const Vec qkv =
        run_gemm(linear_gemms(M, C, 3 * A, true, false).forward, lc.h1, W(kQkvW), W(kQkvB).data());
    lc.q.resize(M * A), lc.k.resize(M * A), lc.v.resize(M * A);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < A; ++j) {
        lc.q[r * A + j] = qkv[r * 3 * A + j];
        lc.k[r * A + j] = qkv[r * 3 * A + A + j];
        lc.v[r * A + j] = qkv[r * 3 * A + 2 * A + j];
      }
    lc.o.resize(M * A), lc.lse.resize(M * d.heads);
    reference::attention_forward(attention_shape(d), lc.q.data(), lc.k.data(), lc.v.data(),
                                 lc.o.data(), lc.lse.data());
    const Vec y = run_gemm(linear_gemms(M, A, C, false, false).forward, lc.o, W(kProjW));
    lc.x_mid = add_residual(x, y, W(kProjB), C);
    lc.h2.resize(x.size()), lc.mean2.resize(M), lc.rstd2.resize(M);
    ref::layernorm_forward(lc.h2.data(), lc.mean2.data(), lc.rstd2.data(), lc.x_mid.data(),
                           W(kLn2W).data(), W(kLn2B).data(), M, iC, d.eps);
    GemmDesc fc1 = linear_gemms(M, C, F, true, false).forward;
    fc1.epilogue = Epilogue::kBiasGeluAux;
    lc.preact.resize(M * F);
    lc.act = run_gemm(fc1, lc.h2, W(kFc1W), W(kFc1B).data(), nullptr, lc.preact.data());
    const Vec z = run_gemm(linear_gemms(M, F, C, false, false).forward, lc.act, W(kFc2W));
    x = add_residual(lc.x_mid, z, W(kFc2B), C);
    c.layers.push_back(std::move(lc));
  }
  c.x_final = x;
  c.hf.resize(x.size()), c.meanf.resize(M), c.rstdf.resize(M);
  ref::layernorm_forward(c.hf.data(), c.meanf.data(), c.rstdf.data(), x.data(),
                         P(GptParams::lnf_weight(d)).data(), P(GptParams::lnf_bias(d)).data(), M,
                         iC, d.eps);
  c.logits = run_gemm(linear_gemms(M, C, V, false, false).forward, c.hf, P(GptParams::wte()));
  c.ce = cross_entropy(c.logits, targets, M, V);
  return c;
}

}  // namespace

std::string GptParams::name(const GptDims& d, int index) {
  static const char* kLayer[kPerLayer] = {"ln1.weight",    "ln1.bias",         "attn.qkv.weight",
                                          "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                                          "ln2.weight",    "ln2.bias",         "mlp.fc1.weight",
                                          "mlp.fc1.bias",  "mlp.fc2.weight",   "mlp.fc2.bias"};
  if (index == wte()) return "embedding.token";
  if (index == wpe()) return "embedding.position";
  if (index == lnf_weight(d)) return "final_norm.weight";
  if (index == lnf_bias(d)) return "final_norm.bias";
  const int i = index - 2;
  return "layer" + std::to_string(i / kPerLayer) + "." + kLayer[i % kPerLayer];
}

std::vector<int64_t> GptParams::sizes(const GptDims& d) {
  const int64_t C = d.hidden, A = d.attn(), F = d.ffn;
  std::vector<int64_t> s = {d.vocab * C, d.seq * C};
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::vector<int64_t> layer = {C, C, 3 * A * C, 3 * A, C * A, C, C, C, F * C, F, C * F, C};
    s.insert(s.end(), layer.begin(), layer.end());
  }
  s.push_back(C);
  s.push_back(C);
  return s;
}

GptParams random_params(const GptDims& d, uint64_t seed, double stddev) {
  GptParams p;
  p.t = random_tensors(
      GptParams::sizes(d), [&](int i) { return GptParams::name(d, i); }, seed, stddev);
  return p;
}

double gpt_loss(const GptDims& d, const GptParams& p, const int32_t* tokens,
                const int32_t* targets) {
  return forward(d, p, tokens, targets).ce.loss;
}

double gpt_backward(const GptDims& d, const GptParams& p, const int32_t* tokens,
                    const int32_t* targets, GptParams* grads, std::vector<double>* dx0) {
  const int64_t M = d.tokens(), C = d.hidden, A = d.attn(), F = d.ffn, V = d.vocab;
  const int iC = static_cast<int>(C);
  const Cache c = forward(d, p, tokens, targets);
  auto P = [&](int i) -> const Vec& { return p.t.at(static_cast<size_t>(i)); };
  grads->t = zeros_like(p.t);
  auto Gr = [&](int i) -> Vec& { return grads->t.at(static_cast<size_t>(i)); };

  // Head: cross-entropy, tied LM head dgrad, final norm.
  const Vec dlogits = cross_entropy_dlogits(c.ce, c.logits, targets, M, V);
  const LinearGemms head = linear_gemms(M, C, V, false, true);
  const Vec dhf = run_gemm(head.dgrad, dlogits, P(GptParams::wte()));
  Vec G(static_cast<size_t>(M * C));
  ref::layernorm_backward(
      G.data(), Gr(GptParams::lnf_weight(d)).data(), Gr(GptParams::lnf_bias(d)).data(), dhf.data(),
      c.x_final.data(), P(GptParams::lnf_weight(d)).data(), c.meanf.data(), c.rstdf.data(), M, iC);

  for (int64_t l = d.layers - 1; l >= 0; --l) {
    const LayerCache& lc = c.layers[static_cast<size_t>(l)];
    auto W = [&](LayerTensor k) -> const Vec& { return P(GptParams::layer(l, k)); };
    auto dW = [&](LayerTensor k) -> Vec& { return Gr(GptParams::layer(l, k)); };
    Vec dx_norm(G.size());

    // MLP: x_out = x_mid + gelu(h2 W1^T + b1) W2^T + b2.
    dW(kFc2B) = column_sums(G, C);
    LinearGemms fc2 = linear_gemms(M, F, C, false, false);
    fc2.dgrad.epilogue = Epilogue::kDGelu;
    const Vec d_pre = run_gemm(fc2.dgrad, G, W(kFc2W), nullptr, lc.preact.data());
    dW(kFc2W) = run_gemm(fc2.wgrad, G, lc.act);
    const LinearGemms fc1 = linear_gemms(M, C, F, true, false);
    dW(kFc1W) = run_gemm(fc1.wgrad, d_pre, lc.h2, nullptr, nullptr, nullptr, dW(kFc1B).data());
    const Vec dh2 = run_gemm(fc1.dgrad, d_pre, W(kFc1W));
    ref::layernorm_backward(dx_norm.data(), dW(kLn2W).data(), dW(kLn2B).data(), dh2.data(),
                            lc.x_mid.data(), W(kLn2W).data(), lc.mean2.data(), lc.rstd2.data(), M,
                            iC);
    for (size_t i = 0; i < G.size(); ++i) G[i] += dx_norm[i];  // dL/dx_mid

    // Attention: x_mid = x + attention(LN1(x)) Wproj^T + bproj.
    dW(kProjB) = column_sums(G, C);
    const LinearGemms proj = linear_gemms(M, A, C, false, false);
    const Vec d_o = run_gemm(proj.dgrad, G, W(kProjW));
    dW(kProjW) = run_gemm(proj.wgrad, G, lc.o);
    Vec dq(M * A), dk(M * A), dv(M * A);
    reference::attention_backward(attention_shape(d), lc.q.data(), lc.k.data(), lc.v.data(),
                                  d_o.data(), dq.data(), dk.data(), dv.data());
    Vec dqkv(static_cast<size_t>(M * 3 * A));
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < A; ++j) {
        dqkv[r * 3 * A + j] = dq[r * A + j];
        dqkv[r * 3 * A + A + j] = dk[r * A + j];
        dqkv[r * 3 * A + 2 * A + j] = dv[r * A + j];
      }
    const LinearGemms qkv = linear_gemms(M, C, 3 * A, true, false);
    dW(kQkvW) = run_gemm(qkv.wgrad, dqkv, lc.h1, nullptr, nullptr, nullptr, dW(kQkvB).data());
    const Vec dh1 = run_gemm(qkv.dgrad, dqkv, W(kQkvW));
    ref::layernorm_backward(dx_norm.data(), dW(kLn1W).data(), dW(kLn1B).data(), dh1.data(),
                            lc.x.data(), W(kLn1W).data(), lc.mean1.data(), lc.rstd1.data(), M, iC);
    for (size_t i = 0; i < G.size(); ++i) G[i] += dx_norm[i];  // dL/dx
  }
  if (dx0 != nullptr) *dx0 = G;

  // The tied embedding: the embedding backward's rows, then the LM head's dlogits^T h added.
  ref::embedding_backward(Gr(GptParams::wte()).data(), Gr(GptParams::wpe()).data(), G.data(),
                          tokens, embedding_dims(d), false);
  ref::GemmRefArgs args;
  args.a = dlogits.data();
  args.b = c.hf.data();
  args.c = Gr(GptParams::wte()).data();
  args.d = Gr(GptParams::wte()).data();
  ref::gemm(head.wgrad, args);
  return c.ce.loss;
}

}  // namespace replay::test
