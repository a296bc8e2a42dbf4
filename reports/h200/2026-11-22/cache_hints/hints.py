# make_hint2.py KIND SRC OUT: dropout.cu (KIND=dropout) or cross_entropy.cu (KIND=ce) with the row data's 16-byte
# loads through ld_h (-DLDH: 0 plain, 1 __ldcs, 2 __ldcg, 3 __ldlu, 4 __ldg) and its 16-byte stores through st_h
# (-DSTH: 0 plain, 1 __stcs, 2 __stcg, 3 __stwb). Intrinsics, not asm volatile, so the compiler schedules them freely.
import re, sys
kind, path, out = sys.argv[1:4]
src = open(path).read()
pre = r'''
#ifndef LDH
#define LDH 1
#endif
#ifndef STH
#define STH 0
#endif
namespace replay { namespace {
template <typename V>
__device__ __forceinline__ V ld_h4(const V* p) {
#if LDH == 0
  return *p;
#elif LDH == 1
  return __ldcs(p);
#elif LDH == 2
  return __ldcg(p);
#elif LDH == 3
  return __ldlu(p);
#else
  return __ldg(p);
#endif
}
template <typename T>
__device__ __forceinline__ Pack128<T> ld_h(const T* p) {
  Pack128<T> r;
  *reinterpret_cast<int4*>(r.v) = ld_h4(reinterpret_cast<const int4*>(p));
  return r;
}
template <typename T, typename P>
__device__ __forceinline__ void st_h(T* p, const P& o) {
  const int4 v = *reinterpret_cast<const int4*>(o.v);
  int4* d = reinterpret_cast<int4*>(p);
#if STH == 0
  *d = v;
#elif STH == 1
  __stcs(d, v);
#elif STH == 2
  __stcg(d, v);
#else
  __stwb(d, v);
#endif
}
} }
'''
if kind == "dropout":
    anchor = '#include "common/kernels/dependent_launch.cuh"\n'
    src = src.replace(anchor, anchor + pre, 1)
    n1 = src.count("PackBF16::load_cs(")
    src = src.replace("PackBF16::load_cs(", "ld_h(")
    src, n2 = re.subn(r"o\.store\(([^;]*)\);", r"st_h(\1, o);", src)
else:
    anchor = "namespace replay {\nnamespace {\n"
    i = src.index(anchor)
    src = src[:i] + pre + src[i:]
    n1 = src.count("__ldcs(")
    src = src.replace("__ldcs(reinterpret_cast<const uint4*>(p))", "ld_h4(reinterpret_cast<const uint4*>(p))").replace("__ldcs(body + p)", "ld_h4(body + p)")
    n2 = src.count("g.store(dst + u * kRowThreads * 8);")
    src = src.replace("g.store(dst + u * kRowThreads * 8);", "st_h(dst + u * kRowThreads * 8, g);")
    assert src.count("__ldcs(") == 1
print(out, n1, "loads,", n2, "stores", file=sys.stderr)
open(out, "w").write(src)
