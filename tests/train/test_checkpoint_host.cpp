// Checkpoints on the CPU (train/checkpoint.h): --load finds the newest step file of a directory,
// --save makes its directory and refuses one it cannot write, and a checkpoint that is not this
// run's (another format, version, workload, preset or precision; a tensor missing, extra, of
// another shape or dtype) is refused with a message naming the tensor and both shapes.
#include "train/checkpoint.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/bench/harness.h"

namespace replay::train {
namespace {

using safetensors::TensorEntry;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/replay-checkpoint-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("chmod -R u+w '" + path_ + "'; rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TensorEntry entry(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  TensorEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  return e;
}

const CheckpointIdentity kId{"replay-gpt3", "gpt3", "tiny", "bf16", 4242};

// A checkpoint-shaped file with `tensors` (zero bytes) and replay's metadata, `meta` overriding.
std::string write(const std::string& path, const std::vector<TensorEntry>& tensors,
                  const safetensors::Metadata& meta = {}) {
  safetensors::Metadata m{
      {"format", kCheckpointFormat}, {"format_version", std::to_string(kCheckpointVersion)},
      {"workload", "gpt3"},          {"preset", "tiny"},
      {"precision", "bf16"},         {"seed", "4242"}};
  for (const auto& [k, v] : meta) m[k] = v;
  safetensors::Writer w(path, tensors, m);
  for (const TensorEntry& e : w.tensors()) {
    const std::vector<char> zeros(e.bytes(), 0);
    w.write(zeros.data(), zeros.size());
  }
  w.commit();
  return path;
}

std::string usage_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const bench::UsageError& e) {
    return e.what();
  }
  return "(no UsageError)";
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

const std::vector<TensorEntry> kExpected = {
    entry("layer0.attn.qkv.weight", DType::kBF16, {384, 128}),
    entry("optimizer.master.layer0.attn.qkv.weight", DType::kFP32, {384, 128}),
    entry("train.step", DType::kINT64, {}),
};

TEST(CheckpointFiles, LoadTakesAFileOrTheNewestStepOfADirectory) {
  TempDir dir;
  EXPECT_TRUE(has(usage_error([&] { find_checkpoint(dir.path()); }), "holds no checkpoint"));
  EXPECT_TRUE(has(usage_error([&] { find_checkpoint(dir.path() + "/nope"); }), "does not exist"));
  EXPECT_EQ(checkpoint_file_name(20), "step-00000020.safetensors");
  for (int64_t it : {10, 200, 30}) write(dir.path() + "/" + checkpoint_file_name(it), kExpected);
  write(dir.path() + "/step-9999.bak", kExpected);  // not a step file
  EXPECT_EQ(find_checkpoint(dir.path()), dir.path() + "/step-00000200.safetensors");
  const std::string file = dir.path() + "/step-00000030.safetensors";
  EXPECT_EQ(find_checkpoint(file), file);
}

TEST(CheckpointFiles, SaveMakesItsDirectoryAndRefusesOneItCannotWrite) {
  TempDir dir;
  const std::string nested = dir.path() + "/a/b/c";
  prepare_save_directory(nested);
  struct stat st {};
  ASSERT_EQ(stat(nested.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  write(dir.path() + "/file", kExpected);
  EXPECT_TRUE(has(usage_error([&] { prepare_save_directory(dir.path() + "/file/x"); }),
                  "--save: cannot create"));
  if (geteuid() != 0) {  // root writes anywhere
    const std::string locked = dir.path() + "/locked";
    prepare_save_directory(locked);
    chmod(locked.c_str(), 0555);
    EXPECT_TRUE(has(usage_error([&] { prepare_save_directory(locked); }), "cannot write in"));
  }
}

TEST(CheckpointFiles, AnotherRunsCheckpointIsRefusedBeforeAnyWork) {
  TempDir dir;
  const std::string p = dir.path() + "/c.safetensors";
  write(p, kExpected);
  EXPECT_NO_THROW(open_checkpoint(p, kId));
  EXPECT_EQ(checkpoint_seed(p), 4242u);
  struct Case {
    safetensors::Metadata meta;
    std::string message;
  } cases[] = {
      {{{"format", "pt"}}, "is not a replay checkpoint"},
      {{{"format_version", "7"}}, "is format version 7, this replay-gpt3 reads version 1"},
      {{{"workload", "llama31"}},
       "a checkpoint of workload 'llama31', this run is workload 'gpt3'"},
      {{{"preset", "175b-tp8"}}, "preset '175b-tp8', this run is preset 'tiny'"},
      {{{"precision", "fp16"}}, "precision 'fp16', this run is precision 'bf16'"},
      {{{"seed", "7"}}, "was trained with seed 7, this run has --seed 4242"},
  };
  for (const Case& c : cases) {
    write(p, kExpected, c.meta);
    const std::string e = usage_error([&] { open_checkpoint(p, kId); });
    EXPECT_TRUE(has(e, c.message)) << e;
  }
}

TEST(CheckpointFiles, EveryTensorMustMatchAndTheMessageNamesIt) {
  TempDir dir;
  const std::string p = dir.path() + "/c.safetensors";
  write(p, kExpected);
  EXPECT_NO_THROW(check_tensors(safetensors::Reader(p), kExpected));

  std::vector<TensorEntry> shape = kExpected;
  shape[1].shape = {384, 64};
  write(p, shape);
  std::string e = usage_error([&] { check_tensors(safetensors::Reader(p), kExpected); });
  EXPECT_TRUE(has(e, "tensor 'optimizer.master.layer0.attn.qkv.weight' is [384, 64] in " + p +
                         ", this run needs [384, 128]"))
      << e;

  std::vector<TensorEntry> dtype = kExpected;
  dtype[0].dtype = DType::kFP16;
  write(p, dtype);
  e = usage_error([&] { check_tensors(safetensors::Reader(p), kExpected); });
  EXPECT_TRUE(has(e, "tensor 'layer0.attn.qkv.weight' is F16 in")) << e;
  EXPECT_TRUE(has(e, "this run needs BF16")) << e;

  std::vector<TensorEntry> missing(kExpected.begin(), kExpected.begin() + 2);
  write(p, missing);
  e = usage_error([&] { check_tensors(safetensors::Reader(p), kExpected); });
  EXPECT_TRUE(has(e, "has no tensor 'train.step' (I64 [] in this run)")) << e;

  std::vector<TensorEntry> extra = kExpected;
  extra.push_back(entry("layer1.attn.qkv.weight", DType::kBF16, {384, 128}));
  write(p, extra);
  e = usage_error([&] { check_tensors(safetensors::Reader(p), kExpected); });
  EXPECT_TRUE(has(e,
                  "holds tensor 'layer1.attn.qkv.weight' (BF16 [384, 128]), which this run "
                  "does not have"))
      << e;
}

// One process (no tensor-parallel group): the file holds each tensor as the run has it, records
// degree 1 and the split tensors' layouts, and reads back into the stores in the file's order
// whatever the list's order; a later run whose --tp does not divide a split tensor is refused
// naming it, one whose --tp divides every split tensor is not; a parameter that differs on every
// rank without a TpSplit cannot be saved at --tp 2.
TEST(CheckpointFiles, OneProcessWritesWholeTensorsWithTheirLayouts) {
  TempDir dir;
  const std::string p = dir.path() + "/step-00000001.safetensors";
  struct Known {
    TensorEntry entry;
    TpLayout layout;
    std::vector<float> data;
  };
  std::vector<Known> known = {
      {entry("layer0.attn.qkv.weight", DType::kFP32, {6, 2}), {TpSplit::kRows, {2, 2, 2}}, {}},
      {entry("layer0.attn.proj.weight", DType::kFP32, {2, 4}), {TpSplit::kCols, {}}, {}},
      {entry("layer0.ln1.weight", DType::kFP32, {3}), {}, {}},
  };
  for (size_t t = 0; t < known.size(); ++t)
    for (int64_t i = 0; i < known[t].entry.numel(); ++i)
      known[t].data.push_back(static_cast<float>(100 * t + i));
  std::vector<std::vector<float>> got(known.size());
  auto list = [&](bool reversed) {
    std::vector<CheckpointTensor> out;
    for (size_t k = 0; k < known.size(); ++k) {
      const size_t t = reversed ? known.size() - 1 - k : k;
      CheckpointTensor c{known[t].entry, known[t].layout, {}, {}};
      const std::vector<float>* from = &known[t].data;
      std::vector<float>* into = &got[t];
      c.fetch = [from](void* slice) {
        std::memcpy(slice, from->data(), from->size() * sizeof(float));
      };
      c.store = [from, into](const void* slice) {
        into->assign(static_cast<const float*>(slice),
                     static_cast<const float*>(slice) + from->size());
      };
      out.push_back(std::move(c));
    }
    return out;
  };
  EXPECT_EQ(write_checkpoint_tensors(p, list(false), {{"format", kCheckpointFormat}}, nullptr),
            (12u + 8u + 3u) * sizeof(float));
  const safetensors::Reader r(p);
  EXPECT_EQ(checkpoint_tp(r), 1);
  EXPECT_EQ(r.meta(kTpLayoutKey),
            "{\"layer0.attn.qkv.weight\":\"rows 2,2,2\",\"layer0.attn.proj.weight\":\"cols\"}");
  read_checkpoint_tensors(&r, list(true), nullptr);
  for (size_t t = 0; t < known.size(); ++t) EXPECT_EQ(got[t], known[t].data) << t;
  EXPECT_NO_THROW(check_tensor_parallel(r, 2));
  EXPECT_NO_THROW(check_layouts(r, list(false)));
  const std::string e = usage_error([&] { check_tensor_parallel(r, 4); });
  EXPECT_TRUE(has(e,
                  "was written at --tp 1; this run's --tp 4 cannot split tensor "
                  "'layer0.attn.qkv.weight' [6, 2] (rows 2,2,2): its rows' section 0 (2 rows) "
                  "is not a multiple of 4"))
      << e;

  ParamStore ps;
  ps.add(ParamSpec{
      "embedding.token", {8, 4}, ParamInit::kNormal, 0.02f, true, false, TpSplit::kRows, {}});
  ps.add(ParamSpec{"layer0.ln1.weight", {4}, ParamInit::kOnes, 0, false, true, TpSplit::kNone, {}});
  EXPECT_NO_THROW(check_tensor_parallel_params(ps, 2));
  ps.add(ParamSpec{
      "layer0.attn.qkv.bias", {6}, ParamInit::kZeros, 0, false, false, TpSplit::kNone, {}});
  EXPECT_NO_THROW(check_tensor_parallel_params(ps, 1));
  EXPECT_TRUE(has(usage_error([&] { check_tensor_parallel_params(ps, 2); }),
                  "parameter 'layer0.attn.qkv.bias' differs on every tensor-parallel rank"));
}

}  // namespace
}  // namespace replay::train
