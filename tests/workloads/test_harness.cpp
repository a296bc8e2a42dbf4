// The benchmark harness on the CPU: flag parsing (defaults, every flag, clear errors naming the
// flag), the JSON summary's keys and order exactly as reports/SCHEMA.md "Workload runs" lists them
// (nulls for what was not measured), the atomic JSON writer, the hashes, the host delay, and
// run_main's exit codes.
#include "common/bench/harness.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace replay::bench {
namespace {

const std::vector<std::string> kPresets = {"tiny", "big"};

HarnessFlags parse(const std::vector<std::string>& args) {
  const auto f = parse_flags("tool", args, kPresets, "tiny");
  EXPECT_TRUE(f.has_value());
  return f.value_or(HarnessFlags{});
}

std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse_flags("tool", args, kPresets, "tiny");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

TEST(HarnessFlags, DefaultsAndEveryFlag) {
  const HarnessFlags d = parse({});
  EXPECT_EQ(d.preset, "tiny");
  EXPECT_EQ(d.graphs, "full");
  EXPECT_EQ(d.steps, 0);
  EXPECT_EQ(d.warmup, 3);
  EXPECT_EQ(d.seed, 0u);
  EXPECT_EQ(d.log_interval, 10);
  EXPECT_EQ(d.microbatches, 1);
  EXPECT_TRUE(std::isnan(d.dropout));
  EXPECT_FALSE(d.verify_graphs);

  const HarnessFlags f = parse({"--preset",
                                "big",
                                "--graphs",
                                "layer",
                                "--steps",
                                "7",
                                "--warmup",
                                "0",
                                "--seed",
                                "18446744073709551615",
                                "--data",
                                "d.h5",
                                "--json",
                                "r.json",
                                "--mllog",
                                "r.mllog",
                                "--verify-graphs",
                                "--host-delay-us",
                                "12.5",
                                "--log-interval",
                                "2",
                                "--layers",
                                "5",
                                "--microbatches",
                                "4",
                                "--dropout",
                                "0.1",
                                "--device",
                                "1"});
  EXPECT_EQ(f.preset, "big");
  EXPECT_EQ(f.graphs, "layer");
  EXPECT_EQ(f.steps, 7);
  EXPECT_EQ(f.warmup, 0);
  EXPECT_EQ(f.seed, 18446744073709551615ull);
  EXPECT_EQ(f.data, "d.h5");
  EXPECT_EQ(f.json, "r.json");
  EXPECT_EQ(f.mllog, "r.mllog");
  EXPECT_TRUE(f.verify_graphs);
  EXPECT_DOUBLE_EQ(f.host_delay_us, 12.5);
  EXPECT_EQ(f.log_interval, 2);
  EXPECT_EQ(f.layers, 5);
  EXPECT_EQ(f.microbatches, 4);
  EXPECT_DOUBLE_EQ(f.dropout, 0.1);
  EXPECT_EQ(f.device, 1);
  const std::string text = describe(f);
  EXPECT_TRUE(has(text, "# graphs: layer\n")) << text;
  EXPECT_TRUE(has(text, "# seed: 18446744073709551615\n")) << text;
}

TEST(HarnessFlags, BadFlagsAreRejectedNamingTheFlag) {
  std::string m = usage_error({"--graphs", "partial"});
  EXPECT_TRUE(has(m, "--graphs")) << m;
  EXPECT_TRUE(has(m, "partial")) << m;
  EXPECT_TRUE(has(m, "--help")) << m;
  m = usage_error({"--preset", "huge"});
  EXPECT_TRUE(has(m, "--preset") && has(m, "huge")) << m;
  m = usage_error({"--bogus"});
  EXPECT_TRUE(has(m, "--bogus")) << m;
  m = usage_error({"--steps", "-3"});
  EXPECT_TRUE(has(m, "--steps")) << m;
  m = usage_error({"--steps", "many"});
  EXPECT_TRUE(has(m, "--steps")) << m;
  m = usage_error({"--dropout", "1.5"});
  EXPECT_TRUE(has(m, "--dropout") && has(m, "1.5")) << m;
  m = usage_error({"--dropout", "1"});
  EXPECT_TRUE(has(m, "--dropout") && has(m, "below 1")) << m;
  m = usage_error({"--microbatches", "0"});
  EXPECT_TRUE(has(m, "--microbatches")) << m;
  m = usage_error({"--log-interval", "0"});
  EXPECT_TRUE(has(m, "--log-interval")) << m;
  m = usage_error({"--seed", "-1"});
  EXPECT_TRUE(has(m, "--seed")) << m;
  m = usage_error({"--host-delay-us", "-1"});
  EXPECT_TRUE(has(m, "--host-delay-us")) << m;
}

TEST(HarnessFlags, HelpPrintsEveryFlagAndReturnsNothing) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  EXPECT_FALSE(parse_flags("tool", {"--help"}, kPresets, "tiny", out).has_value());
  std::rewind(out);
  std::string text;
  for (int c; (c = std::fgetc(out)) != EOF;) text += static_cast<char>(c);
  std::fclose(out);
  for (const char* flag : {"--preset", "--graphs", "--steps", "--warmup", "--seed", "--data",
                           "--json", "--mllog", "--verify-graphs", "--host-delay-us",
                           "--log-interval", "--layers", "--microbatches", "--dropout", "--device"})
    EXPECT_TRUE(has(text, flag)) << flag << " missing from --help:\n" << text;
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
  r.tokens_per_step = 4096;
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
  const std::vector<std::string> expected = {
      "tool",           "version",         "workload",   "preset",
      "graphs",         "environment",     "config",     "tensor_parallel_collectives",
      "step_ms",        "host_enqueue_us", "throughput", "model_tflops",
      "flops_per_step", "flops_formula",   "mfu",        "peaks",
      "memory",         "graphs_info",     "losses",     "loss_hash",
      "weights_hash",   "loss_floor"};
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

TEST(HarnessHostDelay, BusyWaitsTheGivenTime) {
  const HostDelay none;
  const HostDelay delay(2000.0);  // 2 ms
  EXPECT_DOUBLE_EQ(delay.microseconds(), 2000.0);
  const auto t0 = std::chrono::steady_clock::now();
  none();
  const auto t1 = std::chrono::steady_clock::now();
  delay();
  const auto t2 = std::chrono::steady_clock::now();
  using us = std::chrono::duration<double, std::micro>;
  EXPECT_LT(us(t1 - t0).count(), 500.0);
  EXPECT_GE(us(t2 - t1).count(), 2000.0);
  EXPECT_NE(seed_from_clock(), 0u);
}

}  // namespace
}  // namespace replay::bench
