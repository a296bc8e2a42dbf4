// reference_util.h: what the fp64 GPT and Llama reference models share (GEMMs into fresh vectors,
// the causal attention and embedding shapes, the cross-entropy head, seeded parameters) and the
// finite-difference check their tests run on them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/gemm.h"
#include "common/reference/attention.h"
#include "common/reference/training.h"

namespace replay::test {

using Vec = std::vector<double>;

// D = epilogue(A op B) for one of a linear layer's GEMMs (gemm.h's linear_gemms), into a fresh
// vector; the epilogue's operands are optional.
Vec run_gemm(const GemmDesc& g, const Vec& a, const Vec& b, const double* bias = nullptr,
             const double* aux_in = nullptr, double* aux_out = nullptr,
             double* bias_grad = nullptr);

// Causal self-attention of `heads_q` query heads on `heads_kv` KV heads, scaled 1/sqrt(head_dim).
reference::AttentionShape causal_attention_shape(int64_t batch, int64_t seq, int64_t heads_q,
                                                 int64_t heads_kv, int64_t head_dim);

// The token embedding of the whole vocabulary (no tensor-parallel shard).
ref::EmbeddingDims embedding_dims(int64_t batch, int64_t seq, int64_t hidden, int64_t vocab);

// The mean cross-entropy of logits [rows, vocab] against targets, with the row statistics its
// backward needs.
struct CrossEntropy {
  std::vector<ref::CrossEntropyRowStats> stats;
  int64_t count = 0;
  double loss = 0;
};
CrossEntropy cross_entropy(const Vec& logits, const int32_t* targets, int64_t rows, int64_t vocab);
// dloss/dlogits for dloss = 1.
Vec cross_entropy_dlogits(const CrossEntropy& ce, const Vec& logits, const int32_t* targets,
                          int64_t rows, int64_t vocab);

// Tensors of the given sizes drawn N(0, stddev^2) from one seeded stream, in order; norm weights
// (names holding "ln" or "final_norm" and ending in "weight") get 1 + N(0, stddev^2).
std::vector<Vec> random_tensors(const std::vector<int64_t>& sizes,
                                const std::function<std::string(int)>& name, uint64_t seed,
                                double stddev);

// Zero tensors shaped like `t`.
std::vector<Vec> zeros_like(const std::vector<Vec>& t);

// Tokens drawn uniformly from [0, vocab) (seeded).
std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint64_t seed);

// Expects the analytic gradients `grads` to agree with central finite differences (step 1e-5) of
// `loss` over `params` within 1e-7 + 1e-5 |fd|, at five elements of every tensor: the first, the
// middle, the last and two drawn from mt19937_64(seed). With `require_nonzero`, also expects some
// sampled gradient of each tensor above 1e-8 in magnitude. `params` is perturbed in place and
// restored. Returns the number of elements checked.
int expect_gradients_match_finite_differences(std::vector<Vec>* params,
                                              const std::vector<Vec>& grads,
                                              const std::function<double()>& loss,
                                              const std::function<std::string(int)>& name,
                                              bool require_nonzero, uint64_t seed = 99);

}  // namespace replay::test
