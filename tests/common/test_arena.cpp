// ArenaPlan: lifetime sharing, alignment, determinism, the out-of-memory message.
#include "common/arena.h"

#include <gtest/gtest.h>

namespace replay {
namespace {

bool overlap_bytes(const ArenaPlan::Entry& a, const ArenaPlan::Entry& b) {
  return a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

TEST(ArenaPlan, DisjointLifetimesShareMemory) {
  ArenaPlan p;
  BufferId a = p.add("act0", 1000, "activations", {0, 1});
  BufferId b = p.add("act1", 1000, "activations", {2, 3});
  BufferId w = p.add("weights", 4096, "params");
  p.plan();
  EXPECT_EQ(p.entry(a).offset, p.entry(b).offset);
  EXPECT_FALSE(overlap_bytes(p.entry(a), p.entry(w)));
  EXPECT_EQ(p.total_bytes(), 4096u + 1024u);
  EXPECT_EQ(p.sum_bytes(), 6096u);
}

TEST(ArenaPlan, OverlappingLifetimesNeverAlias) {
  ArenaPlan p;
  // A ladder of lifetimes: i lives [i, i+2]; each overlaps its neighbours.
  for (int i = 0; i < 20; ++i) p.add("b" + std::to_string(i), 100 + 37 * i, "act", {i, i + 2});
  p.plan();
  const auto& e = p.entries();
  for (size_t i = 0; i < e.size(); ++i) {
    EXPECT_EQ(e[i].offset % 256, 0u) << e[i].name;
    for (size_t j = i + 1; j < e.size(); ++j)
      if (e[i].life.overlaps(e[j].life)) {
        EXPECT_FALSE(overlap_bytes(e[i], e[j])) << i << " " << j;
      }
  }
  EXPECT_LT(p.total_bytes(), p.sum_bytes() + 20 * 256);
}

TEST(ArenaPlan, DeterministicOffsets) {
  auto make = [] {
    ArenaPlan p;
    for (int i = 0; i < 50; ++i)
      p.add("x" + std::to_string(i), (i * 7919) % 5000, "g", {i % 7, i % 7 + i % 3});
    p.plan();
    return p;
  };
  ArenaPlan a = make(), b = make();
  for (size_t i = 0; i < a.entries().size(); ++i)
    EXPECT_EQ(a.entries()[i].offset, b.entries()[i].offset);
}

TEST(ArenaPlan, OutOfMemoryNamesLargestConsumers) {
  ArenaPlan p;
  p.add("layer0.fc1.weight", size_t{3} << 30, "params");
  p.add("small", 1024, "params");
  p.plan();
  try {
    p.check_fits(size_t{1} << 30, "Test GPU");
    FAIL() << "no exception";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layer0.fc1.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("Test GPU"), std::string::npos) << m;
    EXPECT_NE(m.find("3.00 GiB"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(p.check_fits(size_t{4} << 30, "Test GPU"));
}

TEST(ArenaPlan, RejectsBadInput) {
  ArenaPlan p;
  EXPECT_THROW(p.add("bad", 10, "g", {5, 2}), Error);
  EXPECT_THROW(p.add("bad", 10, "g", {}, 3), Error);
  p.add("ok", 10);
  p.plan();
  EXPECT_THROW(p.add("late", 10), Error);
  EXPECT_NE(p.table().find("arena total"), std::string::npos);
}

}  // namespace
}  // namespace replay
