// MlLogger: the ":::MLLOG" line format read back field by field, and (MlLogChecker.*) the MLPerf
// compliance checker run with replay's shard rules on complete and broken synthetic run logs.
#include "common/bench/mllog.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace replay::bench {
namespace {

constexpr char kPrefix[] = ":::MLLOG ";
constexpr char kThisFile[] = "tests/common/test_mllog.cpp";

// A log file in the test folder, removed when the test ends however it ends.
struct TempLog {
  explicit TempLog(const std::string& tag)
      : path(::testing::TempDir() + "replay_mllog_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + tag + "_" +
             std::to_string(::getpid()) + ".log") {}
  ~TempLog() { std::remove(path.c_str()); }
  const std::string path;
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Parses one line, keeping the key order; fails the test on a missing prefix.
nlohmann::ordered_json parse(const std::string& line) {
  EXPECT_EQ(line.rfind(kPrefix, 0), 0u) << line;
  return nlohmann::ordered_json::parse(line.substr(sizeof(kPrefix) - 1));
}

std::vector<std::string> keys_of(const nlohmann::ordered_json& object) {
  std::vector<std::string> keys;
  for (const auto& item : object.items()) keys.push_back(item.key());
  return keys;
}

// A clock that starts at a fixed time and moves 1 s per line, so time_ms is known exactly.
std::function<int64_t()> stepping_clock(std::shared_ptr<int64_t> now) {
  return [now] { return *now += 1000; };
}

MlLogOptions options_for(const std::string& path, int64_t start_ms = 1700000000000) {
  MlLogOptions options;
  options.path = path;
  options.clock = stepping_clock(std::make_shared<int64_t>(start_ms));
  return options;
}

TEST(MlLog, LineMatchesThePythonLoggerByteForByte) {
  const TempLog tmp("golden");
  const std::string& path = tmp.path;
  {
    MlLogOptions options;
    options.path = path;
    options.clock = [] { return int64_t{1700000000123}; };
    MlLogger log(std::move(options));
    const int line = __LINE__ + 1;  // the next line's
    log.event(mlkey::kSeed, 42);
    const int line2 = __LINE__ + 1;
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
    const auto lines = read_lines(path);
    ASSERT_EQ(lines.size(), 2u);
    // What mlperf_logging.mllog writes (json.dumps: ", " and ": " separators, this key order).
    EXPECT_EQ(lines[0],
              std::string(":::MLLOG {\"namespace\": \"\", \"time_ms\": 1700000000123, ") +
                  "\"event_type\": \"POINT_IN_TIME\", \"key\": \"seed\", \"value\": 42, " +
                  "\"metadata\": {\"file\": \"" + kThisFile +
                  "\", \"lineno\": " + std::to_string(line) + "}}");
    EXPECT_EQ(lines[1], std::string(":::MLLOG {\"namespace\": \"\", \"time_ms\": 1700000000123, ") +
                            "\"event_type\": \"INTERVAL_END\", \"key\": \"run_stop\", " +
                            "\"value\": null, \"metadata\": {\"file\": \"" + kThisFile +
                            "\", \"lineno\": " + std::to_string(line2) +
                            ", \"status\": \"success\"}}");
  }
}

TEST(MlLog, KeyOrderValueTypesAndMetadata) {
  const TempLog tmp("types");
  const std::string& path = tmp.path;
  const uint64_t big_seed = (uint64_t{1} << 63) + 5;  // beyond int64: seeds from the OS
  {
    MlLogger log(options_for(path));
    log.event("v_string", "adam");
    log.event("v_int", -7);
    log.event("v_uint", big_seed);
    log.event("v_double", 2e-5);
    log.event("v_bool", true);
    log.event("v_null");
    log.start(mlkey::kBlockStart, {{mlkey::kSamplesCount, 0}, {mlkey::kEpochNum, 3}});
    log.end(mlkey::kBlockStop, {{mlkey::kSamplesCount, 64}});
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 9u);
  const std::vector<std::string> order = {"namespace", "time_ms", "event_type",
                                          "key",       "value",   "metadata"};
  const char* types[] = {"POINT_IN_TIME",  "POINT_IN_TIME", "POINT_IN_TIME",
                         "POINT_IN_TIME",  "POINT_IN_TIME", "POINT_IN_TIME",
                         "INTERVAL_START", "INTERVAL_END",  "INTERVAL_END"};
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto j = parse(lines[i]);
    EXPECT_EQ(keys_of(j), order) << lines[i];
    EXPECT_EQ(j["namespace"], "");
    ASSERT_TRUE(j["time_ms"].is_number_integer()) << lines[i];
    EXPECT_EQ(j["time_ms"].get<int64_t>(), 1700000000000 + 1000 * static_cast<int64_t>(i + 1));
    EXPECT_EQ(j["event_type"], types[i]);
    const auto& meta = j["metadata"];
    ASSERT_GE(meta.size(), 2u) << lines[i];
    EXPECT_EQ(keys_of(meta)[0], "file");
    EXPECT_EQ(keys_of(meta)[1], "lineno");
    EXPECT_EQ(meta["file"], kThisFile);
    EXPECT_TRUE(meta["lineno"].is_number_integer());
  }
  EXPECT_EQ(parse(lines[0])["value"], "adam");
  EXPECT_EQ(parse(lines[1])["value"].get<int64_t>(), -7);
  EXPECT_TRUE(parse(lines[2])["value"].is_number_unsigned());
  EXPECT_EQ(parse(lines[2])["value"].get<uint64_t>(), big_seed);
  EXPECT_TRUE(parse(lines[3])["value"].is_number_float());
  EXPECT_EQ(parse(lines[3])["value"].get<double>(), 2e-5);
  EXPECT_EQ(parse(lines[4])["value"], true);
  EXPECT_TRUE(parse(lines[5])["value"].is_null());
  EXPECT_TRUE(parse(lines[6])["value"].is_null());
  // Line numbers are the call sites': consecutive calls above, one line apart.
  EXPECT_EQ(parse(lines[1])["metadata"]["lineno"].get<int>(),
            parse(lines[0])["metadata"]["lineno"].get<int>() + 1);
  const auto block = parse(lines[6])["metadata"];
  EXPECT_EQ(keys_of(block),
            (std::vector<std::string>{"file", "lineno", "samples_count", "epoch_num"}));
  EXPECT_EQ(block["epoch_num"], 3);
}

TEST(MlLog, DoublesReadBackExactlyAndNonFiniteIsNull) {
  const TempLog tmp("doubles");
  const std::string& path = tmp.path;
  const double values[] = {2e-5, 1e-8, 0.95, 8e-5 * 8 / 1152, 1.0, 0.1, 1e300, -3.25};
  {
    MlLogger log(options_for(path));
    for (double v : values) log.event(mlkey::kOptBaseLearningRate, v);
    log.event(mlkey::kEvalAccuracy, std::numeric_limits<double>::quiet_NaN());
    log.event(mlkey::kEvalAccuracy, std::numeric_limits<double>::infinity());
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), std::size(values) + 3);
  for (size_t i = 0; i < std::size(values); ++i) {
    const auto v = parse(lines[i])["value"];
    ASSERT_TRUE(v.is_number_float()) << lines[i];  // 1.0 stays a float ("1.0"), as in Python
    EXPECT_EQ(v.get<double>(), values[i]) << lines[i];
  }
  EXPECT_NE(lines[4].find("\"value\": 1.0,"), std::string::npos) << lines[4];
  EXPECT_TRUE(parse(lines[std::size(values)])["value"].is_null());
  EXPECT_TRUE(parse(lines[std::size(values) + 1])["value"].is_null());
}

TEST(MlLog, TrackedStatsValueIsAnObjectAndStepIsMetadata) {
  const TempLog tmp("stats");
  const std::string& path = tmp.path;
  {
    MlLogger log(options_for(path));
    log.tracked_stats(96, {{"throughput", 12.5}, {"train_step_time", 0.25}});
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  const auto j = parse(lines[0]);
  EXPECT_EQ(j["key"], "tracked_stats");
  EXPECT_EQ(j["event_type"], "POINT_IN_TIME");
  EXPECT_EQ(keys_of(j["value"]), (std::vector<std::string>{"throughput", "train_step_time"}));
  EXPECT_EQ(j["value"]["throughput"].get<double>(), 12.5);
  EXPECT_EQ(j["metadata"]["step"], 96);
}

TEST(MlLog, EachLineIsOnDiskBeforeTheNextCall) {
  const TempLog tmp("flush");
  const std::string& path = tmp.path;
  MlLogger log(options_for(path));
  log.start(mlkey::kInitStart);
  const auto lines = read_lines(path);  // the logger is still open
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(parse(lines[0])["key"], "init_start");
  log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
}

TEST(MlLog, OnlyRankZeroWrites) {
  const TempLog tmp("rank1");
  const std::string& path = tmp.path;
  {
    MlLogOptions options = options_for(path);
    options.rank = 1;
    MlLogger log(std::move(options));
    EXPECT_FALSE(log.enabled());
    log.start(mlkey::kInitStart);
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
  }
  std::FILE* f = std::fopen(path.c_str(), "r");
  EXPECT_EQ(f, nullptr) << "rank 1 created " << path;
  if (f) std::fclose(f);
}

TEST(MlLog, EchoesToStdout) {
  MlLogOptions options;
  options.echo = true;
  options.clock = [] { return int64_t{1}; };
  MlLogger log(std::move(options));
  ::testing::internal::CaptureStdout();
  log.event(mlkey::kCacheClear, false);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(out.rfind(kPrefix, 0), 0u) << out;
  EXPECT_EQ(parse(out.substr(0, out.size() - 1))["key"], "cache_clear");
  log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
}

TEST(MlLog, RunStopNeedsAStatusAndHappensOnce) {
  const TempLog tmp("status");
  const std::string& path = tmp.path;
  {
    MlLogger log(options_for(path));
    EXPECT_THROW(log.end(mlkey::kRunStop), replay::Error);
    EXPECT_THROW(log.end(mlkey::kRunStop, {{mlkey::kStatus, "done"}}), replay::Error);
    EXPECT_THROW(log.event(mlkey::kSeed, 1, {{"file", "x.cpp"}}), replay::Error);
    log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
    EXPECT_THROW(log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}}), replay::Error);
    log.abort("after run_stop: nothing is written");
  }
  EXPECT_EQ(read_lines(path).size(), 1u);
}

// The structure of a run up to its first block; settings are left out.
void log_until_block(MlLogger& log) {
  log.event(mlkey::kCacheClear, false);
  log.start(mlkey::kInitStart);
  log.end(mlkey::kInitStop);
  log.start(mlkey::kRunStart);
  log.start(mlkey::kBlockStart, {{mlkey::kSamplesCount, 0}});
}

TEST(MlLog, AbortedRunLeavesAWellFormedFile) {
  const TempLog tmp("aborted");
  const std::string& path = tmp.path;
  {
    MlLogger log(options_for(path));
    try {
      log_until_block(log);
      throw replay::Error("replay", "test", "CUDA error in step 3");
    } catch (const replay::Error& e) {
      log.abort(e.what());
    }
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 6u);  // nothing more from the destructor
  for (const auto& line : lines) EXPECT_NO_THROW(parse(line)) << line;
  const auto last = parse(lines.back());
  EXPECT_EQ(last["key"], "run_stop");
  EXPECT_EQ(last["event_type"], "INTERVAL_END");
  EXPECT_EQ(last["metadata"]["status"], "aborted");
  EXPECT_EQ(last["metadata"]["error"], "CUDA error in step 3");
  EXPECT_EQ(last["metadata"]["file"], kThisFile);
}

TEST(MlLog, DestructorClosesARunLeftOpen) {
  const TempLog tmp("open");
  const std::string& path = tmp.path;
  {
    MlLogger log(options_for(path));
    log_until_block(log);
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 6u);
  const auto last = parse(lines.back());
  EXPECT_EQ(last["key"], "run_stop");
  EXPECT_EQ(last["metadata"]["status"], "aborted");

  const TempLog tmp_empty("empty");
  const std::string& empty = tmp_empty.path;
  { MlLogger log(options_for(empty)); }
  EXPECT_TRUE(read_lines(empty).empty()) << "a logger that wrote nothing adds nothing";
}

TEST(MlLog, UnwritableFileIsAClearError) {
  try {
    MlLogger log(options_for("/nonexistent-dir/run.mllog"));
    FAIL() << "opened a file in a missing folder";
  } catch (const replay::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/run.mllog"), std::string::npos)
        << e.what();
  }
}

// ---- The compliance checker, with replay's shard rules (scripts/mlperf/) ----

struct CheckResult {
  int status;
  std::string output;
};

CheckResult run_checker(const std::string& path) {
  const std::string cmd = std::string("bash '") + REPLAY_SOURCE_DIR +
                          "/scripts/mlperf/check_mllog.sh' '" + path + "' 2>&1";
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return {-1, "popen failed: " + cmd};
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int raw = ::pclose(pipe);
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, out};
}

// Exits 77 (CTest's skip) where python3 with mlperf_logging is not importable.
void skip_without_checker() {
  static const bool available = [] {
    const TempLog probe("probe");
    std::ofstream(probe.path) << "\n";
    return run_checker(probe.path).status != 77;
  }();
  if (!available) {
    std::printf("SKIP: python3 with mlperf_logging is not importable (scripts/setup.sh)\n");
    std::exit(77);
  }
}

// The settings a shard run logs between init_start and init_stop, with MLPerf's hyperparameters.
MlFields shard_settings(const std::string& benchmark) {
  namespace k = mlkey;
  const bool gpt3 = benchmark == k::kGpt3;
  const int64_t gbs = 8;
  MlFields s = {
      {k::kSubmissionOrg, "replay"},
      {k::kSubmissionPlatform, "1xH100-SXM5-80GB"},
      {k::kSubmissionStatus, "research"},
      {k::kConfigFilename, gpt3 ? "175b-tp4" : "405b-tp8"},
      {k::kSeed, uint64_t{0x9E3779B97F4A7C15}},
      {k::kGlobalBatchSize, gbs},
      {k::kMicroBatchSize, 1},
      {k::kGradientAccumulationSteps, 8},
      {k::kMaxSequenceLength, gpt3 ? 2048 : 8192},
      {k::kTensorParallelism, gpt3 ? 4 : 8},
      {k::kPipelineParallelism, 1},
      {k::kContextParallelism, 1},
      {k::kExpertParallelism, 1},
      {k::kPrecisionLinear, "bfloat16"},
      {k::kPrecisionAttn, "bfloat16"},
      {k::kPrecisionComm, "bfloat16"},
      {k::kReplayGraphMode, "full"},
      {k::kReplayWorldSize, 1},
      {k::kReplayNumLayers, gpt3 ? 12 : 8},
      {k::kOptName, gpt3 ? "adam" : "adamw"},
      {k::kOptBaseLearningRate, gpt3 ? 2e-5 : 8e-5 * static_cast<double>(gbs) / 1152},
      {k::kOptEndLearningRate, gpt3 ? 2e-6 : 8e-7},
      {k::kOptLearningRateWarmupSteps, 100},
      {k::kOptLearningRateDecaySteps, 1000},
      {k::kOptLearningRateDecaySchedule, "cosine with linear warmup"},
      {k::kOptGradientClipNorm, 1.0},
      {k::kTrainSamples, 4096},
      {k::kEvalSamples, 64},
  };
  const MlFields adam = {{k::kOptAdamBeta1, 0.9},
                         {k::kOptAdamBeta2, static_cast<double>(0.95f)},  // kept in fp32
                         {k::kOptAdamEpsilon, 1e-8},
                         {k::kOptWeightDecay, 0.1}};
  const MlFields adamw = {{k::kOptAdamwBeta1, 0.9},
                          {k::kOptAdamwBeta2, 0.95},
                          {k::kOptAdamwEpsilon, 1e-5},
                          {k::kOptAdamwWeightDecay, 0.1}};
  s.insert(s.end(), (gpt3 ? adam : adamw).begin(), (gpt3 ? adam : adamw).end());
  return s;
}

void set(MlFields& fields, const std::string& name, MlValue value) {
  for (auto& [n, v] : fields)
    if (n == name) v = std::move(value);
}

// A complete shard run: init, settings, one block with an evaluation, run_stop success.
void write_shard_run(const std::string& path, const std::string& benchmark,
                     const MlFields& settings, int64_t init_ms = 5000) {
  auto now = std::make_shared<int64_t>(1700000000000);
  MlLogOptions options;
  options.path = path;
  options.clock = stepping_clock(now);
  MlLogger log(std::move(options));
  log.event(mlkey::kCacheClear, false);
  log.start(mlkey::kInitStart);
  log.event(mlkey::kSubmissionBenchmark, benchmark);
  for (const auto& [key, value] : settings) log.event(key, value);
  *now += init_ms;
  log.end(mlkey::kInitStop);
  log.start(mlkey::kRunStart);
  log.start(mlkey::kBlockStart, {{mlkey::kSamplesCount, 0}});
  log.tracked_stats(8, {{"throughput", 3.5}});
  log.start(mlkey::kEvalStart, {{mlkey::kSamplesCount, 64}});
  log.event(mlkey::kEvalAccuracy, 7.25, {{mlkey::kSamplesCount, 64}});
  log.end(mlkey::kEvalStop, {{mlkey::kSamplesCount, 64}});
  log.end(mlkey::kBlockStop, {{mlkey::kSamplesCount, 64}});
  log.end(mlkey::kRunStop, {{mlkey::kStatus, mlkey::kSuccess}});
}

TEST(MlLogChecker, Gpt3ShardRunPasses) {
  skip_without_checker();
  const TempLog tmp("gpt3");
  const std::string& path = tmp.path;
  write_shard_run(path, mlkey::kGpt3, shard_settings(mlkey::kGpt3));
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("shard_gpt3.yaml"), std::string::npos) << r.output;
}

TEST(MlLogChecker, Llama31ShardRunPasses) {
  skip_without_checker();
  const TempLog tmp("llama31");
  const std::string& path = tmp.path;
  write_shard_run(path, mlkey::kLlama31_405b, shard_settings(mlkey::kLlama31_405b));
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("shard_llama31_405b.yaml"), std::string::npos) << r.output;
}

// A process killed mid-run (no destructor, so no run_stop) leaves a log the checker rejects.
TEST(MlLogChecker, KilledRunWithoutRunStopFails) {
  skip_without_checker();
  const TempLog tmp("killed");
  const std::string& path = tmp.path;
  write_shard_run(path, mlkey::kGpt3, shard_settings(mlkey::kGpt3));
  auto lines = read_lines(path);
  ASSERT_EQ(parse(lines.back())["key"], "run_stop");
  lines.pop_back();
  std::ofstream out(path);
  for (const auto& line : lines) out << line << "\n";
  out.close();
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("'run_stop'"), std::string::npos) << r.output;
}

TEST(MlLogChecker, WrongHyperparameterFails) {
  skip_without_checker();
  const TempLog tmp("beta2");
  const std::string& path = tmp.path;
  MlFields settings = shard_settings(mlkey::kGpt3);
  set(settings, mlkey::kOptAdamBeta2, 0.999);
  write_shard_run(path, mlkey::kGpt3, settings);
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("CHECK for 'opt_adam_beta_2' failed"), std::string::npos) << r.output;
}

TEST(MlLogChecker, MisspeltRequiredKeyFails) {
  skip_without_checker();
  const TempLog tmp("misspelt");
  const std::string& path = tmp.path;
  MlFields settings = shard_settings(mlkey::kLlama31_405b);
  for (auto& [name, value] : settings)
    if (name == mlkey::kGlobalBatchSize) name = "global_batchsize";
  write_shard_run(path, mlkey::kLlama31_405b, settings);
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("'global_batch_size' but found 0"), std::string::npos) << r.output;
}

TEST(MlLogChecker, ClaimingASubmissionDivisionFails) {
  skip_without_checker();
  const TempLog tmp("division");
  const std::string& path = tmp.path;
  MlFields settings = shard_settings(mlkey::kGpt3);
  settings.push_back({mlkey::kSubmissionDivision, "closed"});
  write_shard_run(path, mlkey::kGpt3, settings);
  EXPECT_EQ(run_checker(path).status, 1);
}

TEST(MlLogChecker, InitLongerThan30MinutesFails) {
  skip_without_checker();
  const TempLog tmp("init");
  const std::string& path = tmp.path;
  write_shard_run(path, mlkey::kGpt3, shard_settings(mlkey::kGpt3), 31 * 60 * 1000);
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("CHECK for 'init_stop' failed"), std::string::npos) << r.output;
}

TEST(MlLogChecker, AbortedRunParsesCleanly) {
  skip_without_checker();
  const TempLog tmp("aborted");
  const std::string& path = tmp.path;
  {
    MlLogger log(options_for(path));
    log_until_block(log);
    log.abort("injected failure");
  }
  const CheckResult r = run_checker(path);
  EXPECT_EQ(r.output.find("parsing errors"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("CHECK for 'run_stop' failed"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace replay::bench
