// shape.cpp: validation and description of a transformer shard's shape.
#include "workloads/transformer/shape.h"

#include "common/check.h"
#include "common/kernels/norms.h"

namespace replay::transformer {

void TransformerShape::validate() const {
  auto require = [](bool ok, const std::string& why) {
    if (!ok) throw Error("replay", "invalid shape", "transformer shape: " + why);
  };
  require(layers >= 1, "layers must be at least 1, got " + std::to_string(layers));
  require(tp >= 1, "tp must be at least 1");
  require(hidden >= 8 && hidden % 8 == 0 && hidden <= kNormMaxChannels,
          "hidden must be a multiple of 8 in [8, " + std::to_string(kNormMaxChannels) + "], got " +
              std::to_string(hidden));
  require(heads >= 1 && heads % tp == 0, "heads (" + std::to_string(heads) +
                                             ") must be a multiple of tp (" + std::to_string(tp) +
                                             ")");
  require(kv_heads() >= 1 && heads % kv_heads() == 0 && kv_heads() % tp == 0,
          "heads_kv (" + std::to_string(kv_heads()) + ") must divide heads (" +
              std::to_string(heads) + ") and be a multiple of tp (" + std::to_string(tp) + ")");
  require(head_dim >= 8 && head_dim % 8 == 0,
          "head_dim must be a positive multiple of 8, got " + std::to_string(head_dim));
  require(ffn >= 8 && ffn % (8 * tp) == 0,
          "ffn (" + std::to_string(ffn) + ") must be a multiple of 8 x tp");
  require(seq >= 1 && micro_batch >= 1, "seq and micro_batch must be positive");
  require(tokens() < (int64_t{1} << 31) / 4,
          "micro_batch x seq is too large for the kernels' int32 rows");
  require(!sequence_parallel || (tp > 1 && tokens() % tp == 0),
          "sequence parallelism needs tp > 1 and micro_batch x seq (" + std::to_string(tokens()) +
              ") a multiple of tp");
  require(vocab >= 2, "vocab must be at least 2");
  require(vocab_multiple >= 8 && vocab_multiple % 8 == 0,
          "vocab_multiple must be a positive multiple of 8, got " + std::to_string(vocab_multiple));
  require(position != PositionKind::kRope || (head_dim % 16 == 0 && rope_theta > 0.0),
          "rotary embeddings need head_dim a multiple of 16 and a positive base");
  require(dropout >= 0.0f && dropout < 1.0f, "dropout must be in [0, 1)");
  require(norm_eps > 0.0f, "norm_eps must be positive");
}

std::string TransformerShape::describe() const {
  return "layers " + std::to_string(layers) + ", hidden " + std::to_string(hidden) + ", heads " +
         std::to_string(heads) + "x" + std::to_string(head_dim) + " (" +
         std::to_string(heads_shard()) + " per GPU), ffn " + std::to_string(ffn) + " (" +
         std::to_string(ffn_shard()) + " per GPU), seq " + std::to_string(seq) + ", micro-batch " +
         std::to_string(micro_batch) + ", vocab " + std::to_string(vocab) + " padded to " +
         std::to_string(padded_vocab()) + " (" + std::to_string(vocab_shard()) + " per GPU), tp " +
         std::to_string(tp) + (sequence_parallel ? " (sequence parallel)" : "") + options();
}

std::string TransformerShape::options() const {
  std::string s;
  if (kv_heads() != heads)
    s += ", kv heads " + std::to_string(kv_heads()) + " (" + std::to_string(kv_heads_shard()) +
         " per GPU)";
  if (norm == NormKind::kRMSNorm) s += ", RMSNorm";
  if (position == PositionKind::kRope)
    s += ", RoPE base " + std::to_string(static_cast<int64_t>(rope_theta)) +
         (rope_llama31_scaling ? " with Llama 3.1 scaling" : "");
  if (mlp == MlpKind::kSwiGLU) s += ", SwiGLU";
  if (!bias) s += ", no biases";
  if (!tied_embedding) s += ", untied LM head";
  return s;
}

}  // namespace replay::transformer
