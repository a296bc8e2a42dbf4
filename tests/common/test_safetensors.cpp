// The safetensors reader and writer on small files: a round trip with metadata and the data hash,
// nothing at the final name before commit and no temporary left behind, and every kind of broken
// file (truncated, corrupt, a header that lies) rejected with a message naming what is wrong.
#include "common/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"

namespace replay::safetensors {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/replay-safetensors-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // Every entry of the directory, dot files included.
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    FILE* p = popen(("ls -A '" + path_ + "'").c_str(), "r");
    char line[512];
    while (p && std::fgets(line, sizeof(line), p)) {
      std::string s(line);
      if (!s.empty() && s.back() == '\n') s.pop_back();
      out.push_back(s);
    }
    if (p) pclose(p);
    return out;
  }

 private:
  std::string path_;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TensorEntry entry(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  TensorEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  return e;
}

// Three tensors: bf16 [2, 3] (12 bytes), an i64 scalar (8), f32 [4] (16).
struct Sample {
  std::vector<uint16_t> a{1, 2, 3, 4, 5, 6};
  int64_t b = -42;
  std::vector<float> c{0.5f, -1.0f, 2.25f, 1e-3f};
};

void write_sample(const std::string& path, const Sample& s, bool hash = true) {
  Writer w(path,
           {entry("layer.weight", DType::kBF16, {2, 3}), entry("train.step", DType::kINT64, {}),
            entry("optimizer.m", DType::kFP32, {4})},
           {{"format", "test"}, {"preset", "tiny"}}, hash);
  w.write(s.a.data(), 6);  // pieces need not follow tensor boundaries
  w.write(reinterpret_cast<const char*>(s.a.data()) + 6, 6);
  w.write(&s.b, 8);
  w.write(s.c.data(), 16);
  w.commit();
}

// A file from a header text and data bytes, as another writer would make it.
std::string file_of(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

void expect_error(const std::string& path, const std::string& what) {
  try {
    Reader r(path);
    r.read_all([](const TensorEntry&, uint64_t, const void*, size_t) {});
    FAIL() << "no error for " << path << " (expected: " << what << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << what;
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "names the file";
  }
}

TEST(Safetensors, RoundTripKeepsNamesDtypesShapesMetadataAndBytes) {
  TempDir dir;
  const Sample s;
  write_sample(dir.file("a.safetensors"), s);
  Reader r(dir.file("a.safetensors"));
  ASSERT_EQ(r.tensors().size(), 3u);
  EXPECT_EQ(r.tensors()[0].name, "layer.weight");
  EXPECT_EQ(r.tensors()[0].dtype, DType::kBF16);
  EXPECT_EQ(r.tensors()[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.tensors()[1].shape, std::vector<int64_t>{});
  EXPECT_EQ(r.tensors()[1].bytes(), 8u);
  EXPECT_EQ(r.find("optimizer.m")->begin, 20u);
  EXPECT_EQ(r.find("missing"), nullptr);
  EXPECT_EQ(r.meta("preset"), "tiny");
  EXPECT_EQ(r.meta("absent"), "");
  EXPECT_EQ(r.meta(kDataHashKey).size(), 16u);
  EXPECT_EQ(r.data_bytes(), 36u);

  std::vector<uint16_t> a(6);
  int64_t b = 0;
  std::vector<float> c(4);
  r.read(*r.find("layer.weight"), a.data());
  r.read(*r.find("train.step"), &b);
  r.read(*r.find("optimizer.m"), c.data());
  EXPECT_EQ(a, s.a);
  EXPECT_EQ(b, s.b);
  EXPECT_EQ(c, s.c);

  std::string streamed;
  r.read_all([&](const TensorEntry&, uint64_t, const void* d,
                 size_t n) { streamed.append(static_cast<const char*>(d), n); },
             5);  // pieces smaller than a tensor
  EXPECT_EQ(streamed.size(), 36u);
  EXPECT_EQ(std::memcmp(streamed.data() + 12, &s.b, 8), 0);

  // The header is JSON padded to a multiple of 8 bytes, as the format recommends.
  const std::string bytes = slurp(dir.file("a.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_NE(bytes.find("\"dtype\":\"BF16\""), std::string::npos);
}

TEST(Safetensors, NothingAppearsBeforeCommitAndNoTemporaryIsLeft) {
  TempDir dir;
  const std::string path = dir.file("b.safetensors");
  {
    Writer w(path, {entry("x", DType::kFP32, {2})}, {});
    const float half[1] = {1.0f};
    w.write(half, 4);
    EXPECT_NE(access(path.c_str(), F_OK), 0) << "the final name exists before commit";
    EXPECT_EQ(dir.entries().size(), 1u) << "one temporary while writing";
    // Abandoned (a crash mid-save): the destructor removes the temporary.
  }
  EXPECT_TRUE(dir.entries().empty()) << "a temporary was left behind";

  Writer w(path, {entry("x", DType::kFP32, {2})}, {});
  const float two[2] = {1.0f, 2.0f};
  w.write(two, 4);
  EXPECT_THROW(w.commit(), Error) << "commit with 4 of 8 bytes";
  EXPECT_THROW(w.write(two, 8), Error) << "12 of 8 bytes";
  w.write(two + 1, 4);
  w.commit();
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"b.safetensors"});
}

TEST(Safetensors, AnUnwritableDirectoryIsNamed) {
  try {
    Writer w("/nonexistent-replay-dir/c.safetensors", {entry("x", DType::kFP32, {1})}, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-replay-dir"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, TruncatedAndCorruptFilesAreRejected) {
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  write_sample(path, Sample{});
  const std::string good = slurp(path);

  spit(path, good.substr(0, good.size() - 1));
  expect_error(path, "truncated: the header describes 36 bytes of data, the file holds 35");
  spit(path, good.substr(0, 5));
  expect_error(path, "truncated");
  spit(path, good.substr(0, 40));
  expect_error(path, "truncated: the header claims");
  spit(path, good + "x");
  expect_error(path, "1 bytes past the last tensor");

  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x10;  // one bit of optimizer.m
  spit(path, flipped);
  expect_error(path, "corrupt: the data hash to");

  // Without the hash the same flip reads (other writers' files carry none).
  write_sample(path, Sample{}, false);
  std::string plain = slurp(path);
  plain[plain.size() - 3] ^= 0x10;
  spit(path, plain);
  Reader r(path);
  EXPECT_NO_THROW(r.read_all([](const TensorEntry&, uint64_t, const void*, size_t) {}));
}

TEST(Safetensors, HeadersThatLieAreRejected) {
  TempDir dir;
  const std::string path = dir.file("e.safetensors");
  const std::string data8(8, '\0');
  struct Case {
    std::string header, data, message;
  } cases[] = {
      {"not json", data8, "the header is not JSON"},
      {"[1, 2]", data8, "not a JSON object"},
      {R"({"x": {"dtype": "F32", "shape": [2]}})", data8, "lacks dtype, shape or data_offsets"},
      {R"({"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", data8,
       "tensor 'x': dtype 'Q7'"},
      {R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data8,
       "not a non-negative integer"},
      {R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", data8,
       "hold 8 bytes, its F32 [3] needs 12"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "y": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})",
       data8, "(overlap)"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", data8, "(a gap)"},
      {R"({"__metadata__": {"k": 3}})", "", "__metadata__ 'k' is not a string"},
  };
  for (const Case& c : cases) {
    spit(path, file_of(c.header, c.data));
    expect_error(path, c.message);
  }
  std::string huge(8, '\xff');
  spit(path, huge + "{}");
  expect_error(path, "a header of");
  expect_error(dir.file("missing.safetensors"), "cannot open");
}

TEST(Safetensors, FilesFromOtherWritersRead) {
  TempDir dir;
  const std::string path = dir.file("f.safetensors");
  // What safetensors.torch.save_file writes for {"w": torch.ones(2, dtype=torch.bfloat16)}.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  spit(path, file_of(header, std::string("\x80\x3f\x80\x3f", 4)));
  Reader r(path);
  ASSERT_NE(r.find("w"), nullptr);
  uint16_t w[2] = {};
  r.read(*r.find("w"), w);
  EXPECT_EQ(w[0], 0x3f80);
  EXPECT_EQ(r.meta("format"), "pt");
}

// The Python package reads what the writer wrote (skipped where it is not importable).
TEST(Safetensors, ThePythonPackageReadsOurFiles) {
  if (std::system("python3 -c 'import safetensors.numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "the safetensors Python package is not importable";
  TempDir dir;
  const std::string path = dir.file("g.safetensors");
  Writer w(path, {entry("train.step", DType::kINT64, {}), entry("m", DType::kFP32, {2, 2})},
           {{"format", "replay-checkpoint"}});
  const int64_t step = 12;
  const float m[4] = {1.0f, -2.0f, 0.5f, 4.0f};
  w.write(&step, 8);
  w.write(m, 16);
  w.commit();
  const std::string cmd =
      "python3 -c \"import safetensors, safetensors.numpy as n; t = n.load_file('" + path +
      "'); f = safetensors.safe_open('" + path +
      "', 'np'); print(int(t['train.step']), t['m'].shape, float(t['m'].sum()), "
      "f.metadata()['format'])\"";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[256] = {};
  const bool read = std::fgets(line, sizeof(line), p) != nullptr;
  const int status = pclose(p);
  ASSERT_TRUE(read && status == 0) << cmd;
  EXPECT_EQ(std::string(line), "12 (2, 2) 3.5 replay-checkpoint\n");
}

}  // namespace
}  // namespace replay::safetensors
