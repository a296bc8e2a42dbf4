// shape.h: the shape of one GPU's shard of a decoder-only transformer: the full model's dimensions,
// the tensor-parallel degree, the architecture's options (GPT-3: LayerNorm, learned positions,
// GeLU, biases, tied embeddings; Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases,
// an untied LM head), and everything derived from them (heads, MLP width and vocabulary slice per
// GPU, padded vocabulary, tokens per micro-batch).
#pragma once

#include <cstdint>
#include <string>

namespace replay::transformer {

enum class NormKind : uint8_t { kLayerNorm, kRMSNorm };
enum class MlpKind : uint8_t {
  kGelu,    // fc1 -> GeLU -> fc2
  kSwiGLU,  // fc1 computes gate and up in one GEMM ([M, 2F]) -> silu(gate) * up -> fc2
};
enum class PositionKind : uint8_t {
  kLearned,  // a [seq, C] position table added to the token embedding
  kRope,     // rotary embedding of q and k inside the fused QKV output
};

struct TransformerShape {
  int64_t layers = 0;    // layers this shard runs
  int64_t hidden = 0;    // model width d
  int64_t heads = 0;     // attention (query) heads of the full model
  int64_t heads_kv = 0;  // key/value heads of the full model; 0: heads (MHA), fewer: GQA
  int64_t head_dim = 0;
  int64_t ffn = 0;          // MLP width of the full model
  int64_t seq = 0;          // sequence length
  int64_t micro_batch = 1;  // sequences per micro-batch
  int64_t vocab = 0;        // the tokenizer's vocabulary (unpadded, e.g. 50257)
  int tp = 1;               // tensor-parallel degree
  int tp_rank = 0;          // the shard this process computes (0 in a one-process run: rank 0's)
  // Megatron's sequence parallelism (tp > 1): the residual stream, the norms and the hidden
  // dropout hold a 1/tp slice of the tokens; all-gathers before the column-parallel layers and
  // reduce-scatters after the row-parallel ones take the place of the all-reduces.
  bool sequence_parallel = false;
  float dropout = 0.0f;  // hidden (after attention and MLP) and attention-probability dropout
  float norm_eps = 1e-5f;
  int64_t vocab_multiple = 128;  // the padded vocabulary is a multiple of this x TP

  // Architecture options; the defaults are GPT-3's.
  NormKind norm = NormKind::kLayerNorm;
  MlpKind mlp = MlpKind::kGelu;
  PositionKind position = PositionKind::kLearned;
  bool bias = true;                   // biases on QKV, output projection, fc1 and fc2
  bool tied_embedding = true;         // the LM head reuses the token embedding
  double rope_theta = 10000.0;        // kRope: the base
  bool rope_llama31_scaling = false;  // kRope: Llama 3.1 frequency scaling (rope.h RopeScaling)

  // Megatron pads the vocabulary to a multiple of vocab_multiple x TP (128 by default) so that
  // every shard is a multiple of vocab_multiple.
  int64_t padded_vocab() const {
    const int64_t m = vocab_multiple * tp;
    return (vocab + m - 1) / m * m;
  }
  int64_t vocab_shard() const { return padded_vocab() / tp; }
  int64_t vocab_start() const { return tp_rank * vocab_shard(); }  // this rank's first row
  int64_t heads_shard() const { return heads / tp; }
  int64_t attn_width() const { return heads_shard() * head_dim; }  // q (or k, or v) width per shard
  int64_t kv_heads() const { return heads_kv > 0 ? heads_kv : heads; }
  int64_t kv_heads_shard() const { return kv_heads() / tp; }
  // The fused QKV row per shard: the q heads, then the k heads, then the v heads.
  int64_t qkv_width() const { return (heads_shard() + 2 * kv_heads_shard()) * head_dim; }
  int64_t ffn_shard() const { return ffn / tp; }
  // fc1's output width per shard: F, or 2F with SwiGLU's fused gate and up.
  int64_t fc1_width() const { return mlp == MlpKind::kSwiGLU ? 2 * ffn_shard() : ffn_shard(); }
  int64_t tokens() const { return micro_batch * seq; }  // rows of a micro-batch's activations
  // Rows of the residual stream, the norms and the hidden dropout on this rank: the tokens, or
  // with sequence parallelism this rank's contiguous 1/tp of them, starting at seq_first_token().
  int64_t seq_tokens() const { return sequence_parallel ? tokens() / tp : tokens(); }
  int64_t seq_first_token() const { return sequence_parallel ? tp_rank * seq_tokens() : 0; }

  // Throws Error naming the field when the shape cannot run (divisibility by TP, the kernels'
  // multiple-of-8 widths, norm width limit, positive sizes).
  void validate() const;
  // "layers 2, hidden 128, heads 2x64 (2 per GPU), ffn 512 (512 per GPU), seq 128, vocab 512 (512
  // per GPU), tp 1", with the key/value heads and the non-GPT options when set.
  std::string describe() const;

 private:
  std::string options() const;  // ", kv heads 8 (1 per GPU), RMSNorm, ..." or empty (GPT-3)
};

}  // namespace replay::transformer
