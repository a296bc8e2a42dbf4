// splitmix.h: splitmix64, the small platform-independent generator behind replay's synthetic data
// and batch order (the std:: distributions differ between standard libraries, so they are not
// used).
#pragma once

#include <cstdint>

namespace replay::data {

inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's finalizer: a bijective mix of 64 bits.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The next draw of the generator whose state is `state`.
inline uint64_t splitmix(uint64_t& state) {
  return mix64(state += kGolden);
}

}  // namespace replay::data
