// markov.cpp: the random order-k Markov chain, its entropy rate, and its seeded run.
#include "common/data/markov.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "common/check.h"
#include "common/data/splitmix.h"

namespace replay::data {

namespace {

// Uniform in the open interval (0, 1): never 0, so -log(u) and p log p stay finite.
double unit_open(uint64_t r) {
  return (static_cast<double>(r >> 11) + 0.5) * 0x1.0p-53;
}

double entropy(const double* probs, int n) {
  double h = 0;
  for (int i = 0; i < n; ++i) h -= probs[i] * std::log(probs[i]);
  return h;
}

}  // namespace

MarkovChain::MarkovChain(const MarkovSpec& spec) : spec_(spec) {
  REPLAY_REQUIRE(spec.order == 1 || spec.order == 2, "Markov order must be 1 or 2");
  REPLAY_REQUIRE(spec.vocab_size >= 2 && spec.vocab_size <= std::numeric_limits<int32_t>::max(),
                 "vocabulary size must be in [2, 2^31 - 1]");
  REPLAY_REQUIRE(
      spec.branching >= 2 && spec.branching <= kMaxBranching && spec.branching <= spec.vocab_size,
      "branching must be in [2, 64] and at most the vocabulary size");
  num_contexts_ = spec.order == 1 ? spec.vocab_size : spec.vocab_size * spec.vocab_size;
  key_ = mix64(spec.seed ^ 0x6A09E667F3BCC908ull);
}

int64_t MarkovChain::context_id(const int32_t* last_tokens) const {
  return spec_.order == 1 ? last_tokens[0]
                          : int64_t{last_tokens[0]} * spec_.vocab_size + last_tokens[1];
}

int64_t MarkovChain::next_context(int64_t context, int32_t token) const {
  return spec_.order == 1 ? token : (context % spec_.vocab_size) * spec_.vocab_size + token;
}

void MarkovChain::distribution(int64_t context, int32_t* tokens, double* probs) const {
  uint64_t state = mix64(key_ + static_cast<uint64_t>(context) * kGolden);
  const auto vocab = static_cast<uint64_t>(spec_.vocab_size);
  int n = 0;
  while (n < spec_.branching) {  // distinct candidates; the modulo bias is below 2^-32
    const auto t = static_cast<int32_t>(splitmix(state) % vocab);
    bool seen = false;
    for (int i = 0; i < n; ++i) seen = seen || tokens[i] == t;
    if (!seen) tokens[n++] = t;
  }
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += probs[i] = -std::log(unit_open(splitmix(state)));
  for (int i = 0; i < n; ++i) probs[i] /= sum;
}

double MarkovChain::conditional_entropy(int64_t context) const {
  int32_t tokens[kMaxBranching];
  double probs[kMaxBranching];
  distribution(context, tokens, probs);
  return entropy(probs, spec_.branching);
}

MarkovChain::EntropyRate MarkovChain::entropy_rate() const {
  if (num_contexts_ * spec_.branching <= kMaxExactTransitions)
    return {entropy_rate_exact(), "exact: stationary distribution by power iteration"};
  std::ostringstream method;
  method << "empirical: mean conditional entropy over " << kEmpiricalSteps << " steps of the run";
  return {entropy_rate_empirical(kEmpiricalSteps), method.str()};
}

double MarkovChain::entropy_rate_exact() const {
  REPLAY_REQUIRE(num_contexts_ * spec_.branching <= kMaxExactTransitions,
                 "chain too large for the exact entropy rate; use entropy_rate_empirical");
  const int64_t n = num_contexts_;
  const int b = spec_.branching;
  // The sparse transition matrix: `b` successor contexts and probabilities per context.
  std::vector<int64_t> successor(static_cast<size_t>(n * b));
  std::vector<double> prob(static_cast<size_t>(n * b));
  std::vector<double> cond_entropy(static_cast<size_t>(n));
  int32_t tokens[kMaxBranching];
  for (int64_t c = 0; c < n; ++c) {
    distribution(c, tokens, &prob[c * b]);
    for (int j = 0; j < b; ++j) successor[c * b + j] = next_context(c, tokens[j]);
    cond_entropy[c] = entropy(&prob[c * b], b);
  }
  std::vector<double> pi(static_cast<size_t>(n), 0.0), next(static_cast<size_t>(n));
  pi[MarkovRun(*this).start_context()] = 1.0;
  constexpr int kMaxIterations = 20000;
  double change = 1;
  for (int it = 0; it < kMaxIterations && change >= 1e-13; ++it) {
    for (int64_t c = 0; c < n; ++c) next[c] = 0.5 * pi[c];
    for (int64_t c = 0; c < n; ++c) {
      if (pi[c] == 0) continue;
      for (int j = 0; j < b; ++j) next[successor[c * b + j]] += 0.5 * pi[c] * prob[c * b + j];
    }
    change = 0;
    for (int64_t c = 0; c < n; ++c) change += std::fabs(next[c] - pi[c]);
    pi.swap(next);
  }
  REPLAY_REQUIRE(change < 1e-13,
                 "power iteration did not converge for this chain (" + description() + ")");
  double rate = 0;
  for (int64_t c = 0; c < n; ++c) rate += pi[c] * cond_entropy[c];
  return rate;
}

double MarkovChain::entropy_rate_empirical(int64_t steps) const {
  REPLAY_REQUIRE(steps > 0, "empirical entropy rate needs at least one step");
  MarkovRun run(*this);
  double sum = 0;
  for (int64_t i = 0; i < steps; ++i) run.next(&sum);
  return sum / static_cast<double>(steps);
}

std::string MarkovChain::description() const {
  std::ostringstream os;
  os << "markov order-" << spec_.order << ", branching " << spec_.branching
     << ", Dirichlet(1) weights";
  return os.str();
}

MarkovRun::MarkovRun(const MarkovChain& chain)
    : chain_(chain), state_(mix64(chain.spec().seed ^ 0xBB67AE8584CAA73Bull)) {
  int32_t first[2];
  for (int i = 0; i < chain.spec().order; ++i)
    first[i] =
        static_cast<int32_t>(splitmix(state_) % static_cast<uint64_t>(chain.spec().vocab_size));
  start_context_ = context_ = chain.context_id(first);
  for (int i = 0; i < kBurnIn; ++i) next();
}

int32_t MarkovRun::next(double* entropy_sum) {
  int32_t tokens[MarkovChain::kMaxBranching];
  double probs[MarkovChain::kMaxBranching];
  const int b = chain_.spec().branching;
  chain_.distribution(context_, tokens, probs);
  if (entropy_sum) *entropy_sum += entropy(probs, b);
  const double u = unit_open(splitmix(state_));
  int pick = b - 1;  // the last candidate also takes what rounding leaves of the unit interval
  double cumulative = 0;
  for (int i = 0; i < b - 1; ++i) {
    cumulative += probs[i];
    if (u < cumulative) {
      pick = i;
      break;
    }
  }
  context_ = chain_.next_context(context_, tokens[pick]);
  return tokens[pick];
}

}  // namespace replay::data
