// shape.h: the shape of one GPU's shard of a decoder-only transformer: the full model's dimensions,
// the tensor-parallel degree, and everything derived from them (heads, MLP width and vocabulary
// slice per GPU, padded vocabulary, tokens per micro-batch).
#pragma once

#include <cstdint>
#include <string>

namespace replay::transformer {

struct TransformerShape {
  int64_t layers = 0;  // layers this shard runs
  int64_t hidden = 0;  // model width d
  int64_t heads = 0;   // attention heads of the full model
  int64_t head_dim = 0;
  int64_t ffn = 0;          // MLP width of the full model
  int64_t seq = 0;          // sequence length
  int64_t micro_batch = 1;  // sequences per micro-batch
  int64_t vocab = 0;        // the tokenizer's vocabulary (unpadded, e.g. 50257)
  int tp = 1;               // tensor-parallel degree; this process computes rank 0's shard
  float dropout = 0.0f;     // hidden (after attention and MLP) and attention-probability dropout
  float norm_eps = 1e-5f;

  // Megatron pads the vocabulary to a multiple of 128 x TP so that every shard is a multiple of
  // 128.
  int64_t padded_vocab() const { return (vocab + 128 * tp - 1) / (128 * tp) * (128 * tp); }
  int64_t vocab_shard() const { return padded_vocab() / tp; }
  int64_t vocab_start() const { return 0; }  // rank 0's slice
  int64_t heads_shard() const { return heads / tp; }
  int64_t attn_width() const { return heads_shard() * head_dim; }  // q (or k, or v) width per shard
  int64_t qkv_width() const { return 3 * attn_width(); }
  int64_t ffn_shard() const { return ffn / tp; }
  int64_t tokens() const { return micro_batch * seq; }  // rows of every activation

  // Throws Error naming the field when the shape cannot run (divisibility by TP, the kernels'
  // multiple-of-8 widths, norm width limit, positive sizes).
  void validate() const;
  // "layers 2, hidden 128, heads 2x64 (2 per GPU), ffn 512 (512 per GPU), seq 128, vocab 512 (512
  // per GPU), tp 1"
  std::string describe() const;
};

}  // namespace replay::transformer
