// The benchmark harness on the CPU: the JSON summary's keys and order exactly as reports/SCHEMA.md
// "Workload runs" lists them (nulls for what was not measured), the throughput named after the
// workload's unit, evaluations, the atomic JSON writer, the hashes, the host launch delay, and
// run_main's exit codes.
#include "common/bench/harness.h"
#include "common/check.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace replay::bench {
namespace {

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

TEST(HarnessMain, ExitCodes) {
  EXPECT_EQ(run_main("tool", [] { return 0; }), 0);
  EXPECT_EQ(run_main("tool", [] { return 3; }), 3);
  EXPECT_EQ(run_main("tool", []() -> int { throw UsageError("--x: bad"); }), 2);
  EXPECT_EQ(run_main("tool", []() -> int { throw Error("replay", "failed", "something broke"); }),
            1);
}

WorkloadReport sample_report() {
  WorkloadReport r;
  r.tool = "replay-x";
  r.version = "v1";
  r.workload = "x";
  r.preset = "tiny";
  r.graphs = "full";
  r.environment.fields = {{"gpu", "H100"}, {"cuda_driver", "13.0"}};
  r.config = {{"layers", 2}, {"seed", 5}};
  r.tensor_parallel_collectives = "not run (1 process)";
  r.step_ms = summarize({10.0, 20.0, 30.0});
  r.host_enqueue_us = summarize({100.0, 200.0});
  r.unit = "tokens";
  r.units_per_step = 4096;
  r.samples_per_step = 2;
  r.flops_per_step = 2e12;
  r.flops_formula = "6*N*tokens";
  r.peak_tflops = 800;
  r.peak_bytes = 3000;
  r.arena_bytes = 2000;
  r.graph_count = 1;
  r.graph_nodes = 42;
  r.capture_ms = 1.5;
  r.instantiate_ms = 2.5;
  r.losses = {6.25f, 6.0f};
  r.weights_hash = "00ff";
  r.loss_floor = 1.25;
  return r;
}

std::vector<std::string> keys_of(const nlohmann::ordered_json& j) {
  std::vector<std::string> k;
  for (const auto& item : j.items()) k.push_back(item.key());
  return k;
}

TEST(HarnessJson, KeysAndOrderFollowTheSchema) {
  const nlohmann::ordered_json j = to_json(sample_report());
  const std::vector<std::string> expected = {"tool",
                                             "version",
                                             "workload",
                                             "preset",
                                             "graphs",
                                             "environment",
                                             "config",
                                             "tensor_parallel_collectives",
                                             "step_ms",
                                             "host_enqueue_us",
                                             "throughput",
                                             "model_tflops",
                                             "flops_per_step",
                                             "flops_formula",
                                             "mfu",
                                             "peaks",
                                             "memory",
                                             "graphs_info",
                                             "losses",
                                             "loss_hash",
                                             "weights_hash",
                                             "loss_floor",
                                             "evaluation",
                                             "target_quality",
                                             "steps_to_target",
                                             "time_to_train_s",
                                             "resumed_from",
                                             "checkpoints",
                                             "parallel"};
  EXPECT_EQ(keys_of(j), expected);
  EXPECT_EQ(keys_of(j["step_ms"]),
            (std::vector<std::string>{"median", "p10", "p90", "mean", "count"}));
  EXPECT_EQ(keys_of(j["host_enqueue_us"]), (std::vector<std::string>{"median", "p90"}));
  EXPECT_EQ(keys_of(j["throughput"]), (std::vector<std::string>{"tokens_per_s", "samples_per_s"}));
  EXPECT_EQ(keys_of(j["memory"]),
            (std::vector<std::string>{"peak_bytes", "arena_bytes", "graph_extra_bytes"}));
  EXPECT_EQ(keys_of(j["graphs_info"]),
            (std::vector<std::string>{"count", "nodes", "capture_ms", "instantiate_ms"}));
  EXPECT_DOUBLE_EQ(j["step_ms"]["median"].get<double>(), 20.0);
  EXPECT_EQ(j["step_ms"]["count"].get<int>(), 3);
  EXPECT_DOUBLE_EQ(j["throughput"]["tokens_per_s"].get<double>(), 4096 / 0.020);
  EXPECT_DOUBLE_EQ(j["throughput"]["samples_per_s"].get<double>(), 2 / 0.020);
  EXPECT_DOUBLE_EQ(j["model_tflops"].get<double>(), 100.0);  // 2e12 FLOP / 20 ms
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), 100.0 / 800.0);
  EXPECT_EQ(j["memory"]["graph_extra_bytes"].get<int64_t>(), 1000);
  EXPECT_EQ(j["environment"]["gpu"], "H100");
  EXPECT_EQ(j["losses"].size(), 2u);
  EXPECT_EQ(j["loss_hash"], loss_hash({6.25f, 6.0f}));
  EXPECT_EQ(j["loss_floor"].get<double>(), 1.25);
  EXPECT_TRUE(j["evaluation"].is_null());
  EXPECT_TRUE(j["target_quality"].is_null() && j["steps_to_target"].is_null() &&
              j["time_to_train_s"].is_null());
  EXPECT_TRUE(j["resumed_from"].is_null());
  EXPECT_TRUE(j["checkpoints"].is_array() && j["checkpoints"].empty());
}

TEST(HarnessJson, CheckpointsAndTheResumePointAreListed) {
  WorkloadReport r = sample_report();
  r.resumed_from = "ckpt/step-00000010.safetensors";
  r.first_step = 10;
  r.checkpoints = {{20, "ckpt/step-00000020.safetensors", 4096, 0.25}};
  const nlohmann::ordered_json j = to_json(r);
  EXPECT_EQ(j["resumed_from"]["path"], "ckpt/step-00000010.safetensors");
  EXPECT_EQ(j["resumed_from"]["step"], 10);
  ASSERT_EQ(j["checkpoints"].size(), 1u);
  EXPECT_EQ(keys_of(j["checkpoints"][0]),
            (std::vector<std::string>{"step", "path", "bytes", "seconds"}));
  EXPECT_EQ(j["checkpoints"][0]["step"], 20);
  EXPECT_EQ(j["checkpoints"][0]["bytes"], 4096);
  EXPECT_DOUBLE_EQ(j["checkpoints"][0]["seconds"].get<double>(), 0.25);
}

TEST(HarnessJson, ThroughputTakesTheUnitsNameAndEvaluationsAreListed) {
  WorkloadReport r = sample_report();
  r.unit = "images";
  r.units_per_step = 64;
  r.eval_metric = "loss";
  r.evals = {{10, 512, 2.5}, {20, 512, 2.25}};
  const nlohmann::ordered_json j = to_json(r);
  EXPECT_EQ(keys_of(j["throughput"]), (std::vector<std::string>{"images_per_s", "samples_per_s"}));
  EXPECT_DOUBLE_EQ(j["throughput"]["images_per_s"].get<double>(), 64 / 0.020);
  EXPECT_EQ(j["evaluation"]["metric"], "loss");
  ASSERT_EQ(j["evaluation"]["results"].size(), 2u);
  EXPECT_EQ(j["evaluation"]["results"][1]["step"], 20);
  EXPECT_EQ(j["evaluation"]["results"][1]["samples"], 512);
  EXPECT_DOUBLE_EQ(j["evaluation"]["results"][1]["value"].get<double>(), 2.25);
  std::string text = summary(r);
  EXPECT_TRUE(has(text, "images/s")) << text;
  EXPECT_TRUE(has(text, "loss 2.25 after step 20")) << text;

  r.target_quality = 2.3;  // reached at the second evaluation
  r.steps_to_target = 20;
  r.time_to_train_s = 1.5;
  const nlohmann::ordered_json t = to_json(r);
  EXPECT_DOUBLE_EQ(t["target_quality"].get<double>(), 2.3);
  EXPECT_EQ(t["steps_to_target"], 20);
  EXPECT_DOUBLE_EQ(t["time_to_train_s"].get<double>(), 1.5);
  text = summary(r);
  EXPECT_TRUE(has(text, "reached after 20 steps, 1.500 s")) << text;
  r.steps_to_target.reset();
  r.time_to_train_s.reset();
  EXPECT_TRUE(to_json(r)["steps_to_target"].is_null());
  text = summary(r);
  EXPECT_TRUE(has(text, "not reached")) << text;
}

TEST(HarnessJson, WhatWasNotMeasuredIsNull) {
  WorkloadReport r = sample_report();
  r.peak_tflops = 0;
  r.weights_hash.reset();
  r.loss_floor.reset();
  r.losses = {NAN, 5.0f};
  const nlohmann::ordered_json j = to_json(r);
  EXPECT_TRUE(j["mfu"].is_null());
  EXPECT_TRUE(j["peaks"]["bf16_gemm_tflops"].is_null());
  EXPECT_TRUE(j["weights_hash"].is_null());
  EXPECT_TRUE(j["loss_floor"].is_null());
  EXPECT_TRUE(j["losses"][0].is_null());
  const std::string text = summary(r);
  EXPECT_TRUE(has(text, "step time")) << text;
  EXPECT_TRUE(has(text, "not run (1 process)")) << text;
}

TEST(HarnessJson, WriterReplacesTheFileWhole) {
  const std::string path = ::testing::TempDir() + "harness_" + std::to_string(::getpid()) + ".json";
  write_json(path, to_json(sample_report()));
  std::ifstream in(path);
  const nlohmann::ordered_json back = nlohmann::ordered_json::parse(in);
  EXPECT_EQ(back["tool"], "replay-x");
  EXPECT_FALSE(std::ifstream(path + ".tmp").good()) << "temporary file left behind";
  std::remove(path.c_str());
  try {
    write_json("/nonexistent-dir/x.json", to_json(sample_report()));
    FAIL() << "wrote into a missing folder";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "/nonexistent-dir/x.json")) << e.what();
  }
}

TEST(HarnessHash, PiecesEqualTheWholeAndBitsMatter) {
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 37 + 11);
  Hasher whole;
  whole.update(data.data(), data.size());
  for (size_t cut : {1u, 7u, 8u, 9u, 500u, 999u}) {
    Hasher pieces;
    pieces.update(data.data(), cut);
    pieces.update(data.data() + cut, data.size() - cut);
    EXPECT_EQ(pieces.value(), whole.value()) << "cut at " << cut;
  }
  EXPECT_EQ(whole.hex().size(), 16u);
  EXPECT_NE(loss_hash({0.0f}), loss_hash({-0.0f}));  // exact bits, not values
  EXPECT_NE(loss_hash({1.0f, 2.0f}), loss_hash({2.0f, 1.0f}));
  EXPECT_EQ(loss_hash({1.0f, 2.0f}), loss_hash({1.0f, 2.0f}));
}

TEST(HarnessJson, FloatsPrintAsTheirShortestDecimal) {
  EXPECT_EQ(decimal(0.1f), 0.1);
  EXPECT_EQ(decimal(1e-4f), 1e-4);
  EXPECT_EQ(decimal(2e-5f), 2e-5);
  EXPECT_EQ(decimal(0.95f), 0.95);
  EXPECT_EQ(static_cast<float>(decimal(1.0f / 3.0f)), 1.0f / 3.0f);
  EXPECT_TRUE(std::isnan(decimal(NAN)));
}

TEST(HarnessHostDelay, EveryLaunchWaitsTheSetTime) {
  ASSERT_DOUBLE_EQ(host_launch_delay_us(), 0.0);
  using us = std::chrono::duration<double, std::micro>;
  auto t0 = std::chrono::steady_clock::now();
  detail::host_launch_delay();
  EXPECT_LT(us(std::chrono::steady_clock::now() - t0).count(), 500.0) << "off by default";
  set_host_launch_delay_us(2000.0);  // 2 ms
  EXPECT_DOUBLE_EQ(host_launch_delay_us(), 2000.0);
  t0 = std::chrono::steady_clock::now();
  detail::host_launch_delay();
  EXPECT_GE(us(std::chrono::steady_clock::now() - t0).count(), 2000.0);
  set_host_launch_delay_us(0.0);
  EXPECT_THROW(set_host_launch_delay_us(-1.0), Error);
  EXPECT_NE(seed_from_clock(), 0u);
}

}  // namespace
}  // namespace replay::bench
