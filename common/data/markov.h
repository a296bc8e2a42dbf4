// markov.h: the synthetic token source behind replay-data: a fixed random order-k Markov chain over
// the vocabulary with a known entropy rate (the loss floor a model can reach), and its seeded
// realization.
#pragma once

#include <cstdint>
#include <string>

namespace replay::data {

struct MarkovSpec {
  int64_t vocab_size = 0;
  int order = 2;      // k: the next token depends on the last k tokens (1 or 2)
  int branching = 4;  // candidate next tokens per context (2 .. kMaxBranching, at most vocab_size)
  uint64_t seed = 0;
};

// Every context (the last k tokens) has `branching` distinct candidate next tokens drawn uniformly
// from the vocabulary, with Dirichlet(1) weights (normalised exponential draws). Both are pure
// functions of (seed, context), so no table is stored and V^2 contexts cost nothing.
class MarkovChain {
 public:
  static constexpr int kMaxBranching = 64;
  // Contexts x branching up to this size get the exact entropy rate (power iteration); larger
  // chains get the empirical estimate over kEmpiricalSteps steps.
  static constexpr int64_t kMaxExactTransitions = int64_t{1} << 22;
  static constexpr int64_t kEmpiricalSteps = int64_t{1} << 24;

  explicit MarkovChain(const MarkovSpec& spec);  // throws Error on an invalid spec

  const MarkovSpec& spec() const { return spec_; }
  int64_t num_contexts() const { return num_contexts_; }  // V^k
  // Context id of the last k tokens (oldest first): t for k = 1, t0 * V + t1 for k = 2.
  int64_t context_id(const int32_t* last_tokens) const;
  // The context that follows `context` when `token` is drawn.
  int64_t next_context(int64_t context, int32_t token) const;

  // The next-token distribution of a context: `branching` distinct tokens and their probabilities.
  void distribution(int64_t context, int32_t* tokens, double* probs) const;
  double conditional_entropy(int64_t context) const;  // nats

  struct EntropyRate {
    double nats_per_token = 0;
    std::string method;  // how it was computed, written into the data file
  };
  // The entropy rate of the run that MarkovRun realizes: sum over contexts of the stationary
  // probability (reached from the run's start context) times the conditional entropy.
  EntropyRate entropy_rate() const;
  // Exact: power iteration of the lazy chain (P + I) / 2 from the run's start context until the L1
  // change is below 1e-13 (the lazy chain has the same stationary distribution and is never
  // periodic). Throws Error when the chain is too large for it or does not converge.
  double entropy_rate_exact() const;
  // Empirical: the mean conditional entropy along `steps` steps of the run.
  double entropy_rate_empirical(int64_t steps) const;

  std::string description() const;  // "markov order-2, branching 4, Dirichlet(1) weights"

 private:
  MarkovSpec spec_;
  int64_t num_contexts_ = 0;
  uint64_t key_ = 0;  // seed-derived key of the per-context draws
};

// The seeded realization of a chain: a start context drawn from the seed, kBurnIn steps discarded,
// then one long run of tokens. replay-data cuts it into consecutive sequences.
class MarkovRun {
 public:
  static constexpr int kBurnIn = 1024;

  explicit MarkovRun(const MarkovChain& chain);
  int64_t start_context() const { return start_context_; }
  // Draws the next token; adds the conditional entropy of the context it came from to *entropy_sum.
  int32_t next(double* entropy_sum = nullptr);

 private:
  const MarkovChain& chain_;
  int64_t start_context_ = 0;
  int64_t context_ = 0;
  uint64_t state_ = 0;  // splitmix64 state of the sampling draws
};

}  // namespace replay::data
