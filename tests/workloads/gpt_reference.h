// gpt_reference.h: an fp64 CPU model of the GPT-3 shard that workloads/transformer builds (TP 1,
// dropout 0), assembled from common/reference's ops: the loss of one micro-batch, and the gradient
// of every parameter and of the embedding output. Parameters are indexed as the Transformer
// registers them in its ParamStore, so GPU tensors map one to one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace replay::test {

struct GptDims {
  int64_t batch = 1, seq = 1, hidden = 8, heads = 1, head_dim = 8, ffn = 8, vocab = 8, layers = 1;
  double eps = 1e-5;
  int64_t tokens() const { return batch * seq; }
  int64_t attn() const { return heads * head_dim; }
};

// Tensor indices in registration order: token and position embedding, 12 per layer (ln1 weight and
// bias, qkv weight and bias, proj weight and bias, ln2 weight and bias, fc1 weight and bias, fc2
// weight and bias), then the final norm's weight and bias.
enum LayerTensor {
  kLn1W,
  kLn1B,
  kQkvW,
  kQkvB,
  kProjW,
  kProjB,
  kLn2W,
  kLn2B,
  kFc1W,
  kFc1B,
  kFc2W,
  kFc2B,
  kPerLayer
};

struct GptParams {
  std::vector<std::vector<double>> t;

  static int wte() { return 0; }
  static int wpe() { return 1; }
  static int layer(int64_t l, LayerTensor k) { return 2 + static_cast<int>(l) * kPerLayer + k; }
  static int lnf_weight(const GptDims& d) { return 2 + static_cast<int>(d.layers) * kPerLayer; }
  static int lnf_bias(const GptDims& d) { return lnf_weight(d) + 1; }
  static int count(const GptDims& d) { return lnf_bias(d) + 1; }
  static std::string name(const GptDims& d, int index);
  // Element count of each tensor.
  static std::vector<int64_t> sizes(const GptDims& d);
};

// Parameters drawn N(0, stddev^2), LayerNorm weights 1 + N(0, stddev^2) (seeded).
GptParams random_params(const GptDims& d, uint64_t seed, double stddev);

// Mean cross-entropy of the micro-batch (tokens and targets [batch * seq]).
double gpt_loss(const GptDims& d, const GptParams& p, const int32_t* tokens,
                const int32_t* targets);

// The loss, and its gradient with respect to every parameter (`grads`, same layout) and to the
// embedding output x0 (`dx0`, [tokens, hidden]).
double gpt_backward(const GptDims& d, const GptParams& p, const int32_t* tokens,
                    const int32_t* targets, GptParams* grads, std::vector<double>* dx0);

}  // namespace replay::test
