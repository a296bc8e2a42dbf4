// found_inf.cu: the found-inf kernel: one block per chunk, 16-byte streaming loads, one flag.
#include "common/optim/found_inf.h"

#include "common/check.h"

namespace replay {

namespace {

constexpr int kFoundInfThreads = 256;

// All-ones exponent: Inf or NaN. Masks for one element, and for two 16-bit elements in a 32-bit
// word.
__device__ __forceinline__ bool nonfinite32(uint32_t w) {
  return (w & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool nonfinite16(uint32_t h, uint32_t exp_mask) {
  return (h & exp_mask) == exp_mask;
}
__device__ __forceinline__ bool nonfinite_word(uint32_t w, bool fp32, uint32_t exp_mask16) {
  if (fp32) return nonfinite32(w);
  return nonfinite16(w & 0xffffu, exp_mask16) || nonfinite16(w >> 16, exp_mask16);
}

// One block per chunk; every block reads its chunk with 16-byte loads where aligned, then the tail.
__global__ void __launch_bounds__(kFoundInfThreads)
    found_inf_kernel(FoundInfTable table, int32_t* __restrict__ found_inf) {
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const FoundInfTensor t = table.tensors[chunk.tensor];
  const bool fp32 = t.dtype == static_cast<int32_t>(DType::kFP32);
  const uint32_t exp_mask16 = t.dtype == static_cast<int32_t>(DType::kBF16) ? 0x7f80u : 0x7c00u;
  const int64_t esize = fp32 ? 4 : 2;
  const char* base = static_cast<const char*>(t.data) + chunk.start * esize;
  const int64_t bytes = static_cast<int64_t>(chunk.length) * esize;
  const int64_t vec_bytes = reinterpret_cast<uintptr_t>(base) % 16 == 0 ? bytes / 16 * 16 : 0;
  bool bad = false;
  for (int64_t off = 16 * static_cast<int64_t>(threadIdx.x); off < vec_bytes;
       off += 16 * kFoundInfThreads) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(base + off));
    bad |= nonfinite_word(v.x, fp32, exp_mask16) | nonfinite_word(v.y, fp32, exp_mask16) |
           nonfinite_word(v.z, fp32, exp_mask16) | nonfinite_word(v.w, fp32, exp_mask16);
  }
  for (int64_t i = vec_bytes / esize + threadIdx.x; i < chunk.length; i += kFoundInfThreads) {
    bad |= fp32 ? nonfinite32(reinterpret_cast<const uint32_t*>(base)[i])
                : nonfinite16(reinterpret_cast<const uint16_t*>(base)[i], exp_mask16);
  }
  // Every writer stores the same value, so the result does not depend on which block wins.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1;
}

}  // namespace

void FoundInfTableBuilder::add(const TensorView& tensor) {
  REPLAY_REQUIRE(
      tensor.dtype == DType::kBF16 || tensor.dtype == DType::kFP16 || tensor.dtype == DType::kFP32,
      std::string("found-inf checks bf16, fp16 or fp32 tensors, got ") + dtype_name(tensor.dtype));
  REPLAY_REQUIRE(tensor.is_contiguous(), "found-inf tensors must be contiguous");
  REPLAY_REQUIRE(tensor.data != nullptr &&
                     reinterpret_cast<uintptr_t>(tensor.data) % dtype_size(tensor.dtype) == 0,
                 "found-inf tensors must be non-null and aligned to their element size");
  builder_.add(FoundInfTensor{tensor.data, tensor.numel(), static_cast<int32_t>(tensor.dtype), 0});
}

void check_found_inf(const FoundInfTable& table, int32_t* found_inf, cudaStream_t stream) {
  REPLAY_REQUIRE(table.tensors != nullptr && table.num_chunks > 0, "found-inf table not built");
  REPLAY_REQUIRE(found_inf != nullptr, "found-inf flag must be given");
  found_inf_kernel<<<static_cast<unsigned>(table.num_chunks), kFoundInfThreads, 0, stream>>>(
      table, found_inf);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
