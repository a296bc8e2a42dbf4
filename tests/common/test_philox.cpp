// Philox4x32-10 against the Random123 known-answer vectors, and the counter layout's properties.
#include "common/philox.h"

#include <gtest/gtest.h>

#include <set>

namespace replay {
namespace {

struct Kat {
  Philox4 ctr;
  uint32_t k0, k1;
  Philox4 expected;
};

TEST(Philox, KnownAnswerVectors) {
  // From Random123's kat_vectors (philox4x32, 10 rounds).
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       0xffffffffu,
       0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       0xa4093822u,
       0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    Philox4 r = philox4x32_10(k.ctr, k.k0, k.k1);
    EXPECT_EQ(r.x, k.expected.x);
    EXPECT_EQ(r.y, k.expected.y);
    EXPECT_EQ(r.z, k.expected.z);
    EXPECT_EQ(r.w, k.expected.w);
  }
}

TEST(Philox, PositionsAndBlocksGiveDistinctStreams) {
  std::set<uint32_t> seen;
  for (uint64_t pos = 0; pos < 4; ++pos)
    for (uint64_t block = 0; block < 64; ++block) seen.insert(philox_block(42, pos, block).x);
  EXPECT_EQ(seen.size(), 4u * 64u);
  EXPECT_NE(philox_block(1, 0, 0).x, philox_block(2, 0, 0).x);
}

TEST(Philox, UniformIsInOpenZeroClosedOne) {
  EXPECT_GT(philox_uniform(0u), 0.0f);
  EXPECT_LE(philox_uniform(0xffffffffu), 1.0f);
  double sum = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) sum += philox_uniform(philox_block(7, 0, i / 4).x);
  EXPECT_NEAR(sum / n, 0.5, 0.01);
}

}  // namespace
}  // namespace replay
