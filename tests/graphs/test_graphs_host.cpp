// The graph layer's host logic, without a GPU: plan partition and ordering, argument fingerprints,
// capture fault classes, RNG registration, learning-rate schedules, the loss-scaler state machine,
// and the helpers shadow verification prints with.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "graphs/graph.h"
#include "graphs/rng.h"
#include "graphs/faults.h"
#include "graphs/step_plan.h"

namespace replay::graphs {
namespace {

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

Region region(const std::string& name, RegionKind kind, const std::string& scope = {}) {
  Region r;
  r.name = name;
  r.kind = kind;
  r.scope = scope;
  r.enqueue = [](cudaStream_t, const RegionArgs&) {};
  return r;
}

// embedding, 2 layers forward (attn + mlp scopes), loss, 2 layers backward, optimizer.
std::vector<Region> transformer_step() {
  return {region("embedding", RegionKind::kOther),
          region("layer0.fwd.attn", RegionKind::kForwardLayer, "attn"),
          region("layer0.fwd.mlp", RegionKind::kForwardLayer, "mlp"),
          region("layer1.fwd.attn", RegionKind::kForwardLayer, "attn"),
          region("layer1.fwd.mlp", RegionKind::kForwardLayer, "mlp"),
          region("loss", RegionKind::kOther),
          region("layer1.bwd", RegionKind::kBackwardLayer),
          region("layer0.bwd", RegionKind::kBackwardLayer),
          region("optimizer", RegionKind::kOther)};
}

TEST(GraphMode, ParsesTheThreeModesAndRejectsOthers) {
  EXPECT_EQ(parse_graph_mode("none"), GraphMode::kNone);
  EXPECT_EQ(parse_graph_mode("layer"), GraphMode::kLayer);
  EXPECT_EQ(parse_graph_mode("full"), GraphMode::kFull);
  EXPECT_STREQ(graph_mode_name(GraphMode::kLayer), "layer");
  try {
    parse_graph_mode("Full");
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "none, layer, full")) << e.what();
  }
}

TEST(StepPartition, NoneRunsEveryRegionEagerlyInOrder) {
  const auto regions = transformer_step();
  const auto units = partition_step("step", regions, {GraphMode::kNone});
  ASSERT_EQ(units.size(), regions.size());
  for (size_t i = 0; i < units.size(); ++i) {
    EXPECT_EQ(units[i].name, regions[i].name);
    EXPECT_EQ(units[i].first, static_cast<int>(i));
    EXPECT_EQ(units[i].last, static_cast<int>(i));
    EXPECT_FALSE(units[i].graphed);
  }
}

TEST(StepPartition, FullIsOneGraphOverTheWholeStep) {
  const auto regions = transformer_step();
  const auto units = partition_step("gpt3", regions, {GraphMode::kFull});
  ASSERT_EQ(units.size(), 1u);
  EXPECT_EQ(units[0].name, "gpt3");
  EXPECT_EQ(units[0].first, 0);
  EXPECT_EQ(units[0].last, static_cast<int>(regions.size()) - 1);
  EXPECT_TRUE(units[0].graphed);
}

TEST(StepPartition, LayerGraphsForwardAndBackwardLayersInExecutionOrder) {
  auto regions = transformer_step();
  regions[5].graphable = true;   // the loss opts in
  regions[6].graphable = false;  // layer1.bwd opts out
  const auto units = partition_step("step", regions, {GraphMode::kLayer});
  ASSERT_EQ(units.size(), regions.size());
  const bool expected[] = {false, true, true, true, true, true, false, true, false};
  for (size_t i = 0; i < units.size(); ++i) {
    EXPECT_EQ(units[i].graphed, expected[i]) << units[i].name;
    EXPECT_EQ(units[i].first, static_cast<int>(i)) << "units keep the declared order";
  }
}

TEST(StepPartition, LayerScopesSelectModuleRegions) {
  StepPlanOptions opt{GraphMode::kLayer};
  opt.scopes = {"attn"};
  const auto units = partition_step("step", transformer_step(), opt);
  std::vector<std::string> graphed;
  for (const StepUnit& u : units)
    if (u.graphed) graphed.push_back(u.name);
  EXPECT_EQ(graphed, (std::vector<std::string>{"layer0.fwd.attn", "layer1.fwd.attn"}));
}

TEST(StepPartition, RejectsBadPlans) {
  auto expect_error = [](const std::vector<Region>& regions, const StepPlanOptions& opt,
                         const std::string& text) {
    try {
      partition_step("step", regions, opt);
      ADD_FAILURE() << "no exception, expected: " << text;
    } catch (const Error& e) {
      EXPECT_TRUE(has(e.what(), text)) << e.what();
    }
  };
  expect_error({}, {GraphMode::kFull}, "has no regions");
  auto twice = transformer_step();
  twice.push_back(region("loss", RegionKind::kOther));
  expect_error(twice, {GraphMode::kNone}, "region 'loss' added twice");
  auto no_enqueue = transformer_step();
  no_enqueue[2].enqueue = nullptr;
  expect_error(no_enqueue, {GraphMode::kNone}, "'layer0.fwd.mlp' has no enqueue function");
  StepPlanOptions unknown{GraphMode::kLayer};
  unknown.scopes = {"moe_router"};
  expect_error(transformer_step(), unknown,
               "scope 'moe_router' matches no region (declared scopes: attn, mlp)");
  StepPlanOptions scopes_in_full{GraphMode::kFull};
  scopes_in_full.scopes = {"attn"};
  expect_error(transformer_step(), scopes_in_full, "layer mode only");
}

TEST(RegionArgs, LookupAndDuplicates) {
  float a = 0, b = 0;
  RegionArgs args;
  args.read("x", TensorView(&a, DType::kFP32, {1})).write("y", TensorView(&b, DType::kFP32, {1}));
  EXPECT_EQ(args["y"].data, &b);
  try {
    (void)args["z"];
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "'z' was not declared (declared: x, y)")) << e.what();
  }
  EXPECT_THROW(args.read("x", TensorView(&a, DType::kFP32, {1})), Error);
}

TEST(Fingerprint, EqualArgumentsMatch) {
  alignas(16) static char buf[4096];
  auto make = [&] {
    return RegionArgs()
        .read("x", TensorView(buf, DType::kBF16, {4, 8}))
        .write("y", TensorView(buf + 1024, DType::kFP32, {16}));
  };
  EXPECT_EQ(fingerprint_mismatch(fingerprint(make()), fingerprint(make())), "");
}

TEST(Fingerprint, NamesTheArgumentThatMovedOrChangedShape) {
  alignas(16) static char buf[4096];
  const auto captured = fingerprint(RegionArgs()
                                        .read("x", TensorView(buf, DType::kBF16, {4, 8}))
                                        .write("y", TensorView(buf + 1024, DType::kFP32, {16})));

  const auto moved = fingerprint(RegionArgs()
                                     .read("x", TensorView(buf, DType::kBF16, {4, 8}))
                                     .write("y", TensorView(buf + 2048, DType::kFP32, {16})));
  std::string m = fingerprint_mismatch(captured, moved);
  EXPECT_TRUE(has(m, "argument 'y' was captured as fp32[16] at ")) << m;

  const auto reshaped = fingerprint(RegionArgs()
                                        .read("x", TensorView(buf, DType::kBF16, {8, 4}))
                                        .write("y", TensorView(buf + 1024, DType::kFP32, {16})));
  m = fingerprint_mismatch(captured, reshaped);
  EXPECT_TRUE(has(m, "argument 'x' was captured as bf16[4x8]") && has(m, "is now bf16[8x4]")) << m;

  const auto retyped = fingerprint(RegionArgs()
                                       .read("x", TensorView(buf, DType::kFP16, {4, 8}))
                                       .write("y", TensorView(buf + 1024, DType::kFP32, {16})));
  EXPECT_TRUE(has(fingerprint_mismatch(captured, retyped), "is now fp16[4x8]"));

  TensorView strided(buf, DType::kBF16, {4, 8});
  strided.stride[0] = 16;
  const auto restrided = fingerprint(
      RegionArgs().read("x", strided).write("y", TensorView(buf + 1024, DType::kFP32, {16})));
  m = fingerprint_mismatch(captured, restrided);
  EXPECT_TRUE(has(m, "strides (16,1)")) << m;

  const auto missing = fingerprint(RegionArgs().read("x", TensorView(buf, DType::kBF16, {4, 8})));
  m = fingerprint_mismatch(captured, missing);
  EXPECT_TRUE(has(m, "argument 'y' was captured but is no longer passed")) << m;

  const auto extra = fingerprint(RegionArgs()
                                     .read("x", TensorView(buf, DType::kBF16, {4, 8}))
                                     .write("y", TensorView(buf + 1024, DType::kFP32, {16}))
                                     .read("z", TensorView(buf, DType::kFP32, {1})));
  EXPECT_TRUE(
      has(fingerprint_mismatch(captured, extra), "argument 'z' is passed but was not captured"));

  const auto access = fingerprint(RegionArgs()
                                      .read("x", TensorView(buf, DType::kBF16, {4, 8}))
                                      .read_write("y", TensorView(buf + 1024, DType::kFP32, {16})));
  EXPECT_TRUE(
      has(fingerprint_mismatch(captured, access), "captured as write and is now read-write"));
}

TEST(CaptureFaults, ClassesNameTheFaultAndTheCode) {
  EXPECT_EQ(capture_fault_class(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize(s)"),
            "host synchronization during capture (cudaErrorStreamCaptureUnsupported)");
  EXPECT_EQ(capture_fault_class(cudaErrorStreamCaptureUnsupported, "cudaMalloc(&p, 64)"),
            "memory allocation or free during capture (cudaErrorStreamCaptureUnsupported)");
  EXPECT_EQ(capture_fault_class(cudaErrorStreamCaptureUnsupported, "cudaEventQuery(e)"),
            "stream or event query during capture (cudaErrorStreamCaptureUnsupported)");
  EXPECT_TRUE(has(capture_fault_class(cudaErrorStreamCaptureUnjoined), "not joined back"));
  EXPECT_TRUE(
      has(capture_fault_class(cudaErrorStreamCaptureUnjoined), "(cudaErrorStreamCaptureUnjoined)"));
  EXPECT_TRUE(has(capture_fault_class(cudaErrorStreamCaptureIsolation), "outside the capture"));
  EXPECT_TRUE(has(capture_fault_class(cudaErrorStreamCaptureImplicit), "legacy default stream"));
  EXPECT_TRUE(has(capture_fault_class(cudaErrorCapturedEvent), "event recorded in the capture"));
  EXPECT_TRUE(has(capture_fault_fix(cudaErrorStreamCaptureUnjoined), "wait on it"));
  EXPECT_TRUE(
      has(capture_fault_fix(cudaErrorStreamCaptureUnsupported, "cudaMalloc(&p, 64)"), "Arena"));
}

TEST(CaptureFaults, ErrorStatusMapsBackToTheCode) {
  EXPECT_EQ(
      capture_error_from_status(
          "cudaErrorStreamCaptureUnsupported (operation not permitted when stream is capturing)"),
      cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(capture_error_from_status("cudaErrorStreamCaptureInvalidated (x)"),
            cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(capture_error_from_status("cudaErrorCapturedEvent"), cudaErrorCapturedEvent);
  EXPECT_EQ(capture_error_from_status("cudaErrorInvalidValue (invalid argument)"),
            cudaErrorUnknown);
  EXPECT_EQ(capture_error_from_status("precondition failed"), cudaErrorUnknown);
}

TEST(GraphDump, FileNamesAreSafe) {
  EXPECT_EQ(dot_file_name("layer3.fwd"), "layer3.fwd.dot");
  EXPECT_EQ(dot_file_name("step gpt3/full"), "step_gpt3_full.dot");
  EXPECT_EQ(dot_file_name(""), "graph.dot");
}

TEST(RngTracker, RegistrationGivesDisjointOffsetsPerStream) {
  alignas(16) static char slots[RngTracker::kMaxStreams * 32];
  RngTracker rng(slots, sizeof(slots), 4);
  rng.add_parallel_streams(1234, /*tp_rank=*/3, /*ep_rank=*/2, /*expert_tp_rank=*/1);
  EXPECT_EQ(rng.stream_count(), 3);
  const RngArgs a = rng.register_op(kTensorParallelRng, "layer0.attn.dropout");
  const RngArgs b = rng.register_op(kTensorParallelRng, "layer0.mlp.dropout", 3);
  const RngArgs c = rng.register_op(kTensorParallelRng, "layer1.attn.dropout");
  const RngArgs d = rng.register_op(kDataParallelRng, "embedding.dropout");
  EXPECT_EQ(a.slot, rng.slot(kTensorParallelRng));
  EXPECT_EQ(d.slot, rng.slot(kDataParallelRng));
  EXPECT_NE(a.slot, d.slot);
  EXPECT_EQ(a.op_offset, 0u);
  EXPECT_EQ(b.op_offset, 1u);
  EXPECT_EQ(c.op_offset, 4u);
  EXPECT_EQ(d.op_offset, 0u);
  EXPECT_EQ(rng.consumption(kTensorParallelRng), 5u);
  EXPECT_EQ(rng.consumption(kDataParallelRng), 1u);
  EXPECT_EQ(rng.consumption(kExpertParallelRng), 0u);
  EXPECT_TRUE(has(rng.table(), "rng stream tensor-parallel: seed 3955, 5 positions per step"))
      << rng.table();
  EXPECT_TRUE(has(rng.table(), "rng stream expert-parallel: seed 2459,"))
      << rng.table();  // 1234+1024+200+1
  EXPECT_THROW(rng.register_op("pipeline", "x"), Error);
  EXPECT_THROW(rng.register_op(kTensorParallelRng, "layer0.attn.dropout"), Error);
  EXPECT_THROW(rng.add_stream("late", 1), Error);
}

TEST(RngTracker, RejectsTooManyStreamsAndShortMemory) {
  alignas(16) static char slots[64];
  EXPECT_THROW(RngTracker(slots, sizeof(slots), 4), Error);  // needs 128 bytes
  RngTracker rng(slots, sizeof(slots), 2);
  rng.add_stream("a", 1);
  rng.add_stream("b", 2);
  EXPECT_THROW(rng.add_stream("c", 3), Error);
  EXPECT_THROW(rng.add_stream("a", 3), Error);
}

TEST(Verify, FirstDifferenceAndValues) {
  const float a[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float b[4];
  std::memcpy(b, a, sizeof(a));
  EXPECT_EQ(first_difference(a, b, sizeof(a), DType::kFP32), -1);
  b[2] = 3.5f;
  EXPECT_EQ(first_difference(a, b, sizeof(a), DType::kFP32), 2);
  EXPECT_EQ(format_element(b, DType::kFP32, 2), "3.5 (0x40600000)");
  const uint16_t bf[2] = {0x3fc0, 0xc000};  // bf16 1.5, -2
  EXPECT_EQ(format_element(bf, DType::kBF16, 0), "1.5 (0x3fc0)");
  EXPECT_EQ(format_element(bf, DType::kBF16, 1), "-2 (0xc000)");
  const uint16_t hf[3] = {0x3e00, 0x0001, 0x7c00};  // fp16 1.5, smallest subnormal, +Inf
  EXPECT_EQ(format_element(hf, DType::kFP16, 0), "1.5 (0x3e00)");
  EXPECT_EQ(format_element(hf, DType::kFP16, 1), "5.9605e-08 (0x0001)");
  EXPECT_EQ(format_element(hf, DType::kFP16, 2), "inf (0x7c00)");
  const int64_t i64[1] = {-7};
  EXPECT_EQ(format_element(i64, DType::kINT64, 0), "-7");
  VerifyReport r;
  r.ok = false;
  r.graph = "layer0.fwd";
  r.tensor = "layer0.fwd:y";
  r.index = 5;
  r.eager_value = "3";
  r.graph_value = "1";
  EXPECT_EQ(r.message(),
            "verify-graphs: graph 'layer0.fwd': output 'layer0.fwd:y' differs at element 5: eager "
            "3, graphed 1");
}

}  // namespace
}  // namespace replay::graphs
