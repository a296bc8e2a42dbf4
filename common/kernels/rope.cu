// rope.cu: RoPE table construction and rotation kernels (see rope.h for the convention).
#include "common/kernels/rope.h"

#include <cstdint>

#include "common/check.h"
#include "common/device_utils.cuh"
#include "common/kernels/dependent_launch.cuh"

namespace replay {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;

// f_i = theta^(-2i / rope_dim), then the Llama 3.1 rescaling; all in fp64 (set-up cost only).
__global__ void rope_table_kernel(float2* table, int max_positions, int rope_dim, double theta,
                                  RopeScaling s) {
  const int half = rope_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(max_positions) * half) return;
  const int i = static_cast<int>(idx % half);
  const int64_t pos = idx / half;
  double f = 1.0 / pow(theta, 2.0 * i / rope_dim);
  if (s.enabled) {
    const double wavelen = 2.0 * 3.14159265358979323846 / f;
    const double low_wavelen = s.original_max_position / s.low_freq_factor;
    const double high_wavelen = s.original_max_position / s.high_freq_factor;
    if (wavelen > low_wavelen) {
      f = f / s.factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / s.factor + smooth * f;
    }
  }
  double sn, cs;
  sincos(static_cast<double>(pos) * f, &sn, &cs);
  table[idx] = make_float2(static_cast<float>(cs), static_cast<float>(sn));
}

// One thread per unit of a head: units [0, rope_dim / 16) each rotate 8 channel pairs (i, i + h);
// out of place, the units after them each copy one 16-byte pack of pass-through channels.
__global__ void rope_kernel(bf16* out, const bf16* x, const float2* __restrict__ table,
                            const int32_t* __restrict__ positions, int64_t total, int64_t seq,
                            int heads, int head_dim, int rope_dim, int rope_offset,
                            int64_t token_stride, int units_per_head, float sin_sign) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int u = static_cast<int>(idx % units_per_head);
  const int64_t token_head = idx / units_per_head;
  const int h = static_cast<int>(token_head % heads);
  const int64_t token = token_head / heads;
  const int64_t base = token * token_stride + static_cast<int64_t>(h) * head_dim;
  const int half = rope_dim / 2;

  if (u < half / 8) {
    const int64_t pos = positions ? positions[token] : token % seq;
    const int i0 = u * 8;
    const int64_t lo = base + rope_offset + i0, hi = lo + half;
    const PackBF16 a = PackBF16::load(x + lo), b = PackBF16::load(x + hi);
    const float4* cs = reinterpret_cast<const float4*>(table + pos * half + i0);
    PackBF16 oa, ob;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 c = cs[q];  // (cos, sin) of pairs 2q and 2q + 1
      const float cj[2] = {c.x, c.z}, sj[2] = {sin_sign * c.y, sin_sign * c.w};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = 2 * q + r;
        const float xa = __bfloat162float(a.v[j]), xb = __bfloat162float(b.v[j]);
        oa.v[j] = __float2bfloat16_rn(xa * cj[r] - xb * sj[r]);
        ob.v[j] = __float2bfloat16_rn(xb * cj[r] + xa * sj[r]);
      }
    }
    oa.store(out + lo);
    ob.store(out + hi);
  } else {
    const int c = (u - half / 8) * 8;
    const int64_t off = base + (c < rope_offset ? c : c + rope_dim);
    PackBF16::load(x + off).store(out + off);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void rope_apply(bf16* out, const bf16* x, const float2* table, int max_positions,
                const int32_t* positions, const RopeLayout& l, float sin_sign,
                cudaStream_t stream) {
  REPLAY_REQUIRE(l.batch >= 1 && l.seq >= 1 && l.heads >= 1, "rope needs a non-empty tensor");
  REPLAY_REQUIRE(l.head_dim % 8 == 0 && l.rope_offset % 8 == 0 && l.rope_offset >= 0,
                 "rope head_dim and rope_offset must be multiples of 8");
  REPLAY_REQUIRE(
      l.rope_dim >= 16 && l.rope_dim % 16 == 0 && l.rope_offset + l.rope_dim <= l.head_dim,
      "rope_dim must be a multiple of 16 that fits in the head after rope_offset");
  const int64_t token_stride =
      l.token_stride ? l.token_stride : static_cast<int64_t>(l.heads) * l.head_dim;
  REPLAY_REQUIRE(
      token_stride % 8 == 0 && token_stride >= static_cast<int64_t>(l.heads) * l.head_dim,
      "rope token_stride must be a multiple of 8 covering all heads");
  REPLAY_REQUIRE(positions != nullptr || l.seq <= max_positions,
                 "rope table has fewer positions than the sequence");
  REPLAY_REQUIRE(aligned16(out) && aligned16(x) && aligned16(table) && table != nullptr,
                 "rope tensors and table must be 16-byte aligned");
  const int units = l.rope_dim / 16 + (out != x ? (l.head_dim - l.rope_dim) / 8 : 0);
  const int64_t total = l.batch * l.seq * l.heads * units;
  const int64_t blocks = ceil_div<int64_t>(total, kThreads);
  REPLAY_REQUIRE(blocks <= INT32_MAX, "rope tensor too large for a 1-D grid");
  launch_dependent(rope_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, out, x,
                   table, positions, total, l.seq, l.heads, l.head_dim, l.rope_dim, l.rope_offset,
                   token_stride, units, sin_sign);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace

void rope_build_table(float2* table, int max_positions, int rope_dim, double theta,
                      const RopeScaling& scaling, cudaStream_t stream) {
  REPLAY_REQUIRE(max_positions >= 1 && rope_dim >= 2 && rope_dim % 2 == 0,
                 "rope table needs positions and an even rope_dim");
  REPLAY_REQUIRE(theta > 1.0, "rope theta must be > 1");
  REPLAY_REQUIRE(!scaling.enabled || (scaling.factor > 0 && scaling.low_freq_factor > 0 &&
                                      scaling.high_freq_factor > scaling.low_freq_factor),
                 "rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0");
  const int64_t n = static_cast<int64_t>(max_positions) * (rope_dim / 2);
  rope_table_kernel<<<static_cast<unsigned>(ceil_div<int64_t>(n, kThreads)), kThreads, 0, stream>>>(
      table, max_positions, rope_dim, theta, scaling);
  REPLAY_LAUNCH_CHECK();
}

void rope_forward(bf16* out, const bf16* x, const float2* table, int max_positions,
                  const int32_t* positions, const RopeLayout& layout, cudaStream_t stream) {
  rope_apply(out, x, table, max_positions, positions, layout, 1.0f, stream);
}

void rope_backward(bf16* dx, const bf16* dout, const float2* table, int max_positions,
                   const int32_t* positions, const RopeLayout& layout, cudaStream_t stream) {
  rope_apply(dx, dout, table, max_positions, positions, layout, -1.0f, stream);
}

}  // namespace replay
