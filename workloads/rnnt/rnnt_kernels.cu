// rnnt_kernels.cu: the RNN-T model's hand kernels (rnnt_kernels.h).
#include "workloads/rnnt/rnnt_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/check.h"
#include "common/kernels/dropout.h"  // dropout_threshold

namespace replay::rnnt {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t n, int64_t per_block = kThreads) {
  return std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block, 1 << 20));
}

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Keep decision of element e of an op (dropout.h's rule); threshold 0 keeps everything and reads
// no RNG state.
__device__ __forceinline__ bool keep(const PhiloxSlot* slot, uint64_t op_offset, uint32_t threshold,
                                     int64_t e) {
  if (threshold == 0) return true;
  const PhiloxSlot s = *slot;
  const Philox4 r = philox_block(s.seed, s.offset + op_offset, static_cast<uint64_t>(e) / 4);
  const uint32_t words[4] = {r.x, r.y, r.z, r.w};
  return words[e % 4] >= threshold;
}

__global__ void fill_int32_kernel(int32_t* dst, int32_t value, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}

template <typename T>
__global__ void cast_to_fp32_kernel(float* dst, const T* src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = to_f(src[i]);
}

template <typename T>
__global__ void cast_from_fp32_kernel(T* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_f<T>(src[i]);
}

template <typename T>
__global__ void one_hot_kernel(T* out, const int32_t* tokens, int64_t rows, int64_t vocab) {
  const int64_t n = rows * vocab;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vocab, v = i % vocab;
    const int64_t tok = min(max(static_cast<int64_t>(tokens[r]), int64_t{0}), vocab - 1);
    out[i] = from_f<T>(v == tok ? 1.0f : 0.0f);
  }
}

template <typename T>
__global__ void dropout_kernel(T* out, const T* x, int64_t n, uint32_t threshold, float scale,
                               const PhiloxSlot* slot, uint64_t op_offset) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = to_f(x[i]);
    out[i] = from_f<T>(keep(slot, op_offset, threshold, i) ? v * scale : 0.0f);
  }
}

template <typename T>
__global__ void joint_forward_kernel(T* h, const T* enc, const T* pred, int64_t B, int64_t Tn,
                                     int64_t P, int64_t J, uint32_t threshold, float scale,
                                     const PhiloxSlot* slot, uint64_t op_offset) {
  const int64_t n = B * Tn * P * J;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e % J, row = e / J;
    const int64_t u = row % P, bt = row / P, b = bt / Tn;
    const float s = to_f(enc[bt * J + j]) + to_f(pred[(b * P + u) * J + j]);
    const float r = s > 0.0f ? s : 0.0f;
    h[e] = from_f<T>(keep(slot, op_offset, threshold, e) ? r * scale : 0.0f);
  }
}

// g of element (b, t, u, j): dh * mask * scale * relu'(enc + pred).
template <typename T>
__device__ __forceinline__ float joint_grad(const T* dh, const T* enc, const T* pred, int64_t b,
                                            int64_t t, int64_t u, int64_t j, int64_t Tn, int64_t P,
                                            int64_t J, uint32_t threshold, float scale,
                                            const PhiloxSlot* slot, uint64_t op_offset) {
  const int64_t bt = b * Tn + t;
  const float s = to_f(enc[bt * J + j]) + to_f(pred[(b * P + u) * J + j]);
  if (!(s > 0.0f)) return 0.0f;
  const int64_t e = (bt * P + u) * J + j;
  if (!keep(slot, op_offset, threshold, e)) return 0.0f;
  return to_f(dh[e]) * scale;
}

// One thread per (b, t, j): the sum over u.
template <typename T>
__global__ void joint_backward_enc_kernel(T* denc, const T* dh, const T* enc, const T* pred,
                                          int64_t B, int64_t Tn, int64_t P, int64_t J,
                                          uint32_t threshold, float scale, const PhiloxSlot* slot,
                                          uint64_t op_offset) {
  const int64_t n = B * Tn * J;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % J, bt = i / J, t = bt % Tn, b = bt / Tn;
    float acc = 0.0f;
    for (int64_t u = 0; u < P; ++u)
      acc += joint_grad(dh, enc, pred, b, t, u, j, Tn, P, J, threshold, scale, slot, op_offset);
    denc[i] = from_f<T>(acc);
  }
}

// One thread per (b, u, j): the sum over t.
template <typename T>
__global__ void joint_backward_pred_kernel(T* dpred, const T* dh, const T* enc, const T* pred,
                                           int64_t B, int64_t Tn, int64_t P, int64_t J,
                                           uint32_t threshold, float scale, const PhiloxSlot* slot,
                                           uint64_t op_offset) {
  const int64_t n = B * P * J;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % J, bu = i / J, u = bu % P, b = bu / P;
    float acc = 0.0f;
    for (int64_t t = 0; t < Tn; ++t)
      acc += joint_grad(dh, enc, pred, b, t, u, j, Tn, P, J, threshold, scale, slot, op_offset);
    dpred[i] = from_f<T>(acc);
  }
}

void require_16bit(DType type, const char* op) {
  REPLAY_REQUIRE(type == DType::kFP16 || type == DType::kBF16,
                 std::string(op) + ": the tensors must be fp16 or bf16, not " + dtype_name(type));
}

uint32_t threshold_of(float p, RngArgs rng, const char* op) {
  REPLAY_REQUIRE(p >= 0.0f && p < 1.0f, std::string(op) + ": dropout p must be in [0, 1)");
  const uint32_t threshold = dropout_threshold(p);
  REPLAY_REQUIRE(threshold == 0 || rng.slot != nullptr,
                 std::string(op) + ": dropout p > 0 needs an RNG slot");
  return threshold;
}

// Calls f(T{}) with T the 16-bit type of `type`.
template <typename F>
void dispatch16(DType type, const char* op, F&& f) {
  require_16bit(type, op);
  if (type == DType::kFP16) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

}  // namespace

void fill_int32(int32_t* dst, int32_t value, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(dst != nullptr && n >= 0, "fill_int32: null destination or negative count");
  if (n == 0) return;
  fill_int32_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, value, n);
  REPLAY_LAUNCH_CHECK();
}

void cast_to_fp32(float* dst, const void* src, DType src_type, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(dst != nullptr && src != nullptr && n >= 0, "cast_to_fp32: null pointer");
  if (n == 0) return;
  dispatch16(src_type, "cast_to_fp32", [&](auto tag) {
    using T = decltype(tag);
    cast_to_fp32_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(dst, static_cast<const T*>(src), n);
  });
  REPLAY_LAUNCH_CHECK();
}

void cast_from_fp32(void* dst, DType dst_type, const float* src, int64_t n, cudaStream_t stream) {
  REPLAY_REQUIRE(dst != nullptr && src != nullptr && n >= 0, "cast_from_fp32: null pointer");
  if (n == 0) return;
  dispatch16(dst_type, "cast_from_fp32", [&](auto tag) {
    using T = decltype(tag);
    cast_from_fp32_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(dst), src, n);
  });
  REPLAY_LAUNCH_CHECK();
}

void one_hot(void* out, DType type, const int32_t* tokens, int64_t rows, int64_t vocab,
             cudaStream_t stream) {
  REPLAY_REQUIRE(out != nullptr && tokens != nullptr && rows >= 0 && vocab >= 1,
                 "one_hot: null pointer or empty vocabulary");
  if (rows == 0) return;
  dispatch16(type, "one_hot", [&](auto tag) {
    using T = decltype(tag);
    one_hot_kernel<T><<<blocks_for(rows * vocab), kThreads, 0, stream>>>(static_cast<T*>(out),
                                                                         tokens, rows, vocab);
  });
  REPLAY_LAUNCH_CHECK();
}

void dropout_forward(void* out, const void* x, DType type, int64_t n, float p, RngArgs rng,
                     cudaStream_t stream) {
  REPLAY_REQUIRE(out != nullptr && x != nullptr && n >= 0, "rnnt dropout_forward: null pointer");
  const uint32_t threshold = threshold_of(p, rng, "rnnt dropout_forward");
  if (n == 0) return;
  const float scale = 1.0f / (1.0f - p);
  dispatch16(type, "rnnt dropout_forward", [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(x), n,
                                                 threshold, scale, rng.slot, rng.op_offset);
  });
  REPLAY_LAUNCH_CHECK();
}

void dropout_backward(void* dx, const void* dy, DType type, int64_t n, float p, RngArgs rng,
                      cudaStream_t stream) {
  dropout_forward(dx, dy, type, n, p, rng, stream);  // the same mask and scale
}

void joint_hidden_forward(void* h, const void* enc, const void* pred, DType type,
                          const JointShape& shape, float p, RngArgs rng, cudaStream_t stream) {
  REPLAY_REQUIRE(h != nullptr && enc != nullptr && pred != nullptr,
                 "joint_hidden_forward: null pointer");
  const uint32_t threshold = threshold_of(p, rng, "joint_hidden_forward");
  const int64_t n = shape.elements();
  if (n == 0) return;
  const float scale = 1.0f / (1.0f - p);
  dispatch16(type, "joint_hidden_forward", [&](auto tag) {
    using T = decltype(tag);
    joint_forward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<T*>(h), static_cast<const T*>(enc), static_cast<const T*>(pred), shape.batch,
        shape.frames, shape.positions, shape.hidden, threshold, scale, rng.slot, rng.op_offset);
  });
  REPLAY_LAUNCH_CHECK();
}

void joint_hidden_backward(void* denc, void* dpred, const void* dh, const void* enc,
                           const void* pred, DType type, const JointShape& shape, float p,
                           RngArgs rng, cudaStream_t stream) {
  REPLAY_REQUIRE(
      denc != nullptr && dpred != nullptr && dh != nullptr && enc != nullptr && pred != nullptr,
      "joint_hidden_backward: null pointer");
  const uint32_t threshold = threshold_of(p, rng, "joint_hidden_backward");
  if (shape.elements() == 0) return;
  const float scale = 1.0f / (1.0f - p);
  const int64_t B = shape.batch, Tn = shape.frames, P = shape.positions, J = shape.hidden;
  dispatch16(type, "joint_hidden_backward", [&](auto tag) {
    using T = decltype(tag);
    joint_backward_enc_kernel<T><<<blocks_for(B * Tn * J), kThreads, 0, stream>>>(
        static_cast<T*>(denc), static_cast<const T*>(dh), static_cast<const T*>(enc),
        static_cast<const T*>(pred), B, Tn, P, J, threshold, scale, rng.slot, rng.op_offset);
    REPLAY_LAUNCH_CHECK();
    joint_backward_pred_kernel<T><<<blocks_for(B * P * J), kThreads, 0, stream>>>(
        static_cast<T*>(dpred), static_cast<const T*>(dh), static_cast<const T*>(enc),
        static_cast<const T*>(pred), B, Tn, P, J, threshold, scale, rng.slot, rng.op_offset);
  });
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::rnnt

// ---- Greedy decoding ---------------------------------------------------------------------------

namespace replay::rnnt {
namespace {

// One block: flag = any active[b].
__global__ void any_active_kernel(int32_t* flag, const int32_t* active, int64_t B) {
  __shared__ int32_t any;
  if (threadIdx.x == 0) any = 0;
  __syncthreads();
  int32_t mine = 0;
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) mine |= active[b];
  if (mine) atomicOr(&any, 1);  // an integer OR: the result does not depend on the order
  __syncthreads();
  if (threadIdx.x == 0) *flag = any;
}

template <typename T>
__global__ void decode_init_kernel(DecodeState st, T* h, T* c, const int32_t* frame_lengths,
                                   DecodeShape s) {
  const int64_t n = s.layers * s.batch * s.hidden, symbols = s.batch * s.max_symbols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < max(n, symbols);
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // The hypotheses' unused tails hold -1, so decode_store copies defined words only.
    if (i < symbols) st.tokens[i] = -1;
    if (i >= n) continue;
    h[i] = from_f<T>(0.0f);
    c[i] = from_f<T>(0.0f);
    if (i < s.batch) {
      st.label[i] = s.blank;
      st.frame[i] = 0;
      st.at_frame[i] = 0;
      st.lengths[i] = 0;
      st.active[i] = frame_lengths[i] > 0 ? 1 : 0;
    }
  }
}

template <typename T>
__global__ void decode_embed_kernel(T* x, const T* table, const int32_t* label, int64_t B,
                                    int64_t V, int64_t C) {
  const int64_t n = B * C;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / C, ch = i % C;
    const int64_t v = min(max(static_cast<int64_t>(label[b]), int64_t{0}), V - 1);
    x[i] = table[v * C + ch];
  }
}

template <typename T>
__global__ void decode_joint_kernel(T* hj, const T* enc, const T* q, const int32_t* frame,
                                    int64_t B, int64_t Tn, int64_t J) {
  const int64_t n = B * J;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / J, j = i % J;
    const int64_t t = min(max(static_cast<int64_t>(frame[b]), int64_t{0}), Tn - 1);
    const float s = to_f(enc[(b * Tn + t) * J + j]) + to_f(q[i]);
    hj[i] = from_f<T>(s > 0.0f ? s : 0.0f);
  }
}

// One block per utterance.
template <typename T>
__global__ void decode_update_kernel(DecodeState st, const T* logits, T* h, T* c, const T* hy,
                                     const T* cy, const int32_t* frame_lengths, DecodeShape s) {
  const int64_t b = blockIdx.x;
  __shared__ float best_v[256];
  __shared__ int32_t best_i[256];
  __shared__ int32_t emit;
  if (!st.active[b]) return;  // uniform over the block
  float bv = -INFINITY;
  int32_t bi = INT32_MAX;
  for (int64_t v = threadIdx.x; v < s.vocab; v += blockDim.x) {
    const float x = to_f(logits[b * s.vocab + v]);
    if (x > bv || (x == bv && v < bi)) {
      bv = x;
      bi = static_cast<int32_t>(v);
    }
  }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) {
      const float ov = best_v[threadIdx.x + k];
      const int32_t oi = best_i[threadIdx.x + k];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int32_t k = best_i[0];
    if (k == INT32_MAX) k = s.blank;  // every logit NaN: treat as blank
    int32_t t = st.frame[b], at = st.at_frame[b], len = st.lengths[b];
    int32_t e = 0;
    if (k == s.blank) {
      t += 1;
      at = 0;
    } else {
      e = 1;
      st.tokens[b * s.max_symbols + len] = k;
      len += 1;
      st.label[b] = k;
      at += 1;
      if (at >= s.max_per_frame) {
        t += 1;
        at = 0;
      }
    }
    st.frame[b] = t;
    st.at_frame[b] = at;
    st.lengths[b] = len;
    if (t >= frame_lengths[b] || len >= s.max_symbols) st.active[b] = 0;
    emit = e;
  }
  __syncthreads();
  if (!emit) return;
  for (int64_t l = 0; l < s.layers; ++l)
    for (int64_t j = threadIdx.x; j < s.hidden; j += blockDim.x) {
      const int64_t i = (l * s.batch + b) * s.hidden + j;
      h[i] = hy[i];
      c[i] = cy[i];
    }
}

__global__ void decode_store_kernel(int32_t* out_tokens, int32_t* out_lengths,
                                    const int32_t* counter, int64_t slots, DecodeState st,
                                    int64_t B, int64_t S) {
  const int64_t slot = static_cast<int64_t>(*counter) % slots;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < B * S;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out_tokens[slot * B * S + i] = st.tokens[i];
    if (i < B) out_lengths[slot * B + i] = st.lengths[i];
  }
}

__global__ void increment_kernel(int32_t* counter) {
  *counter += 1;
}

}  // namespace

void decode_init(const DecodeState& st, void* h, void* c, DType type, const int32_t* frame_lengths,
                 const DecodeShape& shape, cudaStream_t stream) {
  const int64_t n = std::max(
      {shape.layers * shape.batch * shape.hidden, shape.batch, shape.batch * shape.max_symbols});
  REPLAY_REQUIRE(shape.layers * shape.hidden >= 1, "decode_init: empty LSTM state");
  dispatch16(type, "decode_init", [&](auto tag) {
    using T = decltype(tag);
    decode_init_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        st, static_cast<T*>(h), static_cast<T*>(c), frame_lengths, shape);
  });
  REPLAY_LAUNCH_CHECK();
  any_active_kernel<<<1, 256, 0, stream>>>(st.flag, st.active, shape.batch);
  REPLAY_LAUNCH_CHECK();
}

void decode_embed(void* x, const void* table, const int32_t* label, DType type,
                  const DecodeShape& shape, int64_t channels, cudaStream_t stream) {
  dispatch16(type, "decode_embed", [&](auto tag) {
    using T = decltype(tag);
    decode_embed_kernel<T><<<blocks_for(shape.batch * channels), kThreads, 0, stream>>>(
        static_cast<T*>(x), static_cast<const T*>(table), label, shape.batch, shape.vocab,
        channels);
  });
  REPLAY_LAUNCH_CHECK();
}

void decode_joint(void* hj, const void* enc, const void* q, const int32_t* frame, DType type,
                  int64_t batch, int64_t frames, int64_t hidden, cudaStream_t stream) {
  REPLAY_REQUIRE(frames >= 1, "decode_joint: no frames");
  dispatch16(type, "decode_joint", [&](auto tag) {
    using T = decltype(tag);
    decode_joint_kernel<T><<<blocks_for(batch * hidden), kThreads, 0, stream>>>(
        static_cast<T*>(hj), static_cast<const T*>(enc), static_cast<const T*>(q), frame, batch,
        frames, hidden);
  });
  REPLAY_LAUNCH_CHECK();
}

void decode_update(const DecodeState& st, const void* logits, void* h, void* c, const void* hy,
                   const void* cy, DType type, const int32_t* frame_lengths,
                   const DecodeShape& shape, cudaStream_t stream) {
  REPLAY_REQUIRE(shape.max_symbols >= 1 && shape.max_per_frame >= 1,
                 "decode_update: symbol limits must be >= 1");
  dispatch16(type, "decode_update", [&](auto tag) {
    using T = decltype(tag);
    decode_update_kernel<T><<<static_cast<unsigned>(shape.batch), 256, 0, stream>>>(
        st, static_cast<const T*>(logits), static_cast<T*>(h), static_cast<T*>(c),
        static_cast<const T*>(hy), static_cast<const T*>(cy), frame_lengths, shape);
  });
  REPLAY_LAUNCH_CHECK();
  any_active_kernel<<<1, 256, 0, stream>>>(st.flag, st.active, shape.batch);
  REPLAY_LAUNCH_CHECK();
}

void decode_store(int32_t* out_tokens, int32_t* out_lengths, int32_t* counter, int64_t slots,
                  const DecodeState& st, const DecodeShape& shape, cudaStream_t stream) {
  REPLAY_REQUIRE(slots >= 1, "decode_store: no slots");
  const int64_t n = shape.batch * shape.max_symbols;
  decode_store_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      out_tokens, out_lengths, counter, slots, st, shape.batch, shape.max_symbols);
  REPLAY_LAUNCH_CHECK();
  increment_kernel<<<1, 1, 0, stream>>>(counter);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::rnnt

namespace replay::rnnt {
namespace {

__global__ void ema_kernel(float* ema, const float* w, int64_t n, float decay) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    ema[i] = decay * ema[i] + (1.0f - decay) * w[i];
}

}  // namespace

void ema_update(float* ema, const float* w, int64_t n, float decay, cudaStream_t stream) {
  REPLAY_REQUIRE(ema != nullptr && w != nullptr && n >= 0, "ema_update: null pointer");
  REPLAY_REQUIRE(decay >= 0.0f && decay < 1.0f, "ema_update: decay must be in [0, 1)");
  if (n == 0) return;
  ema_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ema, w, n, decay);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::rnnt

namespace replay::rnnt {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void clock_mark_kernel(uint64_t* clock, int slot) {
  const uint64_t now = global_ns();
  if (slot >= 0) clock[1 + slot] += now - clock[0];
  clock[0] = now;
}

}  // namespace

void clock_mark(uint64_t* clock, int slot, int slots, cudaStream_t stream) {
  REPLAY_REQUIRE(clock != nullptr, "clock_mark: null clock");
  REPLAY_REQUIRE(slot >= -1 && slot < slots, "clock_mark: slot out of range");
  clock_mark_kernel<<<1, 1, 0, stream>>>(clock, slot);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::rnnt
