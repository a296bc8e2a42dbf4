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

// The arena on the CPU: at 32 images what the H100 run planned (50.82 GiB with cuDNN's and
// cuBLASLt's workspaces, reports/h100/2026-11-27/unet), at 64 more than an 80 GB H100 holds.
TEST(UnetStructure, PlannedArenaFitsAtThirtyTwoImagesAndNotAtSixtyFour) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const UnetStructure b32 = unet_structure(preset_config("sd2-b32"));
  const UnetStructure b64 = unet_structure(preset_config("sd2-b64"));
  const double a32 = static_cast<double>(b32.arena_bytes + b32.attention_workspace_bytes) / gib;
  const double a64 = static_cast<double>(b64.arena_bytes + b64.attention_workspace_bytes) / gib;
  std::printf("planned arena: b32 %.2f GiB, b64 %.2f GiB (attention workspace %.2f, %.2f GiB)\n",
              a32, a64, static_cast<double>(b32.attention_workspace_bytes) / gib,
              static_cast<double>(b64.attention_workspace_bytes) / gib);
  EXPECT_NEAR(a32, 50.82, 1.0);
  EXPECT_GT(a64, 80.0);
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
}

}  // namespace
}  // namespace replay::unet
