// transducer.cu: the RNN-T loss forward and backward (see transducer.h).
//
// Three kernels forward, one backward:
//
// 1. transducer_rows_kernel: one warp per (b, t, u) row of V logits inside the lengths, rows past
//    them skipped unread. The row is read once (16-byte streaming loads where V and the pointer
//    allow, all of a lane's chunk issued before any is used), its max and sum of exp(z - max)
//    formed in registers and merged across the warp; the blank's and the next label's logits are
//    two more loads of the same row, issued alongside. It stores the log-sum-exp and the two
//    log-probabilities: the recursion needs nothing else of the V logits.
// 2. transducer_alpha_beta_kernel: one block of two warps per utterance, alpha in warp 0 and beta
//    in warp 1 at the same time. A warp walks the lattice's anti-diagonals d = t + u (the cells of
//    one diagonal depend only on the previous one); lane l holds the K consecutive label positions
//    u = l*K .. l*K + K-1 of the current diagonal in registers, so a step needs one shuffle (the
//    neighbouring lane's edge value) and no barrier or shared memory. The step is latency-bound,
//    so the log-probabilities it reads (written by kernel 1, L2-resident) are loaded D steps ahead
//    into a ring of registers that the unrolled loop indexes statically.
// 3. transducer_mean_kernel: one block sums the losses in a fixed order (no float atomics) into
//    the mean and counts the non-empty utterances for the backward's mean reduction.
// 4. transducer_backward_kernel: one warp per row again, reading the row's logits once more and
//    writing the gradient over them (each lane stores exactly the elements it loaded, after
//    loading them, so the logits buffer may be the output); rows past the lengths are zeroed
//    without being read.
//
// All arithmetic is fp32 in log space; exp(x) of a row's logits is exp2(x * log2e - c) with
// ex2.approx (relative error near 2^-22, far below fp32 alpha/beta rounding at hundreds of nats).
// Every kernel is a programmatic dependent launch (dependent_launch.cuh) of the one before it.
#include "workloads/rnnt/transducer.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/device_utils.cuh"  // ceil_div, block_reduce_sum
#include "common/kernels/dependent_launch.cuh"

namespace replay::rnnt {
namespace {

constexpr int kRowWarps = 8;  // rows (one warp each) per block of the row kernels
constexpr int kRowThreads = 32 * kRowWarps;
// Four such blocks an SM (a 64-register cap): 32 warps with up to 2 KB of a row each in flight.
constexpr int kRowBlocksPerSM = 4;
constexpr int kMeanThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------
// The workspace: five fp32 [B, T, U + 1] arrays, then [B] log-likelihoods and the count, each at a
// 256-byte boundary.

struct Workspace {
  float* lse;        // log-sum-exp of the row's logits
  float* log_blank;  // lp[b, t, u, blank]
  float* log_label;  // lp[b, t, u, labels[b, u]] (u < U_b)
  float* alpha;
  float* beta;
  float* log_prob;  // [B] log P(y_b | x_b)
  int32_t* count;   // [1] non-empty utterances
};

constexpr size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Lays the workspace out from `base` (null: just the size) and returns its size in bytes.
size_t layout(const TransducerShape& s, void* base, Workspace* ws) {
  char* p = static_cast<char*>(base);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = p == nullptr ? nullptr : p + offset;
    offset += align256(bytes);
    return at;
  };
  const size_t cells = static_cast<size_t>(s.rows()) * sizeof(float);
  Workspace w{};
  w.lse = reinterpret_cast<float*>(take(cells));
  w.log_blank = reinterpret_cast<float*>(take(cells));
  w.log_label = reinterpret_cast<float*>(take(cells));
  w.alpha = reinterpret_cast<float*>(take(cells));
  w.beta = reinterpret_cast<float*>(take(cells));
  w.log_prob = reinterpret_cast<float*>(take(static_cast<size_t>(s.batch) * sizeof(float)));
  w.count = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  if (ws != nullptr) *ws = w;
  return offset;
}

// ---------------------------------------------------------------------------------------------------
// Element types: a row is read in units of kN elements, one 16-byte access each (kVec), or one
// element at a time where V or the pointer does not allow 16-byte accesses.

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T, bool kVec>
struct RowIO {
  static constexpr int kN = kVec ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements a unit
  // Units a lane has in flight per chunk: V = 1024 in fp16 is one chunk of 4 x 16 bytes a lane.
  static constexpr int kUnits = kVec ? 4 : 8;
  using Raw = std::conditional_t<kVec, uint4, T>;  // a unit as loaded, 4 registers at most

  __device__ __forceinline__ static Raw load(const T* row, int64_t unit) {
    if constexpr (kVec)
      return __ldcs(reinterpret_cast<const uint4*>(row) + unit);
    else
      return row[unit];
  }

  __device__ __forceinline__ static void unpack(const Raw& w, float (&v)[kN]) {
    if constexpr (kVec) {
      const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int k = 0; k < kN; ++k) v[k] = to_float(e[k]);
    } else {
      v[0] = to_float(w);
    }
  }

  __device__ __forceinline__ static void store(T* row, int64_t unit, const float (&v)[kN]) {
    if constexpr (kVec) {
      uint4 w;
      T* e = reinterpret_cast<T*>(&w);
#pragma unroll
      for (int k = 0; k < kN; ++k) e[k] = from_float<T>(v[k]);
      __stcs(reinterpret_cast<uint4*>(row) + unit, w);
    } else {
      row[unit] = from_float<T>(v[0]);
    }
  }
};

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log(exp(x) + exp(y)), -inf when both are. The correction log(1 + e), e = exp(-|x - y|) <= 1,
// uses the approximate intrinsics: their absolute error (~1e-7) is below an ulp of the
// accumulated log-probabilities it is added to.
__device__ __forceinline__ float log_add_exp(float x, float y) {
  const float m = fmaxf(x, y), n = fminf(x, y);
  return m == -INFINITY ? m : m + __logf(1.0f + __expf(n - m));
}

// Lengths and labels as the header promises: clamped into range.
__device__ __forceinline__ int clamp_to(int32_t x, int64_t hi) {
  return static_cast<int>(x < 0 ? 0 : (x > hi ? hi : x));
}

// The (b, t, u) row that warp `warp` of a row-kernel block handles, and the utterance's lengths.
struct RowPlace {
  int b, t, u, frames, labels;  // frames = T_b, labels = U_b
  int64_t row;                  // transducer_row(b, t, u)
  bool inside;                  // t < T_b and u <= U_b
  bool exists;                  // t < T (the grid rounds T * (U + 1) up to whole blocks)
};

__device__ __forceinline__ RowPlace place_row(const int32_t* frame_lengths,
                                              const int32_t* label_lengths, int max_frames,
                                              int positions) {
  RowPlace p;
  p.b = blockIdx.y;
  const int r = blockIdx.x * kRowWarps + threadIdx.x / 32;  // t * (U + 1) + u, below 2^31
  p.t = r / positions;
  p.u = r - p.t * positions;
  p.frames = clamp_to(frame_lengths[p.b], max_frames);
  p.labels = clamp_to(label_lengths[p.b], positions - 1);
  p.row = transducer_row(p.b, p.t, p.u, max_frames, positions);
  p.exists = p.t < max_frames;
  p.inside = p.exists && p.t < p.frames && p.u <= p.labels;
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Kernel 1: per-row log-sum-exp and the two log-probabilities the recursion needs.

// Merges the lanes' (max, sum of exp(x - max)); every lane receives the row's.
__device__ __forceinline__ float2 warp_merge_stats(float m, float s) {
  const float max = warp_reduce_max(m);
  const float scaled = max == -INFINITY ? 0.0f : s * exp2_approx((m - max) * kLog2e);
  return make_float2(max, warp_reduce_sum(scaled));
}

template <typename T, bool kVec>
__device__ __forceinline__ float row_log_sum_exp(const T* row, int64_t vocab, int lane) {
  using IO = RowIO<T, kVec>;
  constexpr int kN = IO::kN, kU = IO::kUnits;
  const int64_t units = vocab / kN;
  float m = -INFINITY, s = 0.0f;
  for (int64_t base = lane; base < units; base += 32 * kU) {
    float v[kU][kN];
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      if (base + 32 * i < units) {
        IO::unpack(IO::load(row, base + 32 * i), v[i]);
      } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) v[i][k] = -INFINITY;
      }
    }
    float chunk_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kU; ++i)
#pragma unroll
      for (int k = 0; k < kN; ++k) chunk_max = fmaxf(chunk_max, v[i][k]);
    const float m_new = fmaxf(m, chunk_max);
    if (m_new == -INFINITY) continue;        // nothing but -inf so far: the sum stays 0
    s *= exp2_approx((m - m_new) * kLog2e);  // 0 while m is -inf (s is 0 then)
    m = m_new;
    const float m_log2 = m * kLog2e;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: less dependent-add latency
#pragma unroll
    for (int i = 0; i < kU; ++i)
#pragma unroll
      for (int k = 0; k < kN; ++k)
        sums[(i * kN + k) % 4] += exp2_approx(fmaf(v[i][k], kLog2e, -m_log2));
    s += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
  const float2 stats = warp_merge_stats(m, s);
  return stats.x == -INFINITY ? -INFINITY : stats.x + logf(stats.y);
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSM)
    transducer_rows_kernel(Workspace ws, const T* __restrict__ logits,
                           const int32_t* __restrict__ labels,
                           const int32_t* __restrict__ frame_lengths,
                           const int32_t* __restrict__ label_lengths, int max_frames, int positions,
                           int64_t vocab, int blank) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const RowPlace p = place_row(frame_lengths, label_lengths, max_frames, positions);
  if (!p.inside) return;  // whole warps: one row a warp
  const int lane = threadIdx.x % 32;
  const T* row = logits + p.row * vocab;
  const bool has_label = p.u < p.labels;
  const int64_t label =
      has_label ? clamp_to(labels[static_cast<int64_t>(p.b) * (positions - 1) + p.u], vocab - 1)
                : blank;
  const float z_blank = to_float(row[blank]);  // the same address for every lane: one access
  const float z_label = to_float(row[label]);
  const float lse = row_log_sum_exp<T, kVec>(row, vocab, lane);
  if (lane == 0) {
    ws.lse[p.row] = lse;
    ws.log_blank[p.row] = z_blank - lse;
    ws.log_label[p.row] = has_label ? z_label - lse : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernel 2: alpha and beta along the anti-diagonals, one warp each.
//
// Lane l holds positions u = l*K + j, j < K, of the diagonal last computed: the value of cell
// (d - u, u) inside the lengths, -inf outside. Operand loads return -inf for cells outside, so
// every update keeps that invariant without a branch on the values.

template <int K, int D>
__device__ __forceinline__ void alpha_pass(const Workspace& ws, float* loss, int b, int64_t base,
                                           int frames, int labels, int positions, int lane) {
  const float* lpb = ws.log_blank + base;
  const float* lpl = ws.log_label + base;
  float* alpha = ws.alpha + base;
  const int last = frames - 1 + labels;  // the last diagonal: the cell (T_b - 1, U_b)
  const int u0 = lane * K;
  // Operands of diagonal d: the blank from (t - 1, u) and the label from (t, u - 1), t = d - u.
  auto load = [&](int d, float(&pb)[K], float(&pl)[K]) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int u = u0 + j, t = d - u;
      const bool cell = d <= last && u <= labels && t >= 0 && t < frames;
      pb[j] = cell && t >= 1 ? lpb[(t - 1) * positions + u] : -INFINITY;
      pl[j] = cell && u >= 1 ? lpl[t * positions + u - 1] : -INFINITY;
    }
  };
  float a[K];
#pragma unroll
  for (int j = 0; j < K; ++j) a[j] = u0 + j == 0 ? 0.0f : -INFINITY;  // diagonal 0: alpha[0, 0]
  if (lane == 0) alpha[0] = 0.0f;
  float ring_b[D][K], ring_l[D][K];
#pragma unroll
  for (int i = 0; i < D; ++i) load(1 + i, ring_b[i], ring_l[i]);
  for (int d0 = 1; d0 <= last; d0 += D) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int d = d0 + i;
      if (d > last) break;                                        // the same d on every lane
      const float left = __shfl_up_sync(kFullMask, a[K - 1], 1);  // (t, u0 - 1) of diagonal d-1
      float next[K];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const float from_label = (j > 0 ? a[j - 1] : (lane > 0 ? left : -INFINITY)) + ring_l[i][j];
        next[j] = log_add_exp(a[j] + ring_b[i][j], from_label);
      }
#pragma unroll
      for (int j = 0; j < K; ++j) {
        a[j] = next[j];
        const int u = u0 + j, t = d - u;
        if (u <= labels && t >= 0 && t < frames) alpha[t * positions + u] = next[j];
      }
      load(d + D, ring_b[i], ring_l[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (u0 + j == labels) {  // the lane holding (T_b - 1, U_b), which the last diagonal ends on
      const float log_prob = a[j] + lpb[(frames - 1) * positions + labels];
      ws.log_prob[b] = log_prob;
      loss[b] = -log_prob;
    }
  }
}

template <int K, int D>
__device__ __forceinline__ void beta_pass(const Workspace& ws, int64_t base, int frames, int labels,
                                          int positions, int lane) {
  const float* lpb = ws.log_blank + base;
  const float* lpl = ws.log_label + base;
  float* beta = ws.beta + base;
  const int last = frames - 1 + labels;
  const int u0 = lane * K;
  // Operands of diagonal d: the blank to (t + 1, u) and the label to (t, u + 1), t = d - u.
  auto load = [&](int d, float(&pb)[K], float(&pl)[K]) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int u = u0 + j, t = d - u;
      const bool cell = d >= 0 && u <= labels && t >= 0 && t < frames;
      pb[j] = cell && t + 1 < frames ? lpb[t * positions + u] : -INFINITY;
      pl[j] = cell && u < labels ? lpl[t * positions + u] : -INFINITY;
    }
  };
  // The last diagonal holds one cell, (T_b - 1, U_b): the final blank.
  const int64_t terminal = static_cast<int64_t>(frames - 1) * positions + labels;
  float c[K];
#pragma unroll
  for (int j = 0; j < K; ++j) c[j] = u0 + j == labels ? lpb[terminal] : -INFINITY;
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (u0 + j == labels) beta[terminal] = c[j];
  float ring_b[D][K], ring_l[D][K];
#pragma unroll
  for (int i = 0; i < D; ++i) load(last - 1 - i, ring_b[i], ring_l[i]);
  for (int d0 = last - 1; d0 >= 0; d0 -= D) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int d = d0 - i;
      if (d < 0) break;
      const float right = __shfl_down_sync(kFullMask, c[0], 1);  // (t, u0 + K) of diagonal d+1
      float next[K];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const float from_label =
            (j + 1 < K ? c[j + 1] : (lane < 31 ? right : -INFINITY)) + ring_l[i][j];
        next[j] = log_add_exp(c[j] + ring_b[i][j], from_label);
      }
#pragma unroll
      for (int j = 0; j < K; ++j) {
        c[j] = next[j];
        const int u = u0 + j, t = d - u;
        if (u <= labels && t >= 0 && t < frames) beta[t * positions + u] = next[j];
      }
      load(d - D, ring_b[i], ring_l[i]);
    }
  }
}

template <int K, int D>
__global__ void __launch_bounds__(64)
    transducer_alpha_beta_kernel(Workspace ws, float* __restrict__ loss,
                                 const int32_t* __restrict__ frame_lengths,
                                 const int32_t* __restrict__ label_lengths, int max_frames,
                                 int positions) {
  allow_dependent_launch();
  wait_for_previous_grid();
  const int b = blockIdx.x, lane = threadIdx.x % 32;
  const int frames = clamp_to(frame_lengths[b], max_frames);
  const int labels = clamp_to(label_lengths[b], positions - 1);
  if (frames == 0) {  // an empty slot
    if (threadIdx.x == 0) {
      ws.log_prob[b] = 0.0f;
      loss[b] = 0.0f;
    }
    return;
  }
  const int64_t base = transducer_row(b, 0, 0, max_frames, positions);
  if (threadIdx.x < 32)
    alpha_pass<K, D>(ws, loss, b, base, frames, labels, positions, lane);
  else
    beta_pass<K, D>(ws, base, frames, labels, positions, lane);
}

// ---------------------------------------------------------------------------------------------------
// Kernel 3: the mean over non-empty utterances and their count, in a fixed order.

__global__ void __launch_bounds__(kMeanThreads)
    transducer_mean_kernel(float* mean_loss, Workspace ws, const float* __restrict__ loss,
                           const int32_t* __restrict__ frame_lengths, int batch, int max_frames) {
  __shared__ float scratch[32];
  allow_dependent_launch();
  wait_for_previous_grid();
  float sum = 0.0f, counted = 0.0f;
  for (int b = threadIdx.x; b < batch; b += kMeanThreads) {
    if (clamp_to(frame_lengths[b], max_frames) > 0) {
      sum += loss[b];
      counted += 1.0f;
    }
  }
  sum = block_reduce_sum(sum, scratch);
  counted = block_reduce_sum(counted, scratch);  // exact: batch <= 65535
  if (threadIdx.x == 0) {
    *ws.count = static_cast<int32_t>(counted);
    if (mean_loss != nullptr) *mean_loss = counted > 0.0f ? sum / counted : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernel 4: the gradient, one warp per row. grad and logits may be the same buffer: no
// __restrict__ on either, and each lane loads a chunk before it stores that chunk.

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSM)
    transducer_backward_kernel(T* grad, const T* logits, Workspace ws,
                               const int32_t* __restrict__ labels,
                               const int32_t* __restrict__ frame_lengths,
                               const int32_t* __restrict__ label_lengths,
                               const float* __restrict__ grad_scale, bool mean, int max_frames,
                               int positions, int64_t vocab, int blank) {
  using IO = RowIO<T, kVec>;
  constexpr int kN = IO::kN, kU = IO::kUnits;
  allow_dependent_launch();
  wait_for_previous_grid();
  const RowPlace p = place_row(frame_lengths, label_lengths, max_frames, positions);
  if (!p.exists) return;
  const int lane = threadIdx.x % 32;
  const int64_t units = vocab / kN;
  T* out = grad + p.row * vocab;
  if (!p.inside) {  // past the lengths: zeros, the logits unread
    float zero[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) zero[k] = 0.0f;
    for (int64_t unit = lane; unit < units; unit += 32) IO::store(out, unit, zero);
    return;
  }
  const T* in = logits + p.row * vocab;

  float scale = *grad_scale;
  if (mean) {
    const int32_t count = *ws.count;
    scale = count > 0 ? scale / static_cast<float>(count) : 0.0f;
  }
  // In log space relative to log P: the row's occupancy alpha + beta - logP, and the two
  // transitions out of the cell (a blank to (t + 1, u), or the final blank from (T_b - 1, U_b);
  // the next label to (t, u + 1)).
  const float alpha_rel = ws.alpha[p.row] - ws.log_prob[p.b];
  const float occupancy = alpha_rel + ws.beta[p.row];
  const float beta_after_blank =
      p.t + 1 < p.frames ? ws.beta[p.row + positions] : (p.u == p.labels ? 0.0f : -INFINITY);
  const float blank_term = scale * expf(alpha_rel + ws.log_blank[p.row] + beta_after_blank);
  const bool has_label = p.u < p.labels;
  const float label_term =
      has_label ? scale * expf(alpha_rel + ws.log_label[p.row] + ws.beta[p.row + 1]) : 0.0f;
  const int64_t label =
      has_label ? clamp_to(labels[static_cast<int64_t>(p.b) * (positions - 1) + p.u], vocab - 1)
                : -1;
  // softmax(z)[v] * gamma * scale = scale * exp2(z * log2e - (lse - occupancy) * log2e).
  const float shift = (ws.lse[p.row] - occupancy) * kLog2e;

  for (int64_t base = lane; base < units; base += 32 * kU) {
    typename IO::Raw x[kU];  // the chunk's loads, all issued before any store
#pragma unroll
    for (int i = 0; i < kU; ++i)
      if (base + 32 * i < units) x[i] = IO::load(in, base + 32 * i);
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      const int64_t unit = base + 32 * i;
      if (unit < units) {
        float v[kN];
        IO::unpack(x[i], v);
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const int64_t e = unit * kN + k;
          float g = scale * exp2_approx(fmaf(v[k], kLog2e, -shift));
          if (e == blank) g -= blank_term;
          if (e == label) g -= label_term;
          v[k] = g;
        }
        IO::store(out, unit, v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.

struct Dims {
  int max_frames, positions, blank;
  int64_t vocab;
  dim3 row_grid;
};

Dims check_and_size(const TransducerShape& s, const TransducerInputs& in, const void* workspace,
                    size_t workspace_bytes) {
  REPLAY_REQUIRE(s.batch >= 1 && s.batch <= 65535,
                 "batch must be in [1, 65535]: " + std::to_string(s.batch));
  REPLAY_REQUIRE(s.max_frames >= 1, "max_frames must be positive");
  REPLAY_REQUIRE(s.max_labels >= 0 && s.positions() <= kTransducerMaxPositions,
                 "max_labels + 1 must be in [1, " + std::to_string(kTransducerMaxPositions) +
                     "]: " + std::to_string(s.max_labels));
  REPLAY_REQUIRE(s.max_frames * s.positions() < INT_MAX,
                 "T * (U + 1) must be below 2^31 (one utterance's rows index in 32 bits)");
  REPLAY_REQUIRE(s.vocab >= 1 && s.blank >= 0 && s.blank < s.vocab,
                 "need V >= 1 and blank in [0, V): V " + std::to_string(s.vocab) + ", blank " +
                     std::to_string(s.blank));
  REPLAY_REQUIRE(
      in.dtype == DType::kFP16 || in.dtype == DType::kBF16 || in.dtype == DType::kFP32,
      std::string("transducer logits must be fp16, bf16 or fp32, not ") + dtype_name(in.dtype));
  REPLAY_REQUIRE(in.logits != nullptr && in.frame_lengths != nullptr &&
                     in.label_lengths != nullptr && (in.labels != nullptr || s.max_labels == 0),
                 "null transducer input");
  REPLAY_REQUIRE(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                 "the transducer workspace must be non-null and 16-byte aligned");
  REPLAY_REQUIRE(workspace_bytes >= transducer_workspace_bytes(s),
                 "transducer workspace too small: " + std::to_string(workspace_bytes) + " < " +
                     std::to_string(transducer_workspace_bytes(s)));
  Dims d;
  d.max_frames = static_cast<int>(s.max_frames);
  d.positions = static_cast<int>(s.positions());
  d.blank = s.blank;
  d.vocab = s.vocab;
  const int64_t blocks = ceil_div<int64_t>(s.max_frames * s.positions(), kRowWarps);
  d.row_grid = dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(s.batch));
  return d;
}

// 16-byte units when V fills whole units and every row starts on a 16-byte boundary.
bool vector_rows(const TransducerShape& s, DType dtype, const void* a, const void* b) {
  const int64_t n = 16 / static_cast<int64_t>(dtype_size(dtype));
  return s.vocab % n == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

// Calls f(T{}, std::bool_constant<kVec>{}) for the logits' type and access width.
template <typename F>
void dispatch(DType dtype, bool vec, F&& f) {
  auto with = [&](auto type) {
    if (vec)
      f(type, std::true_type{});
    else
      f(type, std::false_type{});
  };
  switch (dtype) {
    case DType::kFP32:
      with(float{});
      break;
    case DType::kBF16:
      with(__nv_bfloat16{});
      break;
    default:
      with(__half{});
      break;
  }
}

template <int K, int D>
void launch_alpha_beta(const Workspace& ws, float* loss, const TransducerInputs& in, const Dims& d,
                       int batch, cudaStream_t stream) {
  launch_dependent(transducer_alpha_beta_kernel<K, D>, dim3(batch), dim3(64), stream, ws, loss,
                   in.frame_lengths, in.label_lengths, d.max_frames, d.positions);
}

}  // namespace

size_t transducer_workspace_bytes(const TransducerShape& shape) {
  return layout(shape, nullptr, nullptr);
}

void transducer_forward(float* loss, float* mean_loss, const TransducerInputs& in,
                        const TransducerShape& shape, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  const Dims d = check_and_size(shape, in, workspace, workspace_bytes);
  REPLAY_REQUIRE(loss != nullptr, "the per-utterance loss output is required");
  Workspace ws;
  layout(shape, workspace, &ws);

  dispatch(in.dtype, vector_rows(shape, in.dtype, in.logits, in.logits), [&](auto type, auto vec) {
    using T = decltype(type);
    launch_dependent(transducer_rows_kernel<T, decltype(vec)::value>, d.row_grid, dim3(kRowThreads),
                     stream, ws, static_cast<const T*>(in.logits), in.labels, in.frame_lengths,
                     in.label_lengths, d.max_frames, d.positions, d.vocab, d.blank);
  });
  REPLAY_LAUNCH_CHECK();

  // K positions a lane (32 * K >= U + 1) and a prefetch depth D that keeps the ring at 16
  // registers per operand.
  const int batch = static_cast<int>(shape.batch);
  if (d.positions <= 32)
    launch_alpha_beta<1, 8>(ws, loss, in, d, batch, stream);
  else if (d.positions <= 64)
    launch_alpha_beta<2, 8>(ws, loss, in, d, batch, stream);
  else if (d.positions <= 128)
    launch_alpha_beta<4, 4>(ws, loss, in, d, batch, stream);
  else if (d.positions <= 256)
    launch_alpha_beta<8, 2>(ws, loss, in, d, batch, stream);
  else
    launch_alpha_beta<16, 1>(ws, loss, in, d, batch, stream);
  REPLAY_LAUNCH_CHECK();

  launch_dependent(transducer_mean_kernel, dim3(1), dim3(kMeanThreads), stream, mean_loss, ws,
                   static_cast<const float*>(loss), in.frame_lengths, batch, d.max_frames);
  REPLAY_LAUNCH_CHECK();
}

void transducer_backward(void* grad, const TransducerInputs& in, const float* grad_scale,
                         TransducerReduction reduction, const TransducerShape& shape,
                         const void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Dims d = check_and_size(shape, in, workspace, workspace_bytes);
  REPLAY_REQUIRE(grad != nullptr && grad_scale != nullptr, "null transducer gradient or scale");
  const size_t bytes = static_cast<size_t>(shape.elements()) * dtype_size(in.dtype);
  const uintptr_t g = reinterpret_cast<uintptr_t>(grad), z = reinterpret_cast<uintptr_t>(in.logits);
  REPLAY_REQUIRE(g == z || g + bytes <= z || z + bytes <= g,
                 "the transducer gradient must be the logits buffer itself or not overlap it");
  Workspace ws;
  layout(shape, const_cast<void*>(workspace), &ws);  // the backward only reads it
  const bool mean = reduction == TransducerReduction::kMean;
  dispatch(in.dtype, vector_rows(shape, in.dtype, grad, in.logits), [&](auto type, auto vec) {
    using T = decltype(type);
    launch_dependent(
        transducer_backward_kernel<T, decltype(vec)::value>, d.row_grid, dim3(kRowThreads), stream,
        static_cast<T*>(grad), static_cast<const T*>(in.logits), ws, in.labels, in.frame_lengths,
        in.label_lengths, grad_scale, mean, d.max_frames, d.positions, d.vocab, d.blank);
  });
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::rnnt
