// embedding.h: token + learned position embedding over a vocab-parallel bf16 token table. Forward,
// and a deterministic backward into fp32 gradients: a stable radix sort of (token, position) pairs,
// then each token's rows summed in position order. No atomics, so the gradients are
// bit-reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace replay {

// One embedding op. This rank holds token rows [vocab_start, vocab_start + vocab_shard) of the
// table; with tensor parallelism each rank sees every token id and ids outside its shard contribute
// zero (the all-reduce that sums the ranks' outputs happens outside).
struct EmbeddingShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t channels = 0;  // multiple of 8 (16-byte rows)
  int64_t vocab_start = 0;
  int64_t vocab_shard = 0;
};

// out[b, s, :] = wte[tokens[b, s] - vocab_start] + wpe[s]   (bf16 out, fp32 sum)
// tokens: int32 [batch, seq] in device memory. wte: [vocab_shard, C]. wpe: [seq, C] or null (Llama
// has no position table). Under tensor parallelism pass wpe on one rank only, so the all-reduce
// adds it once.
void embedding_forward(__nv_bfloat16* out, const int32_t* tokens, const __nv_bfloat16* wte,
                       const __nv_bfloat16* wpe, const EmbeddingShape& shape, cudaStream_t stream);

// Workspace bytes embedding_backward needs for this shape (sort keys, values, and CUB's temporary
// storage). Queried once at plan time; the query asks CUB, so a CUDA device must be current.
size_t embedding_backward_workspace_bytes(const EmbeddingShape& shape);

// dwte[v, :] (+)= sum over (b, s) with tokens[b, s] == vocab_start + v of dout[b, s, :], summed in
// increasing b*seq + s order; dwpe[s, :] (+)= sum over b = 0, 1, ... of dout[b, s, :] (skipped when
// dwpe is null). accumulate = false overwrites both gradients (rows of tokens absent from the batch
// become zero); true adds into them, e.g. tied embeddings where the LM head already wrote its
// weight gradient into dwte. dout: bf16 [batch, seq, C].
void embedding_backward(float* dwte, float* dwpe, const __nv_bfloat16* dout, const int32_t* tokens,
                        const EmbeddingShape& shape, bool accumulate, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

}  // namespace replay
