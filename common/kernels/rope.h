// rope.h: rotary position embedding (RoPE), forward and backward, on bf16 [B, S, H, D] tensors,
// with the fp32 cos/sin table built on the device at set-up (optionally with Llama 3.1 frequency
// scaling).
//
// Convention: rotate-half (GPT-NeoX / Megatron non-interleaved). Inside each head the rotated
// channels are [rope_offset, rope_offset + rope_dim); with h = rope_dim / 2 and channel i < h of
// that range paired with channel i + h:
//   out[i]     = x[i] * cos(pos * f_i) - x[i + h] * sin(pos * f_i)
//   out[i + h] = x[i + h] * cos(pos * f_i) + x[i] * sin(pos * f_i)
// with f_i = theta^(-2i / rope_dim), rescaled by RopeScaling when enabled. Channels outside the
// range pass through unchanged (DeepSeek MLA rotates only 64 of its 192 q/k channels). The backward
// is the rotation by the negative angle, which is the transpose (and inverse) of the forward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>  // float2

#include <cstdint>

namespace replay {

// Llama 3.1 frequency scaling (the published formula, with its defaults). With
// wavelen = 2 pi / f, low = original_max_position / low_freq_factor and
// high = original_max_position / high_freq_factor:
//   wavelen < high:  f unchanged
//   wavelen > low:   f / factor
//   otherwise:       (1 - s) f / factor + s f,
//                    s = (original_max_position / wavelen - low_freq_factor)
//                        / (high_freq_factor - low_freq_factor)
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;

  static RopeScaling llama31() {
    RopeScaling s;
    s.enabled = true;
    return s;
  }
};

// Where the rotation applies. x and out share this layout.
struct RopeLayout {
  int64_t batch = 0;
  int64_t seq = 0;
  int heads = 0;
  int head_dim = 0;
  int rope_dim = 0;     // rotated channels per head: a multiple of 16, <= head_dim - rope_offset
  int rope_offset = 0;  // first rotated channel inside a head: a multiple of 8
  int64_t token_stride = 0;  // elements from one token to the next; 0 means heads * head_dim. Lets
                             // one launch rotate the q and k heads inside a fused QKV output.
};

// table[pos * (rope_dim / 2) + i] = (cos(pos * f_i), sin(pos * f_i)) for pos < max_positions,
// computed in fp64 and stored as fp32. Launched once at set-up; theta is the base (10000, 500000).
void rope_build_table(float2* table, int max_positions, int rope_dim, double theta,
                      const RopeScaling& scaling, cudaStream_t stream);

// Rotates every head of every token. positions: int32 [batch * seq] in device memory, each in
// [0, max_positions) of the table (not checked: a device value), or null for pos = s (the index in
// the sequence). In place when out == x (only the rotated channels are touched); out of place, the
// other channels are copied. Every pointer 16-byte aligned; head_dim and token_stride multiples
// of 8.
void rope_forward(__nv_bfloat16* out, const __nv_bfloat16* x, const float2* table,
                  int max_positions, const int32_t* positions, const RopeLayout& layout,
                  cudaStream_t stream);

// dx = rotation of dout by the negative angle. Same layout rules as the forward.
void rope_backward(__nv_bfloat16* dx, const __nv_bfloat16* dout, const float2* table,
                   int max_positions, const int32_t* positions, const RopeLayout& layout,
                   cudaStream_t stream);

}  // namespace replay
