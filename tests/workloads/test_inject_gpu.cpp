// replay-gpt3 --inject on the GPU: each planted fault (graphs/faults.h) in the
// tiny preset's first layer forward is detected by the graph layer's own diagnostics and named,
// and the run ends through replay::Error (exit 1, "replay-gpt3: ..."), never a crash or a hang:
// - capture refusals (host-sync-in-capture, malloc-in-capture, unjoined-stream): the fault class,
//   the CUDA error and the region (in the cause in full mode, as the graph's name in layer mode);
// - frozen values (scalar-by-value, rng-by-value, legacy-stream): --verify-graphs names the
//   differing output, "layer0.fwd:fault.probe";
// - stale-input, shape-change: the argument check before the replay names the region, the argument
//   and what changed (the address, the shape);
// - host-branch: --verify-graphs names "layer0.fwd:fault.probe" (the branch frozen at capture);
// - replay-order: --verify-graphs names the output the swapped read and write change: the probe in
//   full mode (the read of layer1.fwd came before the write of layer0.fwd), the scratch in layer
//   mode (graph layer0.fwd holds the read where its eager run writes).
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

TEST(Inject, HostBranchIsCaughtByShadowVerification) {
  // Captured on one branch (accumulate), verified on the next step's (reset): 0 against 1 or more.
  for (const char* mode : {"full", "layer"}) {
    SCOPED_TRACE(mode);
    const Outcome o = run_injected("host-branch", mode);
    expect_probe_differs(o, std::string(mode) == "full" ? "step" : "layer0.fwd");
    EXPECT_TRUE(has(o.output, "element 0: eager 0 (0x00000000), graphed")) << o.output;
  }
}

TEST(Inject, ShapeChangeIsCaughtByTheArgumentCheck) {
  // With the default 3 warm-up steps the capture sees 4 elements and the next step 8.
  for (const char* mode : {"full", "layer"}) {
    SCOPED_TRACE(mode);
    const Outcome o = run_injected("shape-change", mode);
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_TRUE(has(o.output, "replay-gpt3: ")) << o.output;
    EXPECT_TRUE(
        has(o.output, "region 'layer0.fwd': argument 'fault.input' was captured as fp32[4] at"))
        << o.output;
    EXPECT_TRUE(has(o.output, "and is now fp32[8] at")) << o.output;
  }
}

TEST(Inject, ReplayOrderIsCaughtByShadowVerification) {
  // Both regions are named where the fault is planted.
  const Outcome full = run_injected("replay-order", "full");
  EXPECT_EQ(full.status, 1) << full.output;
  EXPECT_TRUE(
      has(full.output, "# inject: replay-order, planted in region 'layer0.fwd, layer1.fwd'"))
      << full.output;
  // The step's read of the scratch came before its write: eager 2 x (s + 1), graphed 2 x s.
  EXPECT_TRUE(has(full.output,
                  "replay-gpt3: verify-graphs: graph 'step': output 'layer0.fwd:fault.probe' "
                  "differs at element 0: eager 8 (0x41000000), graphed 6 (0x40c00000)"))
      << full.output;
  // Graph layer0.fwd holds the read; its eager run advances the scratch from 3 to 4.
  const Outcome layer = run_injected("replay-order", "layer");
  EXPECT_EQ(layer.status, 1) << layer.output;
  EXPECT_TRUE(has(layer.output,
                  "replay-gpt3: verify-graphs: graph 'layer0.fwd': output "
                  "'layer0.fwd:fault.scratch' differs at element 0: eager 4 (0x40800000), graphed "
                  "3 (0x40400000)"))
      << layer.output;
}

TEST(Inject, EveryFaultRunsSilentlyEagerly) {
  // Eagerly none of them is an error (a stall, an allocation, a race on a probe nothing reads).
  for (const char* fault : {"host-sync-in-capture", "malloc-in-capture", "scalar-by-value",
                            "rng-by-value", "stale-input", "unjoined-stream", "legacy-stream",
                            "host-branch", "shape-change", "replay-order"}) {
    SCOPED_TRACE(fault);
    const Outcome o = run_injected(fault, "none");
    EXPECT_EQ(o.status, 0) << o.output;
    EXPECT_TRUE(has(o.output, std::string("# inject: ") + fault)) << o.output;
  }
}

}  // namespace
}  // namespace replay::gpt3
