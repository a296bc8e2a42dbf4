// Copy structures at 2 x 50 MB (2048 x 12288 bf16 in, same out) in the suite's stream protocol: graphs of 24 calls
// over 3 buffer sets, median of 12 launches, us a call. Reference: cudaMemcpyAsync.
#include <cuda_runtime.h>
#include <cstdio>
#include <functional>
#include <vector>
#include "stream.cuh"
__device__ __forceinline__ uint4 ld_cs(const uint4* p) { uint4 v; asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v; }
__device__ __forceinline__ uint4 ld_nc(const uint4* p) { uint4 v; asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v; }
__device__ __forceinline__ void st_cs(uint4* p, uint4 v) { asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
__device__ __forceinline__ void pdl() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); asm volatile("griddepcontrol.wait;" ::: "memory"); }
// LD: 0 plain, 1 .cs, 2 .nc; ST: 0 plain, 1 .cs; U packs a thread, loads before stores; grid covers n exactly when GS == 0.
template <int LD, int ST, int U, bool GS, bool PDL>
__global__ void __launch_bounds__(256) copy_k(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  if (PDL) pdl();
  const size_t stride = (size_t)gridDim.x * blockDim.x * U;
  for (size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; base < n; base += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t i = base + (size_t)u * blockDim.x; if (i < n) v[u] = LD == 0 ? src[i] : LD == 1 ? ld_cs(src + i) : ld_nc(src + i); }
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t i = base + (size_t)u * blockDim.x; if (i < n) { if (ST) st_cs(dst + i, v[u]); else dst[i] = v[u]; } }
    if (!GS) break;
  }
}
template <typename T> T* dalloc(size_t n) { void* p; CK(cudaMalloc(&p, n * sizeof(T))); return (T*)p; }
int main() {
  cudaStream_t S; CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t bytes = 2048ull * 12288 * 2, n = bytes / 16;
  uint4 *a[3], *b[3];
  for (int k = 0; k < 3; ++k) { a[k] = dalloc<uint4>(n); b[k] = dalloc<uint4>(n); CK(cudaMemset(a[k], k + 1, bytes)); }
  auto time = [&](std::function<void(int)> call) { return stream_us(S, call); };
  auto launch = [&](auto kern, unsigned grid, bool pdl_attr) {
    return [=](int k) {
      cudaLaunchAttribute at{}; at.id = cudaLaunchAttributeProgrammaticStreamSerialization; at.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t c{}; c.gridDim = grid; c.blockDim = 256; c.stream = S; c.attrs = &at; c.numAttrs = pdl_attr ? 1 : 0;
      CK(cudaLaunchKernelEx(&c, kern, b[k], (const uint4*)a[k], n));
    };
  };
  struct V { const char* name; std::function<void(int)> f; };
  const unsigned exact1 = n / 256, exact4 = n / 1024, exact8 = n / 2048;
  std::vector<V> vs = {
    {"cudaMemcpyAsync", [&](int k) { CK(cudaMemcpyAsync(b[k], a[k], bytes, cudaMemcpyDeviceToDevice, S)); }},
    {"gridstride 8/SM ld.cs U1", launch(copy_k<1, 0, 1, true, false>, sms * 8, false)},
    {"gridstride 8/SM ld.cs U1 pdl", launch(copy_k<1, 0, 1, true, true>, sms * 8, true)},
    {"exact U1 plain", launch(copy_k<0, 0, 1, false, false>, exact1, false)},
    {"exact U1 plain pdl", launch(copy_k<0, 0, 1, false, true>, exact1, true)},
    {"exact U1 ld.cs pdl", launch(copy_k<1, 0, 1, false, true>, exact1, true)},
    {"exact U1 ld.cs st.cs pdl", launch(copy_k<1, 1, 1, false, true>, exact1, true)},
    {"exact U1 ld.nc pdl", launch(copy_k<2, 0, 1, false, true>, exact1, true)},
    {"exact U4 plain pdl", launch(copy_k<0, 0, 4, false, true>, exact4, true)},
    {"exact U4 ld.cs pdl", launch(copy_k<1, 0, 4, false, true>, exact4, true)},
    {"exact U4 ld.cs st.cs pdl", launch(copy_k<1, 1, 4, false, true>, exact4, true)},
    {"exact U8 ld.cs pdl", launch(copy_k<1, 0, 8, false, true>, exact8, true)},
    {"gridstride 8/SM U4 ld.cs pdl", launch(copy_k<1, 0, 4, true, true>, sms * 8, true)},
    {"gridstride 4/SM U8 ld.cs pdl", launch(copy_k<1, 0, 8, true, true>, sms * 4, true)},
  };
  std::printf("%.1f MB moved a call; copy-rate time at 4245 GB/s: %.2f us\n", 2.0 * bytes / 1e6, 2.0 * bytes / 4245e3);
  std::vector<std::vector<double>> res(vs.size());
  for (int round = 0; round < 3; ++round) for (size_t i = 0; i < vs.size(); ++i) res[i].push_back(time(vs[i].f));
  for (size_t i = 0; i < vs.size(); ++i) std::printf("%-32s %7.2f %7.2f %7.2f us\n", vs[i].name, res[i][0], res[i][1], res[i][2]);
  return 0;
}
