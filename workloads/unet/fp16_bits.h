// fp16_bits.h: IEEE binary16 on the host as raw bits (uint16_t), for the UNet's data files
// (latent_file.h) and their generator: float -> fp16 with round-to-nearest-even, fp16 -> float
// exactly. Header-only and free of CUDA headers, so the data code builds and tests without a GPU
// toolkit in the include path; the results equal cuda_fp16.h's __float2half_rn and __half2float
// (tests/workloads/unet/test_diffusion_ref.cpp compares every fp16 value and many floats).
#pragma once

#include <cstdint>
#include <cstring>

namespace replay::unet {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; overflow (|f| >= 65520) gives infinity, NaN stays a (quiet) NaN.
inline uint16_t float_to_half_bits(float f) {
  constexpr uint32_t kF32Inf = 255u << 23;
  constexpr uint32_t kF16Overflow = (127u + 16u) << 23;  // 2^16: at or above, the result is inf
  // Adding 0.5 (as a float with this exponent) to a value below 2^-14 leaves the fp16 subnormal's
  // bits in the low mantissa bits, rounded to nearest even by the float addition itself.
  constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t h;
  if (u >= kF16Overflow) {
    h = u > kF32Inf ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // below 2^-14: subnormal or zero
    h = static_cast<uint16_t>(float_bits(bits_float(u) + bits_float(kDenormMagic)) - kDenormMagic);
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;  // rebias, and round half up ...
    u += mantissa_odd;                                      // ... or half to even
    h = static_cast<uint16_t>(u >> 13);  // a carry into the exponent is the correct rounding
  }
  return static_cast<uint16_t>(h | (sign >> 16));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline bool half_bits_finite(uint16_t h) {
  return (h & 0x7c00u) != 0x7c00u;
}

}  // namespace replay::unet
