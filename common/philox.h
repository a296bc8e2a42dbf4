// philox.h: counter-based Philox4x32-10 (Salmon et al., SC'11), identical on host and device, and
// the device-resident RNG slot every random op reads. Stateless: a draw depends only on (seed,
// counter), so eager and graphed launches of the same kernel draw the same numbers.
//
// Counter layout used by every replay op: {block_lo, block_hi, position_lo, position_hi}, where
// block indexes groups of four numbers inside one op and position = slot->offset + op_offset. The
// graph layer assigns each random op a distinct op_offset when the plan is built and advances
// slot->offset once per step from a captured kernel, so every step (and every replay) draws fresh
// numbers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define REPLAY_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define REPLAY_HOST_DEVICE inline
#endif

namespace replay {

// One RNG stream's device-resident state. 16 bytes: snapshot and restore is one copy.
struct PhiloxSlot {
  uint64_t seed;
  uint64_t offset;
};

// What a random op receives: the slot (read on the device at run time, never by value) and the op's
// fixed offset inside the step.
struct RngArgs {
  const PhiloxSlot* slot = nullptr;
  uint64_t op_offset = 0;
};

struct Philox4 {
  uint32_t x, y, z, w;
};

// 32x32 -> 64-bit product as (hi, lo). On the device __umulhi plus a low multiply compile to one
// IMAD.WIDE each, where the 64-bit product leaves an extra integer add per product in the SASS.
REPLAY_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

// Philox4x32 with 10 rounds, as in Random123 (philox4x32_R(10, ...)).
REPLAY_HOST_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c.x, hi0, lo0);
    philox_mulhilo(kM1, c.z, hi1, lo1);
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// Four numbers for (seed, position, block).
REPLAY_HOST_DEVICE Philox4 philox_block(uint64_t seed, uint64_t position, uint64_t block) {
  return philox4x32_10(
      Philox4{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
              static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32)},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

#if defined(__CUDACC__)
// One (seed, position) stream for a whole launch: the key schedule is expanded once (uniform across
// the grid, it lives in uniform registers), so draw(block) costs only the rounds. draw(block)
// returns exactly philox_block(seed, position, block).
struct PhiloxStream {
  uint32_t k0[10], k1[10];
  uint32_t pos_lo, pos_hi;

  __device__ __forceinline__ PhiloxStream(uint64_t seed, uint64_t position)
      : pos_lo(static_cast<uint32_t>(position)), pos_hi(static_cast<uint32_t>(position >> 32)) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
      k0[r] = static_cast<uint32_t>(seed) + r * 0x9E3779B9u;
      k1[r] = static_cast<uint32_t>(seed >> 32) + r * 0xBB67AE85u;
    }
  }

  __device__ __forceinline__ Philox4 draw(uint64_t block) const {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
    Philox4 c{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), pos_lo, pos_hi};
#pragma unroll
    for (int r = 0; r < 10; ++r) {
      uint32_t hi0, lo0, hi1, lo1;
      philox_mulhilo(kM0, c.x, hi0, lo0);
      philox_mulhilo(kM1, c.z, hi1, lo1);
      c = Philox4{hi1 ^ c.y ^ k0[r], lo1, hi0 ^ c.w ^ k1[r], lo0};
    }
    return c;
  }
};
#endif

// Uniform float in (0, 1] from 32 random bits (never 0, so log() is safe).
REPLAY_HOST_DEVICE float philox_uniform(uint32_t bits) {
  return static_cast<float>(bits) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
}

}  // namespace replay
