// --inject on the CPU: the shared flag accepts every fault the transformer hook plants, and
// `--inject help` or an unknown fault is a usage error (exit 2 from replay-gpt3) listing every
// fault, before any GPU work.
#include <gtest/gtest.h>

#include <string>

#include "common/bench/harness.h"
#include "tests/workloads/workload_test_util.h"
#include "workloads/transformer/faults.h"

namespace replay::gpt3 {
namespace {

using test::has;

TEST(InjectFlag, EveryListedFaultParsesAndHasAHook) {
  ASSERT_EQ(bench::injectable_faults().size(), 7u);
  for (const bench::FaultInfo& f : bench::injectable_faults()) {
    const auto flags = bench::parse_flags("t", {"--inject", f.name}, {"tiny"}, "tiny");
    ASSERT_TRUE(flags.has_value());
    EXPECT_EQ(flags->inject, f.name);
    EXPECT_NE(transformer::parse_fault(f.name), transformer::Fault::kNone) << f.name;
    EXPECT_TRUE(has(bench::describe(*flags), std::string("# inject: ") + f.name));
  }
  EXPECT_EQ(transformer::parse_fault(""), transformer::Fault::kNone);
  EXPECT_THROW(transformer::parse_fault("no-such-fault"), Error);
}

TEST(InjectFlag, UnknownFaultAndHelpAreUsageErrorsListingTheFaults) {
  for (const char* bad : {"no-such-fault", "help"}) {
    SCOPED_TRACE(bad);
    try {
      bench::parse_flags("t", {"--inject", bad}, {"tiny"}, "tiny");
      ADD_FAILURE() << "no UsageError";
    } catch (const bench::UsageError& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(has(msg, "--inject")) << msg;
      for (const bench::FaultInfo& f : bench::injectable_faults())
        EXPECT_TRUE(has(msg, f.name)) << msg;
    }
  }
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
