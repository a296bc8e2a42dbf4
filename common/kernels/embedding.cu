// embedding.cu: token + position embedding forward and its deterministic, atomic-free backward.
#include "common/kernels/embedding.h"

#include <cub/device/device_radix_sort.cuh>  // cub::DeviceRadixSort (stable, deterministic)

#include <climits>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // ceil_div, PackBF16, PackF32

namespace replay {
namespace {

constexpr int kForwardThreads = 256;
constexpr int kBackwardThreads = 128;  // one thread per 8 channels

void check_shape(const EmbeddingShape& s) {
  REPLAY_REQUIRE(s.batch > 0 && s.seq > 0 && s.channels > 0 && s.vocab_shard > 0,
                 "empty embedding shape");
  REPLAY_REQUIRE(s.channels % 8 == 0,
                 "channels must be a multiple of 8, got " + std::to_string(s.channels));
  REPLAY_REQUIRE(s.batch * s.seq < INT_MAX, "batch * seq must fit in int32");
  REPLAY_REQUIRE(s.vocab_shard < (int64_t{1} << 31) - 1, "vocab shard must fit in 31 bits");
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Radix-sort keys: the local token id, or vocab_shard for ids outside this rank's shard (sorted
// last and skipped). end_bit is the number of bits needed to hold vocab_shard.
int sort_end_bit(int64_t vocab_shard) {
  int bits = 1;
  while ((int64_t{1} << bits) <= vocab_shard) ++bits;
  return bits;
}

// The workspace in a fixed layout: keys in/out, values in/out, then CUB's temporary storage.
struct BackwardWorkspace {
  uint32_t* keys_in;
  uint32_t* keys_out;
  int32_t* rows_in;
  int32_t* rows_out;
  void* cub_temp;
  size_t cub_bytes;
};

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

size_t cub_temp_bytes(int n, int end_bit) {
  size_t bytes = 0;
  REPLAY_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, end_bit));
  return bytes;
}

BackwardWorkspace carve(void* base, size_t bytes, int n) {
  const size_t words = align256(static_cast<size_t>(n) * 4);
  char* p = static_cast<char*>(base);
  BackwardWorkspace w{};
  w.keys_in = reinterpret_cast<uint32_t*>(p);
  w.keys_out = reinterpret_cast<uint32_t*>(p + words);
  w.rows_in = reinterpret_cast<int32_t*>(p + 2 * words);
  w.rows_out = reinterpret_cast<int32_t*>(p + 3 * words);
  w.cub_temp = p + 4 * words;
  w.cub_bytes = bytes - 4 * words;
  return w;
}

// One thread per 8 channels of one (b, s) row.
__global__ void embedding_forward_kernel(__nv_bfloat16* __restrict__ out,
                                         const int32_t* __restrict__ tokens,
                                         const __nv_bfloat16* __restrict__ wte,
                                         const __nv_bfloat16* __restrict__ wpe, int64_t rows,
                                         int64_t seq, int64_t C, int64_t vocab_start,
                                         int64_t vocab_shard) {
  const int64_t packs_per_row = C / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * packs_per_row) return;
  const int64_t row = idx / packs_per_row;
  const int64_t c = (idx % packs_per_row) * 8;

  float acc[8] = {};
  const int64_t local = static_cast<int64_t>(tokens[row]) - vocab_start;
  if (local >= 0 && local < vocab_shard) {
    const PackBF16 w = PackBF16::load(wte + local * C + c);
    for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(w.v[k]);
  }
  if (wpe != nullptr) {
    const PackBF16 p = PackBF16::load(wpe + (row % seq) * C + c);
    for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(p.v[k]);
  }
  PackBF16 o;
  for (int k = 0; k < 8; ++k) o.v[k] = __float2bfloat16_rn(acc[k]);
  o.store(out + row * C + c);
}

// Sort keys and the flat row index b*seq + s each token came from (the sort's values).
__global__ void embedding_sort_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ rows,
                                           const int32_t* __restrict__ tokens, int n,
                                           int64_t vocab_start, int64_t vocab_shard) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t local = static_cast<int64_t>(tokens[i]) - vocab_start;
  keys[i] = static_cast<uint32_t>(local >= 0 && local < vocab_shard ? local : vocab_shard);
  rows[i] = i;
}

// Grid (sorted position i, channel block). Only the block at the first position of a run of equal
// keys works: it sums dout over the run's rows in sorted order, which a stable sort makes the
// increasing row order, and adds the sum into dwte. Every other block exits at once.
__global__ void embedding_wte_backward_kernel(float* __restrict__ dwte,
                                              const __nv_bfloat16* __restrict__ dout,
                                              const uint32_t* __restrict__ keys,
                                              const int32_t* __restrict__ rows, int n, int64_t C,
                                              uint32_t out_of_shard) {
  const int i = blockIdx.x;
  const uint32_t key = keys[i];
  if (key == out_of_shard || (i > 0 && keys[i - 1] == key)) return;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c >= C) return;
  int end = i + 1;
  while (end < n && keys[end] == key) ++end;

  float acc[8] = {};
#pragma unroll 4  // independent loads in flight; the sum order stays j = i, i + 1, ...
  for (int j = i; j < end; ++j) {
    const PackBF16 g = PackBF16::load(dout + static_cast<int64_t>(rows[j]) * C + c);
    for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(g.v[k]);
  }
  float* dst = dwte + static_cast<int64_t>(key) * C + c;
  PackF32 lo = PackF32::load(dst), hi = PackF32::load(dst + 4);
  for (int k = 0; k < 4; ++k) {
    lo.v[k] += acc[k];
    hi.v[k] += acc[k + 4];
  }
  lo.store(dst);
  hi.store(dst + 4);
}

// One thread per 8 channels of one position s: the sum over the batch in order b = 0, 1, ...
__global__ void embedding_wpe_backward_kernel(float* __restrict__ dwpe,
                                              const __nv_bfloat16* __restrict__ dout, int64_t batch,
                                              int64_t seq, int64_t C, bool accumulate) {
  const int64_t packs_per_row = C / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= seq * packs_per_row) return;
  const int64_t s = idx / packs_per_row;
  const int64_t c = (idx % packs_per_row) * 8;

  float acc[8] = {};
  for (int64_t b = 0; b < batch; ++b) {
    const PackBF16 g = PackBF16::load(dout + (b * seq + s) * C + c);
    for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(g.v[k]);
  }
  float* dst = dwpe + s * C + c;
  PackF32 lo, hi;
  for (int k = 0; k < 4; ++k) {
    lo.v[k] = acc[k];
    hi.v[k] = acc[k + 4];
  }
  if (accumulate) {
    const PackF32 old_lo = PackF32::load(dst), old_hi = PackF32::load(dst + 4);
    for (int k = 0; k < 4; ++k) {
      lo.v[k] = old_lo.v[k] + lo.v[k];
      hi.v[k] = old_hi.v[k] + hi.v[k];
    }
  }
  lo.store(dst);
  hi.store(dst + 4);
}

}  // namespace

void embedding_forward(__nv_bfloat16* out, const int32_t* tokens, const __nv_bfloat16* wte,
                       const __nv_bfloat16* wpe, const EmbeddingShape& shape, cudaStream_t stream) {
  check_shape(shape);
  REPLAY_REQUIRE(aligned16(out) && aligned16(wte) && aligned16(wpe),
                 "embedding tensors must be 16-byte aligned");
  const int64_t rows = shape.batch * shape.seq;
  const int64_t blocks = ceil_div<int64_t>(rows * shape.channels / 8, kForwardThreads);
  REPLAY_REQUIRE(blocks <= INT_MAX, "embedding forward grid too large");
  embedding_forward_kernel<<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
      out, tokens, wte, wpe, rows, shape.seq, shape.channels, shape.vocab_start, shape.vocab_shard);
  REPLAY_LAUNCH_CHECK();
}

size_t embedding_backward_workspace_bytes(const EmbeddingShape& shape) {
  check_shape(shape);
  const int n = static_cast<int>(shape.batch * shape.seq);
  return 4 * align256(static_cast<size_t>(n) * 4) +
         cub_temp_bytes(n, sort_end_bit(shape.vocab_shard));
}

void embedding_backward(float* dwte, float* dwpe, const __nv_bfloat16* dout, const int32_t* tokens,
                        const EmbeddingShape& shape, bool accumulate, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  check_shape(shape);
  REPLAY_REQUIRE(aligned16(dwte) && aligned16(dwpe) && aligned16(dout) && aligned16(workspace),
                 "embedding gradients, dout and workspace must be 16-byte aligned");
  const int n = static_cast<int>(shape.batch * shape.seq);
  const int end_bit = sort_end_bit(shape.vocab_shard);
  REPLAY_REQUIRE(workspace_bytes >= embedding_backward_workspace_bytes(shape),
                 "embedding backward workspace too small: " + std::to_string(workspace_bytes) +
                     " bytes given, query embedding_backward_workspace_bytes()");
  BackwardWorkspace w =
      carve(workspace, workspace_bytes, n);  // non-const: CUB takes the size by reference

  // Position table first: it reads dout only.
  if (dwpe != nullptr) {
    const int64_t blocks = ceil_div<int64_t>(shape.seq * shape.channels / 8, kForwardThreads);
    embedding_wpe_backward_kernel<<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
        dwpe, dout, shape.batch, shape.seq, shape.channels, accumulate);
    REPLAY_LAUNCH_CHECK();
  }

  // Token table: rows of tokens absent from the batch get no kernel work: overwrite = zero, add.
  if (!accumulate) {
    REPLAY_CUDA_CHECK(cudaMemsetAsync(
        dwte, 0, static_cast<size_t>(shape.vocab_shard * shape.channels) * sizeof(float), stream));
  }
  embedding_sort_keys_kernel<<<ceil_div(n, kForwardThreads), kForwardThreads, 0, stream>>>(
      w.keys_in, w.rows_in, tokens, n, shape.vocab_start, shape.vocab_shard);
  REPLAY_LAUNCH_CHECK();
  REPLAY_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.cub_temp, w.cub_bytes, w.keys_in, w.keys_out,
                                                    w.rows_in, w.rows_out, n, 0, end_bit, stream));
  const dim3 grid(static_cast<unsigned>(n),
                  static_cast<unsigned>(ceil_div<int64_t>(shape.channels / 8, kBackwardThreads)));
  embedding_wte_backward_kernel<<<grid, kBackwardThreads, 0, stream>>>(
      dwte, dout, w.keys_out, w.rows_out, n, shape.channels,
      static_cast<uint32_t>(shape.vocab_shard));
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay
