// replay-gpt3 --inject on the GPU: each planted fault (graphs/faults.h) in the
// tiny preset's first layer forward is detected by the graph layer's own diagnostics and named,
// and the run ends through replay::Error (exit 1, "replay-gpt3: ..."), never a crash or a hang:
// - capture refusals (host-sync-in-capture, malloc-in-capture, unjoined-stream): the fault class,
//   the CUDA error and the region (in the cause in full mode, as the graph's name in layer mode);
// - frozen values (scalar-by-value, rng-by-value, legacy-stream): --verify-graphs names the
//   differing output, "layer0.fwd:fault.probe";
// - stale-input: the argument check before the replay names the region and the argument.
// The same faults in eager mode (--graphs none) run to the end (exit 0): they are silent there.
#include <gtest/gtest.h>

#include <string>

#include "tests/workloads/workload_test_util.h"

namespace replay::gpt3 {
namespace {

using test::has;
using test::Outcome;

// The tiny preset, 2 steps, with `graphs` and the fault.
Outcome run_injected(const std::string& fault, const std::string& graphs) {
  return test::shell(std::string("timeout 300 '") + REPLAY_GPT3_BINARY +
                     "' --preset tiny --seed 4242 --steps 2 --graphs " + graphs +
                     " --verify-graphs --inject " + fault);
}

void expect_refused(const Outcome& o, const std::string& fault_class, const std::string& code) {
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_TRUE(has(o.output, "replay-gpt3: ")) << o.output;
  EXPECT_TRUE(has(o.output, "capture failed: " + fault_class)) << o.output;
  EXPECT_TRUE(has(o.output, code)) << o.output;
}

TEST(Inject, HostSyncInCaptureIsRefusedNamingClassAndRegion) {
  for (const char* mode : {"full", "layer"}) {
    SCOPED_TRACE(mode);
    const Outcome o = run_injected("host-sync-in-capture", mode);
    expect_refused(o, "host synchronization during capture", "cudaErrorStreamCaptureUnsupported");
    EXPECT_TRUE(has(o.output, "region 'layer0.fwd'")) << o.output;
    EXPECT_TRUE(has(o.output, "cudaStreamSynchronize")) << o.output;
  }
}

TEST(Inject, MallocInCaptureIsRefusedNamingClassAndRegion) {
  for (const char* mode : {"full", "layer"}) {
    SCOPED_TRACE(mode);
    const Outcome o = run_injected("malloc-in-capture", mode);
    expect_refused(o, "memory allocation or free during capture",
                   "cudaErrorStreamCaptureUnsupported");
    EXPECT_TRUE(has(o.output, "region 'layer0.fwd'")) << o.output;
    EXPECT_TRUE(has(o.output, "cudaMalloc")) << o.output;
  }
}

TEST(Inject, UnjoinedStreamIsRefusedNamingClassAndRegion) {
  // The error comes from cudaStreamEndCapture, after the region: layer mode names the region as the
  // graph.
  const Outcome o = run_injected("unjoined-stream", "layer");
  expect_refused(o, "a stream forked from the capture stream was not joined back",
                 "cudaErrorStreamCaptureUnjoined");
  EXPECT_TRUE(has(o.output, "graph 'layer0.fwd'")) << o.output;
}

void expect_probe_differs(const Outcome& o, const std::string& graph) {
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_TRUE(has(o.output, "replay-gpt3: verify-graphs: graph '" + graph +
                                "': output 'layer0.fwd:fault.probe' differs at element 0"))
      << o.output;
}

TEST(Inject, ScalarByValueIsCaughtByShadowVerification) {
  expect_probe_differs(run_injected("scalar-by-value", "full"), "step");
  expect_probe_differs(run_injected("scalar-by-value", "layer"), "layer0.fwd");
}

TEST(Inject, RngByValueIsCaughtByShadowVerification) {
  expect_probe_differs(run_injected("rng-by-value", "full"), "step");
  expect_probe_differs(run_injected("rng-by-value", "layer"), "layer0.fwd");
}

TEST(Inject, LegacyStreamIsCaughtByShadowVerification) {
  // The kernel on stream 0 runs once, at capture, and is missing from the graph.
  expect_probe_differs(run_injected("legacy-stream", "full"), "step");
  expect_probe_differs(run_injected("legacy-stream", "layer"), "layer0.fwd");
}

TEST(Inject, StaleInputIsCaughtByTheArgumentCheck) {
  for (const char* mode : {"full", "layer"}) {
    SCOPED_TRACE(mode);
    const Outcome o = run_injected("stale-input", mode);
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_TRUE(has(o.output, "replay-gpt3: ")) << o.output;
    EXPECT_TRUE(
        has(o.output, "region 'layer0.fwd': argument 'fault.input' was captured as fp32[4] at"))
        << o.output;
  }
}

TEST(Inject, EveryFaultRunsSilentlyEagerly) {
  // Eagerly none of them is an error (a stall, an allocation, a race on a probe nothing reads).
  for (const char* fault : {"host-sync-in-capture", "malloc-in-capture", "scalar-by-value",
                            "rng-by-value", "stale-input", "unjoined-stream", "legacy-stream"}) {
    SCOPED_TRACE(fault);
    const Outcome o = run_injected(fault, "none");
    EXPECT_EQ(o.status, 0) << o.output;
    EXPECT_TRUE(has(o.output, std::string("# inject: ") + fault)) << o.output;
  }
}

}  // namespace
}  // namespace replay::gpt3
