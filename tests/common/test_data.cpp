// Data files on the CPU: the Markov source (its entropy rate against closed forms and linear
// algebra, its samples against its probabilities), HDF5 round trips, the atomic writer, the default
// dataset, and every reader error. Nothing here touches a GPU: validation runs before any GPU work.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>

#include "common/data/generate.h"
#include "common/data/markov.h"
#include "common/data/token_file.h"
#include "tests/common/test_data_util.h"

namespace replay::data {
namespace {

using test::TempDir;

double binary_entropy(double x) {
  return -x * std::log(x) - (1 - x) * std::log(1 - x);
}

std::vector<int32_t> read_all(const TokenFile& file) {
  std::vector<int32_t> all(static_cast<size_t>(file.info().num_sequences * file.row_tokens()));
  file.read_rows(0, file.info().num_sequences, all.data());
  return all;
}

TEST(MarkovChain, DistributionsAreDistinctCandidatesThatSumToOne) {
  const MarkovChain chain({1000, 2, 5, 42});
  const MarkovChain other({1000, 2, 5, 43});
  int differ = 0;
  for (int64_t c : {int64_t{0}, int64_t{1}, int64_t{12345}, int64_t{999999}}) {
    int32_t tokens[5], again[5], tokens_other[5];
    double probs[5], probs_again[5], probs_other[5];
    chain.distribution(c, tokens, probs);
    chain.distribution(c, again, probs_again);
    other.distribution(c, tokens_other, probs_other);
    double sum = 0;
    for (int i = 0; i < 5; ++i) {
      EXPECT_GE(tokens[i], 0);
      EXPECT_LT(tokens[i], 1000);
      for (int j = 0; j < i; ++j) EXPECT_NE(tokens[i], tokens[j]);
      EXPECT_GT(probs[i], 0);
      EXPECT_EQ(tokens[i], again[i]);  // a pure function of (seed, context)
      EXPECT_EQ(probs[i], probs_again[i]);
      differ += tokens[i] != tokens_other[i];
      sum += probs[i];
    }
    EXPECT_NEAR(sum, 1.0, 1e-15);
  }
  EXPECT_GT(differ, 0) << "another seed must give another chain";
  EXPECT_THROW(MarkovChain({1000, 3, 4, 0}), Error);
  EXPECT_THROW(MarkovChain({3, 1, 4, 0}), Error);  // more candidates than tokens
  EXPECT_THROW(MarkovChain({1000, 1, 1, 0}), Error);
}

// Two tokens, order 1: P(0 -> 1) = a, P(1 -> 0) = c, pi = (c, a) / (a + c), and the entropy rate is
// pi_0 h(a) + pi_1 h(c) with h the binary entropy.
TEST(MarkovChain, EntropyRateOfTwoStateChainMatchesClosedForm) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const MarkovChain chain({2, 1, 2, seed});
    double p_next[2][2] = {};
    for (int s = 0; s < 2; ++s) {
      int32_t tokens[2];
      double probs[2];
      chain.distribution(s, tokens, probs);
      for (int j = 0; j < 2; ++j) p_next[s][tokens[j]] = probs[j];
    }
    const double a = p_next[0][1], c = p_next[1][0];
    const double expected = c / (a + c) * binary_entropy(a) + a / (a + c) * binary_entropy(c);
    EXPECT_NEAR(chain.entropy_rate_exact(), expected, 1e-12) << "seed " << seed;
    EXPECT_NEAR(chain.entropy_rate().nats_per_token, expected, 1e-12);
    EXPECT_NE(chain.entropy_rate().method.find("exact"), std::string::npos);
  }
}

// Order 2 over 3 tokens: 9 contexts. The stationary distribution solved directly (pi (P - I) = 0
// with sum(pi) = 1, by Gaussian elimination) gives the entropy rate that power iteration must
// match.
TEST(MarkovChain, EntropyRateOfOrderTwoChainMatchesLinearSolve) {
  const MarkovChain chain({3, 2, 2, 7});
  const int n = 9;
  std::vector<std::vector<double>> a(n,
                                     std::vector<double>(n + 1, 0.0));  // [A | rhs], A = (P - I)^T
  std::vector<double> h(n);
  for (int s = 0; s < n; ++s) {
    int32_t tokens[2];
    double probs[2];
    chain.distribution(s, tokens, probs);
    h[s] = -probs[0] * std::log(probs[0]) - probs[1] * std::log(probs[1]);
    a[s][s] -= 1.0;
    for (int j = 0; j < 2; ++j) a[chain.next_context(s, tokens[j])][s] += probs[j];
  }
  for (int s = 0; s < n; ++s) a[n - 1][s] = 1.0;  // replace one balance equation by sum(pi) = 1
  a[n - 1][n] = 1.0;
  for (int col = 0; col < n; ++col) {
    int pivot = col;
    for (int r = col + 1; r < n; ++r)
      if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
    ASSERT_GT(std::fabs(a[pivot][col]), 1e-9)
        << "this chain has more than one stationary distribution";
    std::swap(a[col], a[pivot]);
    for (int r = 0; r < n; ++r) {
      if (r == col) continue;
      const double f = a[r][col] / a[col][col];
      for (int k = col; k <= n; ++k) a[r][k] -= f * a[col][k];
    }
  }
  double expected = 0;
  for (int s = 0; s < n; ++s) expected += a[s][n] / a[s][s] * h[s];
  EXPECT_NEAR(chain.entropy_rate_exact(), expected, 1e-12);
  EXPECT_NEAR(chain.entropy_rate_empirical(1 << 20), expected, 5e-3);
}

TEST(MarkovChain, LargeChainsUseTheEmpiricalEstimate) {
  const MarkovChain small({64, 2, 4, 5});
  EXPECT_NEAR(small.entropy_rate_empirical(1 << 20), small.entropy_rate_exact(), 3e-3);
  const MarkovChain large({50257, 2, 4, 5});
  EXPECT_THROW(large.entropy_rate_exact(), Error);
  // Dirichlet(1) weights over 4 candidates: E[H] = 1 + 1/2 + 1/3 + 1/4 - 1 nats.
  EXPECT_NEAR(large.entropy_rate_empirical(1 << 18), 13.0 / 12.0, 0.01);
}

// Generated data against the chain: every transition is one of the context's candidates, each
// candidate's frequency is within 5 standard errors of its probability, the mean log-loss of the
// true chain on the data is the entropy rate, and the file's sample_entropy is the mean conditional
// entropy.
TEST(MarkovData, SampleStatisticsMatchTheChain) {
  TempDir dir;
  const MarkovDatasetParams params{16, 63, 4096, 99, 2, 3};
  const TokenFileInfo written = generate_markov_dataset(dir.file("m.h5"), params);
  const TokenFile file(dir.file("m.h5"), {1, 63, 16});
  const std::vector<int32_t> s = read_all(file);  // consecutive rows are consecutive in the run
  const MarkovChain chain({16, 2, 3, 99});
  std::map<int64_t, std::map<int32_t, int64_t>> counts;
  std::map<int64_t, int64_t> totals;
  double log_loss = 0, entropy_at_targets = 0;
  int64_t targets = 0;
  for (size_t i = 2; i < s.size(); ++i) {
    const int64_t ctx = chain.context_id(&s[i - 2]);
    int32_t tokens[3];
    double probs[3];
    chain.distribution(ctx, tokens, probs);
    int j = 0;
    while (j < 3 && tokens[j] != s[i]) ++j;
    ASSERT_LT(j, 3) << "token " << s[i] << " at " << i << " is not a candidate of context " << ctx;
    log_loss -= std::log(probs[j]);
    ++counts[ctx][s[i]];
    ++totals[ctx];
    if (i % 64 != 0) {  // a target position (1..seq_len) of its row
      entropy_at_targets += chain.conditional_entropy(ctx);
      ++targets;
    }
  }
  int checked = 0;
  for (const auto& [ctx, total] : totals) {
    if (total < 300) continue;
    int32_t tokens[3];
    double probs[3];
    chain.distribution(ctx, tokens, probs);
    for (int j = 0; j < 3; ++j) {
      const double freq = static_cast<double>(counts[ctx][tokens[j]]) / total;
      const double se = std::sqrt(probs[j] * (1 - probs[j]) / total);
      EXPECT_NEAR(freq, probs[j], 5 * se + 1e-12) << "context " << ctx << " candidate " << j;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100);
  const double rate = written.provenance.entropy_rate;
  EXPECT_NEAR(log_loss / static_cast<double>(s.size() - 2), rate, 0.01);
  EXPECT_NEAR(entropy_at_targets / targets, file.info().provenance.sample_entropy, 1e-4);
  EXPECT_NEAR(file.info().provenance.sample_entropy, rate, 0.01);
}

TEST(TokenFile, GeneratedFileRoundTripsExactly) {
  TempDir dir;
  const MarkovDatasetParams params{100, 31, 50, 5, 1, 3};
  const TokenFileInfo written = generate_markov_dataset(dir.file("g.h5"), params);
  const TokenFile file(dir.file("g.h5"), {2, 31, 128});
  const TokenFileInfo& info = file.info();
  EXPECT_EQ(info.vocab_size, 100);
  EXPECT_EQ(info.seq_len, 31);
  EXPECT_EQ(info.num_sequences, 50);
  ASSERT_TRUE(info.provenance.seed.has_value());
  EXPECT_EQ(*info.provenance.seed, 5u);
  EXPECT_EQ(info.provenance.generator,
            "replay-data: markov order-1, branching 3, Dirichlet(1) weights");
  EXPECT_EQ(info.provenance.entropy_rate, written.provenance.entropy_rate);  // bit-exact float64
  EXPECT_EQ(info.provenance.entropy_rate_method, written.provenance.entropy_rate_method);
  EXPECT_EQ(info.provenance.sample_entropy, written.provenance.sample_entropy);

  const MarkovChain chain({100, 1, 3, 5});
  MarkovRun run(chain);
  const std::vector<int32_t> all = read_all(file);
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], run.next()) << "token " << i;
  std::vector<int32_t> rows(3 * 32);  // a row range in the middle
  file.read_rows(20, 3, rows.data());
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i], all[20 * 32 + i]);
}

TEST(TokenFileWriter, WritesInPiecesAndRenamesOnlyOnCommit) {
  TempDir dir;
  const std::string path = dir.file("w.h5");
  const int64_t rows = 37, seq = 9;
  std::vector<int32_t> tokens(rows * (seq + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 1000);
  {
    TokenFileWriter writer(path, 1000, seq, rows);
    writer.write_rows(0, 5, tokens.data());
    writer.write_rows(5, 30, tokens.data() + 5 * (seq + 1));
    writer.write_rows(35, 2, tokens.data() + 35 * (seq + 1));
    EXPECT_FALSE(std::filesystem::exists(path)) << "nothing under the final name before commit";
    EXPECT_TRUE(std::filesystem::exists(writer.temp_path()));
    writer.commit({});
    EXPECT_FALSE(std::filesystem::exists(writer.temp_path()));
  }
  const TokenFile file(path, {1, seq, 1000});
  EXPECT_EQ(read_all(file), tokens);
  EXPECT_FALSE(file.info().provenance.seed.has_value());
  EXPECT_TRUE(std::isnan(file.info().provenance.entropy_rate));

  {  // abandoned: an error or a cancel between writes leaves nothing at all
    TokenFileWriter writer(dir.file("abandoned.h5"), 1000, seq, rows);
    writer.write_rows(0, 5, tokens.data());
  }
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

TEST(MarkovData, CancelLeavesNothingBehind) {
  TempDir dir;
  const MarkovDatasetParams params{100, 1023, 2048, 1, 1, 4};
  int calls = 0;
  EXPECT_THROW(generate_markov_dataset(dir.file("c.h5"), params, {},
                                       [&](int64_t, int64_t) { return ++calls < 2; }),
               Error);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 0);
}

TEST(MarkovData, DefaultDatasetIsGeneratedOnceAndNamedByItsParameters) {
  TempDir dir;
  const MarkovDatasetParams params{100, 31, 64, 7, 2, 4};
  const std::string path = default_dataset_path(params, dir.path().string());
  EXPECT_EQ(std::filesystem::path(path).filename(), "markov-v100-s31-n64-o2-b4-seed7.h5");
  EXPECT_EQ(ensure_dataset(params, dir.path().string()), path);
  ASSERT_TRUE(std::filesystem::exists(path));
  const auto written_at = std::filesystem::last_write_time(path);
  EXPECT_EQ(ensure_dataset(params, dir.path().string()), path);  // found, not rewritten
  EXPECT_EQ(std::filesystem::last_write_time(path), written_at);
  const TokenFile file(path, {4, 31, 100});
  EXPECT_EQ(file.info().num_sequences, 64);

  ASSERT_EQ(setenv("REPLAY_DATA_DIR", dir.path().c_str(), 1), 0);
  EXPECT_EQ(default_data_dir(), dir.path().string());
  ASSERT_EQ(unsetenv("REPLAY_DATA_DIR"), 0);
  EXPECT_NE(default_data_dir(), dir.path().string());
}

// A hand-made file for the error cases: which parts it has, and the type and shape of /tokens.
struct Layout {
  bool format = true;
  bool tokens = true;
  hid_t type = H5T_STD_I32LE;
  std::vector<hsize_t> dims = {8, 17};
  int64_t vocab = 100, seq_len = 16, num_sequences = 8;
};

void write_layout(const std::string& path, const Layout& l) {
  H5Guard guard;
  H5Id file =
      REPLAY_H5_OWN(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  H5Id root = REPLAY_H5_OWN(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);
  if (l.format) {
    write_attr(root.get(), "format", std::string(kFormatName));
    write_attr(root.get(), "format_version", kFormatVersion);
  }
  write_attr(root.get(), "vocab_size", l.vocab);
  write_attr(root.get(), "seq_len", l.seq_len);
  write_attr(root.get(), "num_sequences", l.num_sequences);
  if (!l.tokens) return;
  H5Id space = REPLAY_H5_OWN(
      H5Screate_simple(static_cast<int>(l.dims.size()), l.dims.data(), nullptr), H5Sclose);
  H5Id tokens = REPLAY_H5_OWN(
      H5Dcreate2(file.get(), "tokens", l.type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
      H5Dclose);
  hsize_t n = 1;
  for (hsize_t d : l.dims) n *= d;
  std::vector<int32_t> values(n);
  for (hsize_t i = 0; i < n; ++i) values[i] = static_cast<int32_t>(i % 100);
  REPLAY_HDF5_CHECK(
      H5Dwrite(tokens.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
}

// Opening must fail with an Error naming the file and containing `problem`.
void expect_bad_file(const std::string& path, const BatchShape& shape, const std::string& problem) {
  try {
    TokenFile file(path, shape);
    ADD_FAILURE() << "opened " << path << " but expected: " << problem;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + path + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(problem), std::string::npos) << "expected '" << problem << "' in: " << what;
  }
}

TEST(TokenFileErrors, EachProblemIsAClearErrorNamingTheFile) {
  TempDir dir;
  const BatchShape model{2, 16, 128};
  expect_bad_file(dir.file("missing.h5"), model, "no such file");

  std::ofstream(dir.file("text.h5")) << "not hdf5 at all\n";
  expect_bad_file(dir.file("text.h5"), model, "not an HDF5 file");

  Layout l;
  l.format = false;
  write_layout(dir.file("noformat.h5"), l);
  expect_bad_file(dir.file("noformat.h5"), model, "'format' is missing");

  l = Layout{};
  l.tokens = false;
  write_layout(dir.file("notokens.h5"), l);
  expect_bad_file(dir.file("notokens.h5"), model, "no dataset '/tokens'");

  l = Layout{};
  l.dims = {8 * 17};
  write_layout(dir.file("rank1.h5"), l);
  expect_bad_file(dir.file("rank1.h5"), model, "has rank 1, expected 2");

  l = Layout{};
  l.type = H5T_IEEE_F32LE;
  write_layout(dir.file("float.h5"), l);
  expect_bad_file(dir.file("float.h5"), model, "int32");

  l = Layout{};
  l.type = H5T_STD_I64LE;
  write_layout(dir.file("int64.h5"), l);
  expect_bad_file(dir.file("int64.h5"), model, "int32");

  l = Layout{};
  l.num_sequences = 9;
  write_layout(dir.file("disagree.h5"), l);
  expect_bad_file(dir.file("disagree.h5"), model, "has shape [8, 17] but the attributes say");

  l = Layout{};
  write_layout(dir.file("good.h5"), l);
  EXPECT_NO_THROW(TokenFile(dir.file("good.h5"), model));
  expect_bad_file(dir.file("good.h5"), {2, 32, 128},
                  "sequence length 16 does not match the model's 32");
  expect_bad_file(dir.file("good.h5"), {2, 16, 64}, "vocabulary of 100 tokens does not fit");
  expect_bad_file(dir.file("good.h5"), {9, 16, 128}, "fewer than one micro-batch of 9");
}

// A file whose vocab_size attribute understates its ids opens, but the rows that break the model's
// vocabulary fail when read, naming the row and the id.
TEST(TokenFileErrors, TokenIdsOutsideTheModelVocabularyFailOnRead) {
  TempDir dir;
  const std::string path = dir.file("lying.h5");
  std::vector<int32_t> tokens(4 * 9, 3);
  tokens[2 * 9 + 5] = 500;
  TokenFileWriter writer(path, 100, 8, 4);
  writer.write_rows(0, 4, tokens.data());
  writer.commit({});
  const TokenFile file(path, {1, 8, 128});
  std::vector<int32_t> row(9);
  EXPECT_NO_THROW(file.read_rows(1, 1, row.data()));
  try {
    file.read_rows(0, 4, tokens.data());
    ADD_FAILURE() << "expected an error for token id 500";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 2 holds token id 500, outside the model's vocabulary "
                                         "[0, 128)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace replay::data
