// replay-unet on the CPU: the network's structure (SD2's parameter count, diffusers' parameter
// names, blocks), the presets, and the flags the workload refuses before any GPU work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "train/driver.h"
#include "workloads/unet/unet_workload.h"

namespace replay::unet {
namespace {

train::RunFlags resolved(UnetWorkload& w, const std::vector<std::string>& args) {
  const std::optional<train::RunFlags> f = train::parse(w, args);
  if (!f) throw Error("test", "help", "--help was asked for");
  return train::resolve(w, *f);
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(UnetStructure, Sd2HasTheDiffusersUnetsParameterCountAndBlocks) {
  const UnetStructure s = unet_structure(preset_config("sd2-b32"));
  // diffusers' UNet2DConditionModel with SD 2's config.json: 865,910,724 parameters.
  EXPECT_EQ(s.parameters, 865910724);
  EXPECT_EQ(s.blocks, 11);  // input, 4 down, mid, 4 up, out
  for (const char* name :
       {"conv_in.weight", "time_embedding.linear_1.weight", "time_embedding.linear_2.bias",
        "down_blocks.0.resnets.0.norm1.weight", "down_blocks.0.resnets.0.time_emb_proj.weight",
        "down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k.weight",
        "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
        "down_blocks.1.resnets.0.conv_shortcut.weight", "down_blocks.2.downsamplers.0.conv.weight",
        "mid_block.attentions.0.proj_out.bias", "up_blocks.0.resnets.2.conv2.weight",
        "up_blocks.2.upsamplers.0.conv.bias", "up_blocks.3.attentions.2.norm.weight",
        "conv_norm_out.weight", "conv_out.bias"})
    EXPECT_TRUE(contains(s.parameter_names, name)) << name;
  EXPECT_FALSE(contains(s.parameter_names, "down_blocks.3.attentions.0.proj_in.weight"))
      << "no transformer at the lowest resolution";
  EXPECT_FALSE(contains(s.parameter_names, "up_blocks.3.upsamplers.0.conv.weight"));
  // Model FLOPs of a training step per image: three times a forward of several hundred GFLOP.
  EXPECT_GT(s.flops_per_step / 32, 0.8e12);
  EXPECT_LT(s.flops_per_step / 32, 6.0e12);
}

// The arena on the CPU (the model's buffers at their lifetimes, one phase per node and direction,
// each attention call's workspace estimated; cuDNN's and cuBLASLt's other workspaces add about 50
// MiB on a GPU). Before (block lifetimes, one attention workspace for the whole step, convolution
// inputs not kept for the weight gradient): 50.69 GiB at 32 images, 86.71 at 64, more than an
// 80 GB H100 holds. Now 41.81 and 68.95 GiB: 64 images fit one, at most 74 GiB, which leaves the
// CUDA context, the library handles and the graph 5 GiB of its 79.2.
TEST(UnetStructure, PlannedArenaFitsAnH100AtSixtyFourImages) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const UnetStructure b32 = unet_structure(preset_config("sd2-b32"));
  const UnetStructure b64 = unet_structure(preset_config("sd2-b64"));
  const double a32 = static_cast<double>(b32.arena_bytes) / gib;
  const double a64 = static_cast<double>(b64.arena_bytes) / gib;
  std::printf("planned arena: b32 %.2f GiB, b64 %.2f GiB (attention workspace %.2f, %.2f GiB)\n",
              a32, a64, static_cast<double>(b32.attention_workspace_bytes) / gib,
              static_cast<double>(b64.attention_workspace_bytes) / gib);
  std::printf("sd2-b32:\n%s\nsd2-b64:\n%s\n", b32.memory_report.c_str(), b64.memory_report.c_str());
  EXPECT_NEAR(a32, 41.81, 0.25);
  EXPECT_LE(a64, 74.0);
  EXPECT_NEAR(a64, 68.95, 0.25);
  // The arena is no larger than the bytes live at its peak phase: the placement wastes nothing.
  EXPECT_LE(b64.arena_bytes, b64.peak_live_bytes + (size_t{64} << 20)) << b64.peak_phase;
}

// Every buffer a phase reads or writes is live then: the convolutions' weight gradients read their
// inputs (until 2026-11-27 those inputs were not kept past the forward, and 52 of the SD2 UNet's
// convolutions read memory other buffers had been given by then); and no two buffers live at the
// same phase share a byte.
TEST(UnetStructure, EveryReadBufferIsLiveAndLiveBuffersAreDisjoint) {
  for (const char* preset : {"tiny", "sd2-b32", "sd2-b64"}) {
    SCOPED_TRACE(preset);
    const UnetStructure s = unet_structure(preset_config(preset));
    EXPECT_EQ(s.conv_inputs_dead_at_backward, 0);
    EXPECT_EQ(s.overlapping_live_pairs, 0);
  }
}

// --recompute: the backward recomputes GEGLU and norm outputs instead of keeping them; the arena
// shrinks, parameters and nodes stay, and every read buffer is still live.
TEST(UnetStructure, RecomputingShrinksTheArena) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const UnetStructure plain = unet_structure(preset_config("sd2-b64"));
  double last = static_cast<double>(plain.arena_bytes) / gib;
  for (const auto& [norms, geglu] : {std::pair{false, true}, {true, false}, {true, true}}) {
    UnetConfig c = preset_config("sd2-b64");
    c.recompute_norms = norms;
    c.recompute_geglu = geglu;
    const UnetStructure s = unet_structure(c);
    const double a = static_cast<double>(s.arena_bytes) / gib;
    std::printf("sd2-b64, recompute norms %d, GEGLU %d: arena %.2f GiB, peak at %s\n", norms, geglu,
                a, s.peak_phase.c_str());
    EXPECT_LT(s.arena_bytes, plain.arena_bytes);
    EXPECT_EQ(s.parameters, plain.parameters);
    EXPECT_EQ(s.nodes, plain.nodes);
    EXPECT_EQ(s.conv_inputs_dead_at_backward, 0);
    EXPECT_EQ(s.overlapping_live_pairs, 0);
    if (norms && geglu) {
      std::printf("%s\n", s.memory_report.c_str());
      EXPECT_LT(static_cast<double>(s.arena_bytes) / gib, last);
    }
    last = std::min(last, static_cast<double>(s.arena_bytes) / gib);
  }
}

TEST(UnetStructure, TinyIsTwoLevels) {
  const UnetConfig c = preset_config("tiny");
  EXPECT_EQ(c.levels(), 2);
  const UnetStructure s = unet_structure(c);
  EXPECT_EQ(s.blocks, 7);
  EXPECT_LT(s.parameters, 5000000);
  EXPECT_TRUE(contains(s.parameter_names, "down_blocks.0.attentions.0.proj_in.weight"));
  EXPECT_TRUE(contains(s.parameter_names, "mid_block.attentions.0.proj_in.weight"));
  EXPECT_FALSE(contains(s.parameter_names, "down_blocks.1.attentions.0.proj_in.weight"));
}

TEST(UnetConfig, BadShapesAreNamed) {
  UnetConfig c = preset_config("tiny");
  c.groups = 5;
  EXPECT_THROW(c.validate(), Error);
  c = preset_config("tiny");
  c.latent = 3;  // two levels halve it once
  EXPECT_THROW(c.validate(), Error);
  c = preset_config("tiny");
  c.head_dim = 24;
  EXPECT_THROW(c.validate(), Error);
}

TEST(UnetWorkloadFlags, PresetsAndTheirTrainingConfiguration) {
  UnetWorkload w;
  const train::RunFlags f = resolved(w, {"--preset", "sd2-b32"});
  EXPECT_EQ(w.unet().batch, 32);
  EXPECT_EQ(w.precision(), "fp16");
  const train::TrainingConfig t = w.training();
  ASSERT_TRUE(t.loss_scaling.has_value());
  EXPECT_EQ(t.schedule.warmup_steps, 1000);
  EXPECT_FLOAT_EQ(t.schedule.base_lr, 32 * 1.25e-7f);
  EXPECT_EQ(t.adam.beta2, 0.999f);
  EXPECT_EQ(t.adam.weight_decay, 0.01f);
  const nlohmann::ordered_json cfg = w.config();
  EXPECT_EQ(cfg["base_channels"], 320);
  EXPECT_EQ(cfg["context_dim"], 1024);
  (void)f;
  UnetWorkload b;
  resolved(b, {"--preset", "sd2-b64", "--precision", "bf16"});
  EXPECT_EQ(b.unet().batch, 64);
  EXPECT_EQ(b.precision(), "bf16");
  EXPECT_FALSE(b.training().loss_scaling.has_value());
}

TEST(UnetWorkloadFlags, BadFlagsAreRefusedBeforeAnyGpuWork) {
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--preset", "sd3"}), bench::UsageError);
  }
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--precision", "fp8"}), bench::UsageError);
  }
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--precision", "bf16", "--overflow-at", "1"}), bench::UsageError);
  }
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--steps", "3", "--overflow-at", "3"}), bench::UsageError);
  }
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--batch", "-2"}), bench::UsageError);
  }
  {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--skip-mode", "branch"}), bench::UsageError);
  }
  for (const char* mode : {"layer", "full"}) {  // events cannot time a graph's nodes one by one
    UnetWorkload w;
    try {
      resolved(w, {"--graphs", mode, "--op-times", "t.json"});
      ADD_FAILURE() << "no UsageError for --op-times with --graphs " << mode;
    } catch (const bench::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--graphs none"), std::string::npos) << e.what();
    }
  }
}

TEST(UnetWorkloadFlags, SkipModeChoosesHowTheOptimizerSkipsAnOverflow) {
  UnetWorkload noop;
  resolved(noop, {"--preset", "tiny"});
  EXPECT_FALSE(noop.training().skip_with_if);  // the default: the no-op flag
  EXPECT_EQ(noop.config()["skip_mode"], "noop");
  UnetWorkload cond;
  resolved(cond, {"--preset", "tiny", "--skip-mode", "if"});
  EXPECT_TRUE(cond.training().skip_with_if);
  EXPECT_EQ(cond.config()["skip_mode"], "if");
  UnetWorkload timed;
  resolved(timed, {"--preset", "tiny", "--graphs", "none", "--op-times", "t.json"});
}

TEST(UnetWorkloadFlags, PoisonDeadBuffersChecksEagerStepsOnly) {
  UnetWorkload eager;
  resolved(eager, {"--preset", "tiny", "--graphs", "none", "--poison-dead-buffers"});
  for (const char* mode : {"layer", "full"}) {
    UnetWorkload w;
    EXPECT_THROW(resolved(w, {"--preset", "tiny", "--graphs", mode, "--poison-dead-buffers"}),
                 bench::UsageError)
        << mode;
  }
}

TEST(UnetWorkloadFlags, DataStreamChoosesTheStreamedPath) {
  // Without a GPU: open_data generates (or reuses) tiny's synthetic file and says which path reads
  // it; a split of at most 1,024 samples is held in pinned memory unless --data-stream.
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream);
    UnetWorkload w;
    std::vector<std::string> args = {"--preset", "tiny"};
    if (stream) args.push_back("--data-stream");
    const train::RunFlags f = resolved(w, args);
    std::FILE* out = std::tmpfile();
    ASSERT_NE(out, nullptr);
    w.open_data(f, out);
    std::rewind(out);
    std::string text(4096, '\0');
    text.resize(std::fread(&text[0], 1, text.size(), out));
    std::fclose(out);
    EXPECT_EQ(text.find("streamed") != std::string::npos, stream) << text;
    EXPECT_EQ(text.find("held in pinned memory") != std::string::npos, !stream) << text;
  }
}

TEST(UnetStructure, OutputProjectionsStartAtZeroAsTheReferenceDoes) {
  // The reference (the MLPerf SD v2 UNet, ldm's openaimodel.py) wraps these in zero_module: each
  // residual block's second convolution, each spatial transformer's proj_out, conv_out.
  const UnetStructure s = unet_structure(preset_config("tiny"));
  ASSERT_EQ(s.parameter_init.size(), s.parameter_names.size());
  int zeroed = 0;
  for (size_t i = 0; i < s.parameter_names.size(); ++i) {
    const std::string& n = s.parameter_names[i];
    if (n.size() < 7 || n.compare(n.size() - 7, 7, ".weight") != 0) continue;  // biases start at 0
    const bool zero = n.find(".conv2.") != std::string::npos ||
                      n.find(".proj_out.") != std::string::npos || n.rfind("conv_out.", 0) == 0;
    EXPECT_EQ(s.parameter_init[i] == train::ParamInit::kZeros, zero) << n;
    zeroed += zero ? 1 : 0;
  }
  // tiny: 12 residual blocks (4 down, 2 mid, 6 up), 6 transformers, conv_out.
  EXPECT_EQ(zeroed, 12 + 6 + 1);
}

TEST(UnetStructure, OpTimesClassesCountTinysNodes) {
  const UnetStructure s = unet_structure(preset_config("tiny"));
  ASSERT_EQ(s.nodes_per_class.size(), static_cast<size_t>(kOpClasses));
  auto count = [&s](OpClass c) { return s.nodes_per_class[static_cast<size_t>(c)]; };
  // conv_in, 12 residual blocks x 2, 7 shortcuts (1 down, 6 up), a downsampler, an upsampler,
  // conv_out.
  EXPECT_EQ(count(OpClass::kConv), 1 + 24 + 7 + 1 + 1 + 1);
  EXPECT_EQ(count(OpClass::kGroupNorm), 12 * 2 + 6 + 1);  // resnets, transformers, conv_norm_out
  EXPECT_EQ(count(OpClass::kLayerNorm), 6 * 3);           // norm1-3 of 6 transformers
  EXPECT_EQ(count(OpClass::kAttention), 6 * 2);           // self and cross
  EXPECT_EQ(count(OpClass::kDiffusion), 3);               // sample, time_proj, loss
  int total = 0;
  for (int n : s.nodes_per_class) total += n;
  EXPECT_EQ(total, s.nodes);
}

// --op-times' rates: the norms' least memory traffic, counted here from SD2's architecture (16
// bit: 2 bytes an element). A norm's forward reads x and writes y (2 tensors); its backward reads x
// and dy and writes dx (3), and reads dx too where the gradient is added to (4): a residual
// block's norm1 and a transformer's GroupNorm and LayerNorms, whose input also feeds a later
// residual sum (whose backward runs first and writes the gradient).
TEST(UnetStructure, OpTimesRatesCountSd2sNormBytesAndFlops) {
  const UnetConfig c = preset_config("sd2-b32");
  const UnetStructure s = unet_structure(c);
  ASSERT_EQ(s.flops_per_class.size(), static_cast<size_t>(kOpClasses));
  ASSERT_EQ(s.bytes_per_class.size(), static_cast<size_t>(kOpClasses));
  const double B = 32;
  const double ch[4] = {320, 640, 1280, 1280}, res[4] = {64, 32, 16, 8};
  double gn = 0, ln = 0;  // elements times tensors moved
  auto resnet = [&](double r, double cin, double cout) { gn += B * r * r * (6 * cin + 5 * cout); };
  auto transformer = [&](double r, double C) {
    gn += 6 * B * r * r * C;
    ln += 3 * 6 * B * r * r * C;
  };
  double cin = 320;
  for (int i = 0; i < 4; ++i) {  // down
    for (int k = 0; k < 2; ++k) {
      resnet(res[i], k == 0 ? cin : ch[i], ch[i]);
      if (i < 3) transformer(res[i], ch[i]);
    }
    cin = ch[i];
  }
  resnet(8, 1280, 1280);  // mid
  transformer(8, 1280);
  resnet(8, 1280, 1280);
  // up: the skips pop in reverse of [320 | 320 320 320 | 640 640 640 | 1280 1280 1280 | 1280 1280]
  std::vector<double> skips = {320, 320, 320, 320, 640, 640, 640, 1280, 1280, 1280, 1280, 1280};
  double prev = 1280;
  for (int lvl = 3; lvl >= 0; --lvl) {
    for (int k = 0; k < 3; ++k) {
      const double skip = skips.back();
      skips.pop_back();
      resnet(res[lvl], (k == 0 ? prev : ch[lvl]) + skip, ch[lvl]);
      if (lvl < 3) transformer(res[lvl], ch[lvl]);
    }
    prev = ch[lvl];
  }
  ASSERT_TRUE(skips.empty());
  gn += 5 * B * 64 * 64 * 320;  // conv_norm_out
  auto bytes = [&s](OpClass k) { return s.bytes_per_class[static_cast<size_t>(k)]; };
  auto flops = [&s](OpClass k) { return s.flops_per_class[static_cast<size_t>(k)]; };
  EXPECT_DOUBLE_EQ(bytes(OpClass::kGroupNorm), 2 * gn);
  EXPECT_DOUBLE_EQ(bytes(OpClass::kLayerNorm), 2 * ln);
  // 16.4 GB of GroupNorm traffic and 13.3 of LayerNorm a step at 32 images: 5.5 and 4.4 ms at the
  // H100's 3 TB/s.
  EXPECT_NEAR(bytes(OpClass::kGroupNorm) / 1e9, 16.45, 0.01);
  EXPECT_NEAR(bytes(OpClass::kLayerNorm) / 1e9, 13.31, 0.01);
  // FLOPs where the work is matrix products, bytes where it is memory traffic.
  for (OpClass k : {OpClass::kConv, OpClass::kLinear, OpClass::kAttention}) {
    EXPECT_GT(flops(k), 0) << op_class_name(k);
    EXPECT_EQ(bytes(k), 0) << op_class_name(k);
  }
  for (OpClass k : {OpClass::kGroupNorm, OpClass::kLayerNorm, OpClass::kPointwise}) {
    EXPECT_EQ(flops(k), 0) << op_class_name(k);
    EXPECT_GT(bytes(k), 0) << op_class_name(k);
  }
  double total = 0;
  for (double f : s.flops_per_class) total += f;
  EXPECT_DOUBLE_EQ(total, s.flops_per_step);
  for (int k = 0; k < kOpClasses; ++k)
    std::printf("sd2-b32 %-12s %8.2f TFLOP %7.2f GB a step\n",
                op_class_name(static_cast<OpClass>(k)),
                s.flops_per_class[static_cast<size_t>(k)] / 1e12,
                s.bytes_per_class[static_cast<size_t>(k)] / 1e9);
  // --recompute norms runs every kept norm's forward again: 2 tensors of it, more bytes.
  UnetConfig r = c;
  r.recompute_norms = true;
  const UnetStructure rs = unet_structure(r);
  EXPECT_GT(rs.bytes_per_class[static_cast<size_t>(OpClass::kGroupNorm)],
            bytes(OpClass::kGroupNorm));
  EXPECT_LT(rs.bytes_per_class[static_cast<size_t>(OpClass::kGroupNorm)],
            bytes(OpClass::kGroupNorm) * 1.5);
}

}  // namespace
}  // namespace replay::unet
