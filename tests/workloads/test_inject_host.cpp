// --inject on the CPU: the protocol flag accepts every fault of the graph layer's catalogue, and
// `--inject help` or an unknown fault is a usage error (exit 2 from replay-gpt3) listing every
// fault, before any GPU work.
#include <gtest/gtest.h>

#include <string>

#include "common/bench/harness.h"
#include "graphs/faults.h"
#include "tests/workloads/workload_test_util.h"
#include "train/flags.h"

namespace replay::gpt3 {
namespace {

using test::has;

std::optional<train::RunFlags> parse(const std::vector<std::string>& args) {
  return train::parse_flags("t", {"tiny"}, "tiny", nullptr, args);
}

TEST(InjectFlag, EveryListedFaultParsesAndHasAHook) {
  ASSERT_EQ(graphs::fault_catalogue().size(), 13u);
  for (const graphs::FaultInfo& f : graphs::fault_catalogue()) {
    const auto flags = parse({"--inject", f.name});
    ASSERT_TRUE(flags.has_value());
    EXPECT_EQ(flags->inject, f.name);
    EXPECT_EQ(graphs::parse_fault(f.name), f.fault) << f.name;
    EXPECT_NE(f.fault, graphs::Fault::kNone) << f.name;
    EXPECT_STREQ(graphs::fault_name(f.fault), f.name);
    EXPECT_TRUE(has(train::describe(*flags), std::string("# inject: ") + f.name));
  }
  EXPECT_EQ(graphs::parse_fault(""), graphs::Fault::kNone);
  EXPECT_THROW(graphs::parse_fault("no-such-fault"), Error);
}

TEST(InjectFlag, TheGuidesFrozenBranchShapeAndOrderFaultsSayWhoDetectsThem) {
  // N1, N5, N14: each parses to its own Fault, and its line names the diagnostic that catches it.
  const struct {
    const char* name;
    graphs::Fault fault;
    const char* detector;
  } expected[] = {{"host-branch", graphs::Fault::kHostBranch, "--verify-graphs"},
                  {"shape-change", graphs::Fault::kShapeChange, "argument check"},
                  {"replay-order", graphs::Fault::kReplayOrder, "--verify-graphs"}};
  const std::string listing = graphs::describe_faults();
  for (const auto& e : expected) {
    SCOPED_TRACE(e.name);
    EXPECT_EQ(graphs::parse_fault(e.name), e.fault);
    const auto flags = parse({"--inject", e.name, "--graphs", "layer"});
    ASSERT_TRUE(flags.has_value());
    EXPECT_EQ(flags->inject, e.name);
    bool found = false;
    for (const graphs::FaultInfo& f : graphs::fault_catalogue())
      if (f.fault == e.fault) {
        found = true;
        EXPECT_TRUE(has(f.what, e.detector)) << f.what;
      }
    EXPECT_TRUE(found);
    EXPECT_TRUE(has(listing, std::string("  ") + e.name + " ")) << listing;
  }
}

TEST(InjectFlag, UnknownFaultAndHelpAreUsageErrorsListingTheFaults) {
  for (const char* bad : {"no-such-fault", "help"}) {
    SCOPED_TRACE(bad);
    try {
      parse({"--inject", bad});
      ADD_FAILURE() << "no UsageError";
    } catch (const bench::UsageError& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(has(msg, "--inject")) << msg;
      for (const graphs::FaultInfo& f : graphs::fault_catalogue())
        EXPECT_TRUE(has(msg, f.name)) << msg;
    }
  }
}

TEST(InjectFlag, RankStallNeedsTwoProcesses) {
  const test::Outcome o =
      test::shell(std::string("'") + REPLAY_GPT3_BINARY + "' --preset tiny --inject rank-stall");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--inject rank-stall: needs 2 or more processes")) << o.output;
}

TEST(InjectFlag, OverflowNeedsThreeSteps) {
  const test::Outcome o = test::shell(std::string("'") + REPLAY_GPT3_BINARY +
                                      "' --preset tiny --steps 2 --inject overflow");
  EXPECT_EQ(o.status, 2) << o.output;
  EXPECT_TRUE(has(o.output, "--inject overflow: plants its Inf in step 2")) << o.output;
}

TEST(InjectFlag, TheBinaryExitsTwoBeforeAnyGpuWork) {
  for (const char* bad : {"no-such-fault", "help"}) {
    const test::Outcome o =
        test::shell(std::string("'") + REPLAY_GPT3_BINARY + "' --preset tiny --inject " + bad);
    EXPECT_EQ(o.status, 2) << o.output;
    EXPECT_TRUE(has(o.output, "replay-gpt3: --inject") && has(o.output, "unjoined-stream") &&
                has(o.output, "scalar-by-value"))
        << o.output;
  }
}

}  // namespace
}  // namespace replay::gpt3
