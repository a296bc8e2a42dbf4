// llama_reference.cpp: the fp64 Llama shard, forward and backward, from common/reference's ops.
#include "tests/workloads/llama_reference.h"

#include "common/reference/pointwise.h"
#include "tests/workloads/reference_util.h"

namespace replay::test {

namespace {

struct LayerCache {
  Vec x, rstd1, h1, q, k, v, o, lse, x_mid, rstd2, h2, pre, act;  // q and k after the rotation
};

struct Cache {
  std::vector<LayerCache> layers;
  Vec x_final, rstdf, hf, logits;
  CrossEntropy ce;
};

Vec add(const Vec& a, const Vec& b) {
  Vec out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

reference::AttentionShape attention_shape(const LlamaDims& d) {
  return causal_attention_shape(d.batch, d.seq, d.heads, d.heads_kv, d.head_dim);
}

RopeLayout rope_layout(const LlamaDims& d, int64_t heads) {
  RopeLayout r;
  r.batch = d.batch;
  r.seq = d.seq;
  r.heads = static_cast<int>(heads);
  r.head_dim = static_cast<int>(d.head_dim);
  r.rope_dim = r.head_dim;
  return r;
}

Vec rope_freqs(const LlamaDims& d) {
  return ref::rope_frequencies(static_cast<int>(d.head_dim), d.rope_theta,
                               d.rope_llama31_scaling ? RopeScaling::llama31() : RopeScaling{});
}

ref::EmbeddingDims embedding_dims(const LlamaDims& d) {
  return test::embedding_dims(d.batch, d.seq, d.hidden, d.vocab);
}

// Columns [begin, begin + width) of every row of x [rows, stride].
Vec columns(const Vec& x, int64_t rows, int64_t stride, int64_t begin, int64_t width) {
  Vec out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = x[r * stride + begin + j];
  return out;
}

Cache forward(const LlamaDims& d, const LlamaParams& p, const int32_t* tokens,
              const int32_t* targets) {
  const int64_t M = d.tokens(), C = d.hidden, A = d.attn(), K = d.kv(), W = d.qkv(), F = d.ffn,
                V = d.vocab;
  const int iC = static_cast<int>(C);
  const Vec freqs = rope_freqs(d);
  auto P = [&](int i) -> const Vec& { return p.t.at(static_cast<size_t>(i)); };
  Cache c;
  Vec x(static_cast<size_t>(M * C));
  ref::embedding_forward(x.data(), tokens, P(LlamaParams::wte()).data(), nullptr,
                         embedding_dims(d));
  for (int64_t l = 0; l < d.layers; ++l) {
    auto Wt = [&](LlamaLayerTensor k) -> const Vec& { return P(LlamaParams::layer(l, k)); };
    LayerCache lc;
    lc.x = x;
    lc.h1.resize(x.size()), lc.rstd1.resize(M);
    ref::rmsnorm_forward(lc.h1.data(), lc.rstd1.data(), x.data(), Wt(kLlamaLn1W).data(), M, iC,
                         d.eps);
    const Vec qkv = run_gemm(linear_gemms(M, C, W, false, false).forward, lc.h1, Wt(kLlamaQkvW));
    const Vec q = columns(qkv, M, W, 0, A), k = columns(qkv, M, W, A, K);
    lc.v = columns(qkv, M, W, A + K, K);
    lc.q.resize(q.size()), lc.k.resize(k.size());
    ref::rope_forward(lc.q.data(), q.data(), freqs, nullptr, rope_layout(d, d.heads));
    ref::rope_forward(lc.k.data(), k.data(), freqs, nullptr, rope_layout(d, d.heads_kv));
    lc.o.resize(M * A), lc.lse.resize(M * d.heads);
    reference::attention_forward(attention_shape(d), lc.q.data(), lc.k.data(), lc.v.data(),
                                 lc.o.data(), lc.lse.data());
    lc.x_mid = add(x, run_gemm(linear_gemms(M, A, C, false, false).forward, lc.o, Wt(kLlamaProjW)));
    lc.h2.resize(x.size()), lc.rstd2.resize(M);
    ref::rmsnorm_forward(lc.h2.data(), lc.rstd2.data(), lc.x_mid.data(), Wt(kLlamaLn2W).data(), M,
                         iC, d.eps);
    lc.pre = run_gemm(linear_gemms(M, C, 2 * F, false, false).forward, lc.h2, Wt(kLlamaFc1W));
    lc.act.resize(M * F);
    ref::swiglu_forward(lc.act.data(), lc.pre.data(), M, static_cast<int>(F));
    x = add(lc.x_mid,
            run_gemm(linear_gemms(M, F, C, false, false).forward, lc.act, Wt(kLlamaFc2W)));
    c.layers.push_back(std::move(lc));
  }
  c.x_final = x;
  c.hf.resize(x.size()), c.rstdf.resize(M);
  ref::rmsnorm_forward(c.hf.data(), c.rstdf.data(), x.data(), P(LlamaParams::lnf_weight(d)).data(),
                       M, iC, d.eps);
  c.logits =
      run_gemm(linear_gemms(M, C, V, false, false).forward, c.hf, P(LlamaParams::lm_head(d)));
  c.ce = cross_entropy(c.logits, targets, M, V);
  return c;
}

}  // namespace

std::string LlamaParams::name(const LlamaDims& d, int index) {
  static const char* kLayer[kLlamaPerLayer] = {"ln1.weight", "attn.qkv.weight", "attn.proj.weight",
                                               "ln2.weight", "mlp.fc1.weight",  "mlp.fc2.weight"};
  if (index == wte()) return "embedding.token";
  if (index == lnf_weight(d)) return "final_norm.weight";
  if (index == lm_head(d)) return "lm_head.weight";
  const int i = index - 1;
  return "layer" + std::to_string(i / kLlamaPerLayer) + "." + kLayer[i % kLlamaPerLayer];
}

std::vector<int64_t> LlamaParams::sizes(const LlamaDims& d) {
  const int64_t C = d.hidden, A = d.attn(), F = d.ffn;
  std::vector<int64_t> s = {d.vocab * C};
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::vector<int64_t> layer = {C, d.qkv() * C, C * A, C, 2 * F * C, C * F};
    s.insert(s.end(), layer.begin(), layer.end());
  }
  s.push_back(C);
  s.push_back(d.vocab * C);
  return s;
}

LlamaParams random_params(const LlamaDims& d, uint64_t seed, double stddev) {
  LlamaParams p;
  p.t = random_tensors(
      LlamaParams::sizes(d), [&](int i) { return LlamaParams::name(d, i); }, seed, stddev);
  return p;
}

double llama_loss(const LlamaDims& d, const LlamaParams& p, const int32_t* tokens,
                  const int32_t* targets) {
  return forward(d, p, tokens, targets).ce.loss;
}

double llama_backward(const LlamaDims& d, const LlamaParams& p, const int32_t* tokens,
                      const int32_t* targets, LlamaParams* grads, std::vector<double>* dx0) {
  const int64_t M = d.tokens(), C = d.hidden, A = d.attn(), K = d.kv(), W = d.qkv(), F = d.ffn,
                V = d.vocab;
  const int iC = static_cast<int>(C);
  const Vec freqs = rope_freqs(d);
  const Cache c = forward(d, p, tokens, targets);
  auto P = [&](int i) -> const Vec& { return p.t.at(static_cast<size_t>(i)); };
  grads->t = zeros_like(p.t);
  auto Gr = [&](int i) -> Vec& { return grads->t.at(static_cast<size_t>(i)); };

  // Head: cross-entropy, the untied LM head, the final norm.
  const Vec dlogits = cross_entropy_dlogits(c.ce, c.logits, targets, M, V);
  const LinearGemms head = linear_gemms(M, C, V, false, false);
  Gr(LlamaParams::lm_head(d)) = run_gemm(head.wgrad, dlogits, c.hf);
  const Vec dhf = run_gemm(head.dgrad, dlogits, P(LlamaParams::lm_head(d)));
  Vec G(static_cast<size_t>(M * C));
  ref::rmsnorm_backward(G.data(), Gr(LlamaParams::lnf_weight(d)).data(), dhf.data(),
                        c.x_final.data(), P(LlamaParams::lnf_weight(d)).data(), c.rstdf.data(), M,
                        iC);

  for (int64_t l = d.layers - 1; l >= 0; --l) {
    const LayerCache& lc = c.layers[static_cast<size_t>(l)];
    auto Wt = [&](LlamaLayerTensor k) -> const Vec& { return P(LlamaParams::layer(l, k)); };
    auto dW = [&](LlamaLayerTensor k) -> Vec& { return Gr(LlamaParams::layer(l, k)); };
    Vec dx_norm(G.size());

    // MLP: x_out = x_mid + swiglu(h2 W1^T) W2^T.
    const LinearGemms fc2 = linear_gemms(M, F, C, false, false);
    const Vec d_act = run_gemm(fc2.dgrad, G, Wt(kLlamaFc2W));
    dW(kLlamaFc2W) = run_gemm(fc2.wgrad, G, lc.act);
    Vec d_pre(lc.pre.size());
    ref::swiglu_backward(d_pre.data(), d_act.data(), lc.pre.data(), M, static_cast<int>(F));
    const LinearGemms fc1 = linear_gemms(M, C, 2 * F, false, false);
    dW(kLlamaFc1W) = run_gemm(fc1.wgrad, d_pre, lc.h2);
    const Vec dh2 = run_gemm(fc1.dgrad, d_pre, Wt(kLlamaFc1W));
    ref::rmsnorm_backward(dx_norm.data(), dW(kLlamaLn2W).data(), dh2.data(), lc.x_mid.data(),
                          Wt(kLlamaLn2W).data(), lc.rstd2.data(), M, iC);
    for (size_t i = 0; i < G.size(); ++i) G[i] += dx_norm[i];  // dL/dx_mid

    // Attention: x_mid = x + attention(rope(q), rope(k), v) Wproj^T.
    const LinearGemms proj = linear_gemms(M, A, C, false, false);
    const Vec d_o = run_gemm(proj.dgrad, G, Wt(kLlamaProjW));
    dW(kLlamaProjW) = run_gemm(proj.wgrad, G, lc.o);
    Vec dq_rot(M * A), dk_rot(M * K), dv(M * K), dq(M * A), dk(M * K);
    reference::attention_backward(attention_shape(d), lc.q.data(), lc.k.data(), lc.v.data(),
                                  d_o.data(), dq_rot.data(), dk_rot.data(), dv.data());
    ref::rope_backward(dq.data(), dq_rot.data(), freqs, nullptr, rope_layout(d, d.heads));
    ref::rope_backward(dk.data(), dk_rot.data(), freqs, nullptr, rope_layout(d, d.heads_kv));
    Vec dqkv(static_cast<size_t>(M * W));
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t j = 0; j < A; ++j) dqkv[r * W + j] = dq[r * A + j];
      for (int64_t j = 0; j < K; ++j) {
        dqkv[r * W + A + j] = dk[r * K + j];
        dqkv[r * W + A + K + j] = dv[r * K + j];
      }
    }
    const LinearGemms qkv = linear_gemms(M, C, W, false, false);
    dW(kLlamaQkvW) = run_gemm(qkv.wgrad, dqkv, lc.h1);
    const Vec dh1 = run_gemm(qkv.dgrad, dqkv, Wt(kLlamaQkvW));
    ref::rmsnorm_backward(dx_norm.data(), dW(kLlamaLn1W).data(), dh1.data(), lc.x.data(),
                          Wt(kLlamaLn1W).data(), lc.rstd1.data(), M, iC);
    for (size_t i = 0; i < G.size(); ++i) G[i] += dx_norm[i];  // dL/dx
  }
  if (dx0 != nullptr) *dx0 = G;
  ref::embedding_backward(Gr(LlamaParams::wte()).data(), nullptr, G.data(), tokens,
                          embedding_dims(d), false);
  return c.ce.loss;
}

}  // namespace replay::test
