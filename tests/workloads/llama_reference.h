// llama_reference.h: an fp64 CPU model of the Llama shard that workloads/transformer builds with
// the Llama options (TP 1): RMSNorm, RoPE on q and k, grouped-query attention, a SwiGLU MLP with
// gate and up in one weight, no biases, an untied LM head; assembled from common/reference's ops:
// the loss of one micro-batch, and the gradient of every parameter and of the embedding output.
// Parameters are indexed as the Transformer registers them in its ParamStore, so GPU tensors map
// one to one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace replay::test {

struct LlamaDims {
  int64_t batch = 1, seq = 1, hidden = 16, heads = 2, heads_kv = 1, head_dim = 16, ffn = 16,
          vocab = 16, layers = 1;
  double eps = 1e-5;
  double rope_theta = 500000.0;
  bool rope_llama31_scaling = true;
  int64_t tokens() const { return batch * seq; }
  int64_t attn() const { return heads * head_dim; }   // q width
  int64_t kv() const { return heads_kv * head_dim; }  // k (or v) width
  int64_t qkv() const { return attn() + 2 * kv(); }   // the fused QKV row
};

// Tensor indices in registration order: the token embedding, 6 per layer (ln1 weight, fused qkv
// weight [qkv, hidden], proj weight, ln2 weight, fused gate+up weight [2 ffn, hidden], fc2 weight),
// the final norm's weight, the LM head [vocab, hidden].
enum LlamaLayerTensor {
  kLlamaLn1W,
  kLlamaQkvW,
  kLlamaProjW,
  kLlamaLn2W,
  kLlamaFc1W,
  kLlamaFc2W,
  kLlamaPerLayer
};

struct LlamaParams {
  std::vector<std::vector<double>> t;

  static int wte() { return 0; }
  static int layer(int64_t l, LlamaLayerTensor k) {
    return 1 + static_cast<int>(l) * kLlamaPerLayer + k;
  }
  static int lnf_weight(const LlamaDims& d) {
    return 1 + static_cast<int>(d.layers) * kLlamaPerLayer;
  }
  static int lm_head(const LlamaDims& d) { return lnf_weight(d) + 1; }
  static int count(const LlamaDims& d) { return lm_head(d) + 1; }
  static std::string name(const LlamaDims& d, int index);
  static std::vector<int64_t> sizes(const LlamaDims& d);  // element count of each tensor
};

// Parameters drawn N(0, stddev^2), RMSNorm weights 1 + N(0, stddev^2) (seeded).
LlamaParams random_params(const LlamaDims& d, uint64_t seed, double stddev);

// Mean cross-entropy of the micro-batch (tokens and targets [batch * seq]).
double llama_loss(const LlamaDims& d, const LlamaParams& p, const int32_t* tokens,
                  const int32_t* targets);

// The loss, and its gradient with respect to every parameter (`grads`, same layout) and to the
// embedding output x0 (`dx0`, [tokens, hidden]; may be null).
double llama_backward(const LlamaDims& d, const LlamaParams& p, const int32_t* tokens,
                      const int32_t* targets, LlamaParams* grads, std::vector<double>* dx0);

}  // namespace replay::test
