// Checkpoints of tensor-parallel runs across real MPI ranks, without a GPU (CTest runs it under
// mpiexec with 2 and with 4 ranks): HostGroup's point-to-point, broadcast and world splits;
// tp_gather puts every rank's slice of known tensors (kRows with 1 and 3 sections, kCols, bf16 and
// fp32 words) together on the group's rank 0, checked element by element, and tp_scatter gives each
// rank exactly its slice; write_checkpoint_tensors writes one file of whole tensors from a group of
// all ranks (replicated ones and scalars are rank 0's), recording the degree and the layouts, and
// read_checkpoint_tensors loads it in groups of 1, 2 and all ranks (resharding), each rank's store
// getting exactly its slice; a group that is only part of the world (the data-parallel rank 0's
// tensor-parallel group) writes while the others do nothing; a degree that does not divide the
// shapes and a layout that differs are refused with the tensor named.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "common/comm.h"
#include "train/checkpoint.h"
#include "train/host_group.h"
#include "train/tp_layout.h"

namespace replay::train {
namespace {

using safetensors::TensorEntry;

const comm::World& world() {
  return comm::world();
}

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// The value of element i of tensor `t` (distinct per tensor and element; exact in fp32 and in 16
// bits for these sizes).
uint32_t value(int t, int64_t i) {
  return static_cast<uint32_t>(t * 1000 + i + 1);
}

// A known whole tensor, its elements `value(tag, i)` as 2- or 4-byte words.
struct Known {
  std::string name;
  DType dtype;
  std::vector<int64_t> whole;
  TpLayout layout;
  int tag;
  std::vector<unsigned char> bytes() const {
    const size_t e = dtype_size(dtype);
    std::vector<unsigned char> out(static_cast<size_t>(numel(whole)) * e);
    for (int64_t i = 0; i < numel(whole); ++i) {
      const uint32_t v = value(tag, i);
      if (e == 2) {
        const auto w = static_cast<uint16_t>(v);
        std::memcpy(out.data() + i * 2, &w, 2);
      } else if (e == 4) {
        std::memcpy(out.data() + i * 4, &v, 4);
      } else {
        const uint64_t w = v;
        std::memcpy(out.data() + i * 8, &w, 8);
      }
    }
    return out;
  }
  // The value of slice element i of `rank` at degree `tp`, by the layout's definition (not
  // tp_extract): which whole element the slice's i-th element is.
  uint32_t slice_value(int tp, int rank, int64_t i) const {
    if (layout.split == TpSplit::kNone) return value(tag, i);
    const int64_t row = numel(whole) / whole.front();
    if (layout.split == TpSplit::kCols) {
      const int64_t cols = whole.back(), part = cols / tp;
      return value(tag, (i / part) * cols + rank * part + i % part);
    }
    int64_t r = i / row, first = 0;
    for (const int64_t s : layout.sections) {
      if (r < s / tp) return value(tag, (first + rank * (s / tp) + r) * row + i % row);
      r -= s / tp;
      first += s;
    }
    ADD_FAILURE() << "element " << i << " is in no section";
    return 0;
  }
};

// Divisible by 1, 2 and 4, not by 3 (section 2 of qkv: 4 rows).
std::vector<Known> model() {
  return {
      {"embedding.token", DType::kBF16, {8, 3}, {TpSplit::kRows, {8}}, 1},
      {"layer0.attn.qkv.weight", DType::kBF16, {16, 3}, {TpSplit::kRows, {8, 4, 4}}, 2},
      {"layer0.attn.qkv.bias", DType::kBF16, {16}, {TpSplit::kRows, {8, 4, 4}}, 3},
      {"layer0.attn.proj.weight", DType::kBF16, {3, 8}, {TpSplit::kCols, {}}, 4},
      {"layer0.ln1.weight", DType::kBF16, {3}, {}, 5},
      {"optimizer.master.layer0.attn.qkv.weight",
       DType::kFP32,
       {16, 3},
       {TpSplit::kRows, {8, 4, 4}},
       6},
      {"optimizer.master.layer0.attn.proj.weight", DType::kFP32, {3, 8}, {TpSplit::kCols, {}}, 7},
      {"train.step", DType::kINT64, {}, {}, 8},
  };
}

// The path rank 0 chose, on every rank.
std::string shared_temp_dir() {
  const HostGroup all(world(), 0);
  char path[256] = {};
  if (all.rank() == 0) {
    std::snprintf(path, sizeof(path), "/tmp/replay-tpckpt-XXXXXX");
    if (mkdtemp(path) == nullptr) path[0] = 0;
  }
  all.broadcast(path, sizeof(path), 0);
  return path;
}

TEST(HostGroup, SplitsTheWorldAndMovesBytes) {
  const int n = world().size, r = world().rank;
  const HostGroup all(world(), 0);
  EXPECT_EQ(all.size(), n);
  EXPECT_EQ(all.rank(), r);
  const HostGroup pairs(world(), r / 2);  // ranks {0, 1}, {2, 3}
  EXPECT_EQ(pairs.size(), std::min(2, n - (r / 2) * 2));
  EXPECT_EQ(pairs.rank(), r % 2);
  std::vector<int> data(5, r == 0 ? 42 : -1);
  all.broadcast(data.data(), data.size() * sizeof(int), 0);
  EXPECT_EQ(data, std::vector<int>(5, 42));
  // A ring: each rank sends its rank to the next.
  int got = -1;
  const int mine = r;
  if (r % 2 == 0) {
    all.send(&mine, sizeof(int), (r + 1) % n);
    all.recv(&got, sizeof(int), (r + n - 1) % n);
  } else {
    all.recv(&got, sizeof(int), (r + n - 1) % n);
    all.send(&mine, sizeof(int), (r + 1) % n);
  }
  EXPECT_EQ(got, (r + n - 1) % n);
  all.barrier();
  const HostGroup alone;
  EXPECT_EQ(alone.size(), 1);
  EXPECT_EQ(alone.rank(), 0);
}

TEST(HostGroup, GathersAndScattersSlices) {
  for (const int size : {2, world().size}) {
    const HostGroup g(world(), world().rank / size);
    SCOPED_TRACE("groups of " + std::to_string(g.size()));
    for (const Known& k : model()) {
      SCOPED_TRACE(k.name);
      const size_t e = dtype_size(k.dtype);
      const int tp = g.size();
      const std::vector<unsigned char> whole = k.bytes();
      // This rank's slice, as the training run holds it.
      std::vector<unsigned char> slice(static_cast<size_t>(tp_slice_numel(k.whole, k.layout, tp)) *
                                       e);
      tp_extract(k.whole, k.layout, tp, g.rank(), whole.data(), slice.data(), e);
      std::vector<unsigned char> assembled(g.rank() == 0 ? whole.size() : 0, 0xee);
      tp_gather(g, k.whole, k.layout, slice.data(), assembled.data(), e);
      if (g.rank() == 0) {
        for (int64_t i = 0; i < numel(k.whole); ++i) {
          uint32_t v = 0;
          std::memcpy(&v, assembled.data() + i * static_cast<int64_t>(e), std::min<size_t>(e, 4));
          if (e == 2) v &= 0xffff;
          ASSERT_EQ(v, value(k.tag, i)) << "element " << i;
        }
      }
      // The reverse: rank 0's whole tensor, each rank its slice.
      std::vector<unsigned char> mine(slice.size(), 0xee);
      tp_scatter(g, k.whole, k.layout, g.rank() == 0 ? whole.data() : nullptr, mine.data(), e);
      for (int64_t i = 0; i < static_cast<int64_t>(mine.size() / e); ++i) {
        uint32_t v = 0;
        std::memcpy(&v, mine.data() + i * static_cast<int64_t>(e), std::min<size_t>(e, 4));
        if (e == 2) v &= 0xffff;
        ASSERT_EQ(v, k.slice_value(tp, g.rank(), i)) << "slice element " << i;
      }
    }
  }
}

// A rank's checkpoint tensors: fetch gives its slice of the known tensor (a replicated one: a
// value only rank 0 has, so the file shows whose it took); store keeps what it is given.
std::vector<CheckpointTensor> tensors(int tp, int rank,
                                      std::vector<std::vector<unsigned char>>* got) {
  std::vector<CheckpointTensor> out;
  const std::vector<Known> known = model();
  got->assign(known.size(), {});
  for (size_t t = 0; t < known.size(); ++t) {
    const Known& k = known[t];
    TensorEntry e;
    e.name = k.name;
    e.dtype = k.dtype;
    e.shape = k.whole;
    const size_t el = dtype_size(k.dtype);
    const size_t bytes = static_cast<size_t>(tp_slice_numel(k.whole, k.layout, tp)) * el;
    CheckpointTensor c{e, k.layout, {}, {}};
    c.fetch = [k, tp, rank, el, bytes](void* slice) {
      std::vector<unsigned char> whole = k.bytes();
      if (k.layout.split == TpSplit::kNone && rank != 0) whole.assign(whole.size(), 0x5a);
      tp_extract(k.whole, k.layout, tp, rank, whole.data(), slice, el);
      (void)bytes;
    };
    std::vector<unsigned char>* into = &(*got)[t];
    c.store = [into, bytes](const void* slice) {
      into->assign(static_cast<const unsigned char*>(slice),
                   static_cast<const unsigned char*>(slice) + bytes);
    };
    out.push_back(std::move(c));
  }
  return out;
}

// Every tensor of `path` is the known whole tensor, element by element (rank 0 of the world).
void expect_whole_file(const std::string& path, int tp) {
  const safetensors::Reader r(path);
  EXPECT_EQ(r.meta(kTpDegreeKey), std::to_string(tp));
  EXPECT_EQ(checkpoint_tp(r), tp);
  const std::string layouts = r.meta(kTpLayoutKey);
  EXPECT_NE(layouts.find("\"layer0.attn.qkv.weight\":\"rows 8,4,4\""), std::string::npos)
      << layouts;
  EXPECT_NE(layouts.find("\"layer0.attn.proj.weight\":\"cols\""), std::string::npos) << layouts;
  EXPECT_EQ(layouts.find("optimizer."), std::string::npos) << layouts;  // their parameter's
  EXPECT_EQ(layouts.find("ln1"), std::string::npos) << layouts;         // replicated
  for (const Known& k : model()) {
    const TensorEntry* e = r.find(k.name);
    ASSERT_NE(e, nullptr) << k.name;
    EXPECT_EQ(e->shape, k.whole) << k.name;
    std::vector<unsigned char> data(e->bytes());
    r.read(*e, data.data());
    EXPECT_EQ(data, k.bytes()) << k.name << ": not the whole tensor (replicated: rank 0's)";
  }
}

// Each rank's stores got exactly its slice at degree tp.
void expect_slices(const std::vector<std::vector<unsigned char>>& got, int tp, int rank) {
  const std::vector<Known> known = model();
  for (size_t t = 0; t < known.size(); ++t) {
    const Known& k = known[t];
    const size_t e = dtype_size(k.dtype);
    ASSERT_EQ(got[t].size(), static_cast<size_t>(tp_slice_numel(k.whole, k.layout, tp)) * e)
        << k.name;
    for (int64_t i = 0; i < static_cast<int64_t>(got[t].size() / e); ++i) {
      uint64_t v = 0;
      std::memcpy(&v, got[t].data() + i * static_cast<int64_t>(e), e);
      ASSERT_EQ(v, k.slice_value(tp, rank, i))
          << k.name << " slice element " << i << " on rank " << rank << " of " << tp;
    }
  }
}

TEST(TpCheckpoint, OneFileOfWholeTensorsLoadsAtEveryDegree) {
  const std::string dir = shared_temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/step-00000010.safetensors";
  const int n = world().size, r = world().rank;
  {
    const HostGroup all(world(), 0);
    std::vector<std::vector<unsigned char>> unused;
    const uint64_t bytes = write_checkpoint_tensors(path, tensors(n, r, &unused),
                                                    {{"format", kCheckpointFormat}}, &all);
    uint64_t expect = 0;
    for (const Known& k : model())
      expect += static_cast<uint64_t>(numel(k.whole)) * dtype_size(k.dtype);
    EXPECT_EQ(bytes, r == 0 ? expect : 0u);
    all.barrier();  // the file is complete before anyone reads it
  }
  if (r == 0) expect_whole_file(path, n);

  // Loaded in groups of 1 (each rank reads the file itself), 2 and every rank.
  for (const int size : {1, 2, n}) {
    SCOPED_TRACE("read in groups of " + std::to_string(size));
    const HostGroup g(world(), r / size);
    std::vector<std::vector<unsigned char>> got;
    const std::vector<CheckpointTensor> list = tensors(g.size(), g.rank(), &got);
    std::unique_ptr<safetensors::Reader> reader;
    if (g.rank() == 0) reader = std::make_unique<safetensors::Reader>(path);
    read_checkpoint_tensors(reader.get(), list, &g);
    expect_slices(got, g.size(), g.rank());
  }

  // Refusals, on every rank, before any data moves: a degree that does not divide, a layout
  // that differs.
  const safetensors::Reader reader(path);
  EXPECT_NO_THROW(check_tensor_parallel(reader, 1));
  EXPECT_NO_THROW(check_tensor_parallel(reader, 4));
  std::string message;
  try {
    check_tensor_parallel(reader, 3);
  } catch (const bench::UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("written at --tp " + std::to_string(n) +
                         "; this run's --tp 3 cannot split "
                         "tensor 'embedding.token' [8, 3] (rows 8): its rows' section 0 (8 rows) "
                         "is not a multiple of 3"),
            std::string::npos)
      << message;
  std::vector<std::vector<unsigned char>> got;
  std::vector<CheckpointTensor> list = tensors(1, 0, &got);
  EXPECT_NO_THROW(check_layouts(reader, list));
  list[3].layout = TpLayout{TpSplit::kRows, {3}};  // proj as if column-parallel
  message.clear();
  try {
    check_layouts(reader, list);
  } catch (const bench::UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("tensor 'layer0.attn.proj.weight' is split as 'cols'"), std::string::npos)
      << message;
  // The optimizer's tensors are checked against their parameter's layout.
  list = tensors(1, 0, &got);
  list[6].layout = TpLayout{};
  message.clear();
  try {
    check_layouts(reader, list);
  } catch (const bench::UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("'optimizer.master.layer0.attn.proj.weight' is split as 'cols'"),
            std::string::npos)
      << message;

  const HostGroup all(world(), 0);
  all.barrier();
  if (r == 0) std::system(("rm -rf '" + dir + "'").c_str());
}

// Tensor x data parallel: only data-parallel rank 0's tensor-parallel group (world ranks 0 and 1)
// writes; the other group's ranks do nothing and nothing waits for them.
TEST(TpCheckpoint, OnlyTheFirstGroupWrites) {
  const int n = world().size, r = world().rank;
  if (n < 4) GTEST_SKIP() << "needs 4 ranks (TP2 x DP2)";
  const std::string dir = shared_temp_dir();
  const std::string path = dir + "/step-00000020.safetensors";
  const HostGroup tp(world(), r / 2);
  if (r / 2 == 0) {
    std::vector<std::vector<unsigned char>> unused;
    write_checkpoint_tensors(path, tensors(2, tp.rank(), &unused), {{"format", kCheckpointFormat}},
                             &tp);
  }
  const HostGroup all(world(), 0);
  all.barrier();
  if (r == 0) expect_whole_file(path, 2);
  // Every data-parallel group loads it: each group's rank 0 reads, its ranks take their slices.
  std::vector<std::vector<unsigned char>> got;
  const std::vector<CheckpointTensor> list = tensors(2, tp.rank(), &got);
  std::unique_ptr<safetensors::Reader> reader;
  if (tp.rank() == 0) reader = std::make_unique<safetensors::Reader>(path);
  read_checkpoint_tensors(reader.get(), list, &tp);
  expect_slices(got, 2, tp.rank());
  all.barrier();
  if (r == 0) std::system(("rm -rf '" + dir + "'").c_str());
}

}  // namespace
}  // namespace replay::train

int main(int argc, char** argv) {
  const replay::comm::World& w = replay::comm::init_world(&argc, &argv);
  if (w.size < 2) {
    std::printf("SKIPPED: run under mpiexec with 2 or more ranks (this is a world of %d)\n",
                w.size);
    replay::comm::finalize_world();
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  replay::comm::finalize_world();
  return failed;
}
