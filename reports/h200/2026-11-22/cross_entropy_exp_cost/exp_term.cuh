// EXP_MODE 0: ex2.approx for every logit (the tree). 1: no exp at all (x itself; wrong results,
// measures what the special-function pipe costs). 2, 3, 4: a polynomial 2^x on the FMA pipe for
// one logit in 4, in 8, in 2 (the rest ex2.approx).
#pragma once
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -126.0f);
  const float t = x + 12582912.0f;  // 1.5 * 2^23: rounds x to an integer j in t's low bits
  const float f = x - (t - 12582912.0f);  // [-0.5, 0.5]
  const int j = __float_as_int(t) - 0x4B400000;
  float p = 1.54035304e-4f;
  p = fmaf(p, f, 1.33335581e-3f);
  p = fmaf(p, f, 9.61812911e-3f);
  p = fmaf(p, f, 5.55041087e-2f);
  p = fmaf(p, f, 2.40226507e-1f);
  p = fmaf(p, f, 6.93147181e-1f);
  p = fmaf(p, f, 1.0f);
  return __int_as_float(__float_as_int(p) + (j << 23));
}
#define EXP_ARG(x, ml) fmaf((x), 1.4426950408889634f, -(ml))
#if EXP_MODE == 0
#define EXP_TERM(x, ml, k) exp2_approx(EXP_ARG(x, ml))
#elif EXP_MODE == 1
#define EXP_TERM(x, ml, k) EXP_ARG(x, ml)
#elif EXP_MODE == 2
#define EXP_TERM(x, ml, k) ((k) % 4 == 3 ? exp2_poly(EXP_ARG(x, ml)) : exp2_approx(EXP_ARG(x, ml)))
#elif EXP_MODE == 3
#define EXP_TERM(x, ml, k) ((k) % 8 == 7 ? exp2_poly(EXP_ARG(x, ml)) : exp2_approx(EXP_ARG(x, ml)))
#else
#define EXP_TERM(x, ml, k) ((k) % 2 == 1 ? exp2_poly(EXP_ARG(x, ml)) : exp2_approx(EXP_ARG(x, ml)))
#endif
