import sys
src = open(sys.argv[1]).read()
old_start = src.index("  // Keep bits of the 8 elements e0")
old_end = src.index("\n};\n", old_start) + 1
new = '''  // Keep bits of the 8 elements e0 .. e0 + 7 from one draw: 16 random bits an element.
  __device__ __forceinline__ uint32_t keep_bits(int64_t e0, uint32_t threshold) const {
    const Philox4 r = draw(static_cast<uint64_t>(e0) / 8);
    const uint32_t t16 = threshold >> 16, t2 = t16 | (t16 << 16);
    const uint32_t m0 = __vcmpgeu2(r.x, t2), m1 = __vcmpgeu2(r.y, t2), m2 = __vcmpgeu2(r.z, t2),
                   m3 = __vcmpgeu2(r.w, t2);
    // each m is 0xffff per kept half; gather one bit per half
    uint32_t bits = (m0 & 1u) | ((m0 >> 15) & 2u) | ((m1 & 1u) << 2) | ((m1 >> 13) & 8u) |
                    ((m2 & 1u) << 4) | ((m2 >> 11) & 32u) | ((m3 & 1u) << 6) | ((m3 >> 9) & 128u);
    return bits;
  }
'''
src = src[:old_start] + new + src[old_end:]
open(sys.argv[2], "w").write(src)
