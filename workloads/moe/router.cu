// router.cu: the MoE router, its backward, the expert load and bias update, and the
// sequence-level auxiliary loss (see router.h).
//
// Router forward: one warp per token. Lane l holds experts e = i * 32 + l (i < kPerLane) in
// registers, so the score row is read coalesced. The group stage goes through a per-warp row of
// shared memory: lane g walks its group's E / G biased scores for their two largest (DeepSeek-V3:
// 32 reads), and the topk_groups best groups are then picked by repeated warp arg-max over the
// lanes. The expert stage is topk rounds of warp arg-max over the candidates of the kept groups:
// each lane offers its best remaining candidate, a butterfly leaves every lane with the same
// winner (value, then the lower index: a strict total order, hence the same choice on every run),
// and the owner drops it. Lane j keeps round j's expert and score, so the weights are one warp
// sum away.
//
// The per-token kernels (router backward, the auxiliary loss's row sums and backward) use the same
// one-warp-a-token layout. Counts and the auxiliary loss's per-sequence sums are block-level
// partials reduced in a fixed order; integer atomics appear only in shared-memory histograms.
#include "workloads/moe/router.h"

#include <cmath>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"  // ceil_div, warp and block sums

namespace replay::moe {
namespace {

constexpr int kWarps = 8;  // tokens (one warp each) per block of the per-token kernels
constexpr int kThreads = 32 * kWarps;
constexpr float kNormEps = 1e-20f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kCountThreads = 1024;  // moe_count_experts: one block
// Tokens a block of the auxiliary loss's partials sums: 32 makes 128 blocks for a 4096-token
// sequence (128 tokens made 32, whose threads' chains of dependent loads took 42 us on an H100).
constexpr int64_t kAuxPartTokens = 32;

// The sigmoid every kernel uses, so that the forward, backward and auxiliary loss see the same
// bits for the same logit. expf (not __expf): within 2 ulp, and 1 / (1 + inf) = 0 far left.
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// (v, i) ranks above (w, j): the larger value, or on a tie the lower index.
__device__ __forceinline__ bool ranks_above(float v, int i, float w, int j) {
  return v > w || (v == w && i < j);
}

// Warp arg-max of (v, i), carrying `payload`: every lane ends with the same winner, because the
// order is total (indices differ) and each butterfly step is symmetric.
__device__ __forceinline__ void warp_argmax(float& v, int& i, float& payload) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(kFull, v, o);
    const int j = __shfl_xor_sync(kFull, i, o);
    const float p = __shfl_xor_sync(kFull, payload, o);
    if (ranks_above(w, j, v, i)) {
      v = w;
      i = j;
      payload = p;
    }
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    router_forward_kernel(int32_t* __restrict__ indices, float* __restrict__ weights,
                          const float* __restrict__ logits, const float* __restrict__ bias,
                          int64_t tokens, int E, int G, int topk_groups, int topk, float scale) {
  __shared__ float biased_row[kWarps][kMoeMaxExperts];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;  // a whole warp: no block barrier follows
  const float* x = logits + t * E;

  float s[kPerLane], b[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    s[i] = e < E ? sigmoid(x[e]) : 0.0f;
    b[i] = e < E ? s[i] + (bias != nullptr ? bias[e] : 0.0f) : -INFINITY;
  }

  // Group stage: which groups' experts stay candidates (bit g of kept).
  uint32_t kept = kFull;
  const int S = E / G;
  if (G > 1) {
    float* row = biased_row[warp];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (i * 32 + lane < E) row[i * 32 + lane] = b[i];
    __syncwarp();
    float top1 = -INFINITY, top2 = -INFINITY;
    if (lane < G) {
      for (int j = 0; j < S; ++j) {
        const float v = row[lane * S + j];
        if (v > top1) {
          top2 = top1;
          top1 = v;
        } else if (v > top2) {
          top2 = v;
        }
      }
    }
    const float group_score = top1 + top2;
    kept = 0;
    for (int r = 0; r < topk_groups; ++r) {
      const bool open = lane < G && !((kept >> lane) & 1u);
      float v = open ? group_score : -INFINITY;
      int g = open ? lane : INT32_MAX;
      float unused = 0.0f;
      warp_argmax(v, g, unused);
      kept |= 1u << g;
    }
  }

  // Expert stage: topk rounds of arg-max over the kept groups' remaining experts.
  uint32_t open = 0;  // bit i: this lane's expert i * 32 + lane is still a candidate
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    if (e < E && ((kept >> (e / S)) & 1u)) open |= 1u << i;
  }
  int my_expert = 0;
  float my_score = 0.0f;
  for (int r = 0; r < topk; ++r) {
    float v = -INFINITY, score = 0.0f;
    int e = INT32_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (((open >> i) & 1u) && ranks_above(b[i], i * 32 + lane, v, e)) {
        v = b[i];
        e = i * 32 + lane;
        score = s[i];
      }
    }
    warp_argmax(v, e, score);
    if (e % 32 == lane) open &= ~(1u << (e / 32));
    if (lane == r) {
      my_expert = e;
      my_score = score;
    }
  }
  const float sum = warp_reduce_sum(lane < topk ? my_score : 0.0f) + kNormEps;
  if (lane < topk) {
    indices[t * topk + lane] = my_expert;
    weights[t * topk + lane] = scale * my_score / sum;
  }
}

__global__ void __launch_bounds__(kThreads)
    router_backward_kernel(float* __restrict__ dlogits, const float* __restrict__ dweights,
                           const float* __restrict__ logits, const int32_t* __restrict__ indices,
                           int64_t tokens, int E, int topk, float scale, bool accumulate) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;
  float* dx_row = dlogits + t * E;
  int e = 0;
  float s = 0.0f, dw = 0.0f;
  if (lane < topk) {
    e = min(max(indices[t * topk + lane], 0), E - 1);
    s = sigmoid(logits[t * E + e]);
    dw = dweights[t * topk + lane];
  }
  const float sum = warp_reduce_sum(s) + kNormEps;
  const float dot = warp_reduce_sum(dw * s);
  const float ds = scale * (dw / sum - dot / (sum * sum));
  const float dx = ds * s * (1.0f - s);
  if (!accumulate) {
    for (int c = lane; c < E; c += 32) dx_row[c] = 0.0f;
    __syncwarp();  // the zeros land before the selected experts' values (other lanes' writes)
  }
  // __fadd_rn: never contracted into an FMA, so accumulating adds exactly the value written
  // otherwise.
  if (lane < topk) dx_row[e] = accumulate ? __fadd_rn(dx_row[e], dx) : dx;
}

// One block: a shared-memory histogram over all assignments, then written or added.
__global__ void __launch_bounds__(kCountThreads)
    count_experts_kernel(int32_t* __restrict__ load, const int32_t* __restrict__ indices,
                         int64_t assignments, int E, bool accumulate) {
  __shared__ int32_t hist[kMoeMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  constexpr int kUnroll = 4;
  for (int64_t base = threadIdx.x; base < assignments; base += int64_t{kUnroll} * blockDim.x) {
    int32_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t a = base + int64_t{u} * blockDim.x;
      v[u] = a < assignments ? indices[a] : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v[u] >= 0 && v[u] < E) atomicAdd(&hist[v[u]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    load[e] = accumulate ? load[e] + hist[e] : hist[e];
}

__global__ void bias_update_kernel(float* __restrict__ bias, int32_t* __restrict__ load, int E,
                                   float rate, bool reset_load) {
  __shared__ long long scratch[32];
  const int e = threadIdx.x;
  const long long mine = e < E ? load[e] : 0;
  const long long total = block_sum_once(mine, scratch);
  if (e >= E) return;
  const long long error = total - static_cast<long long>(E) * mine;  // E * (mean - load_e)
  const float sign = error > 0 ? 1.0f : error < 0 ? -1.0f : 0.0f;
  bias[e] += rate * sign;
  if (reset_load) load[e] = 0;
}

// ---------------------------------------------------------------------------------------------------
// The auxiliary loss. Workspace: rz [T] (1 / (sum_j s_j + eps) per token), the partial sums of q
// [B, parts, E], the partial counts [B, parts, E] and f [B, E], each at a 256-byte boundary.

struct AuxWorkspace {
  float* rz;
  float* psum;
  int32_t* pcount;
  float* f;
};

constexpr size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

int64_t aux_parts(const AuxLossShape& s) {
  return ceil_div<int64_t>(s.seq_len, kAuxPartTokens);
}

size_t aux_layout(const AuxLossShape& s, void* base, AuxWorkspace* ws) {
  char* p = static_cast<char*>(base);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = p == nullptr ? nullptr : p + offset;
    offset += align256(bytes);
    return at;
  };
  const size_t partials = static_cast<size_t>(s.sequences() * aux_parts(s) * s.experts);
  AuxWorkspace w{};
  w.rz = reinterpret_cast<float*>(take(static_cast<size_t>(s.tokens) * sizeof(float)));
  w.psum = reinterpret_cast<float*>(take(partials * sizeof(float)));
  w.pcount = reinterpret_cast<int32_t*>(take(partials * sizeof(int32_t)));
  w.f = reinterpret_cast<float*>(
      take(static_cast<size_t>(s.sequences() * s.experts) * sizeof(float)));
  if (ws != nullptr) *ws = w;
  return offset;
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    aux_rows_kernel(float* __restrict__ rz, const float* __restrict__ logits, int64_t tokens,
                    int E) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (i * 32 + lane < E) sum += sigmoid(logits[t * E + i * 32 + lane]);
  sum = warp_reduce_sum(sum);
  if (lane == 0) rz[t] = 1.0f / (sum + kNormEps);
}

// Block (part, sequence), thread e: the part's sum of q_{t,e} in token order, and its counts.
__global__ void aux_partials_kernel(AuxWorkspace ws, const float* __restrict__ logits,
                                    const int32_t* __restrict__ indices, int64_t seq_len, int E,
                                    int topk, int64_t parts) {
  __shared__ int32_t hist[kMoeMaxExperts];
  const int64_t part = blockIdx.x, b = blockIdx.y;
  const int64_t t0 = b * seq_len + part * kAuxPartTokens;
  const int64_t t1 = min(t0 + kAuxPartTokens, (b + 1) * seq_len);
  const int e = threadIdx.x;
  if (e < E) hist[e] = 0;
  __syncthreads();
  for (int64_t a = t0 * topk + threadIdx.x; a < t1 * topk; a += blockDim.x) {
    const int32_t v = indices[a];
    if (v >= 0 && v < E) atomicAdd(&hist[v], 1);
  }
  float acc = 0.0f;
  if (e < E) {
#pragma unroll 8
    for (int64_t t = t0; t < t1; ++t) acc = fmaf(sigmoid(logits[t * E + e]), ws.rz[t], acc);
  }
  __syncthreads();
  if (e < E) {
    const int64_t at = (b * parts + part) * E + e;
    ws.psum[at] = acc;
    ws.pcount[at] = hist[e];
  }
}

// One block, thread e: P and f per sequence, the loss summed over experts in a fixed order.
__global__ void aux_finalize_kernel(float* __restrict__ loss, AuxWorkspace ws, int64_t sequences,
                                    int64_t seq_len, int E, int topk, int64_t parts, float coeff) {
  __shared__ float scratch[32];
  const int e = threadIdx.x;
  float total = 0.0f;
  if (e < E) {
    const float f_scale = static_cast<float>(E) / (static_cast<float>(topk) * seq_len);
    const float inv_len = 1.0f / static_cast<float>(seq_len);
    for (int64_t b = 0; b < sequences; ++b) {
      float p = 0.0f;
      int64_t count = 0;
#pragma unroll 8
      for (int64_t part = 0; part < parts; ++part) {
        p += ws.psum[(b * parts + part) * E + e];
        count += ws.pcount[(b * parts + part) * E + e];
      }
      const float f = f_scale * static_cast<float>(count);
      ws.f[b * E + e] = f;
      total = fmaf(f, p * inv_len, total);
    }
  }
  total = block_sum_once(total, scratch);
  if (e == 0) loss[0] = coeff * total / static_cast<float>(sequences);
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    aux_backward_kernel(float* __restrict__ dlogits, const float* __restrict__ dloss,
                        const float* __restrict__ logits, AuxWorkspace ws, int64_t tokens,
                        int64_t seq_len, int E, float g_scale, bool accumulate) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= tokens) return;
  const float rz = ws.rz[t];
  const float* f = ws.f + (t / seq_len) * E;
  const float scale = g_scale * (dloss != nullptr ? dloss[0] : 1.0f);
  float s[kPerLane], g[kPerLane];
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    s[i] = e < E ? sigmoid(logits[t * E + e]) : 0.0f;
    g[i] = e < E ? scale * f[e] : 0.0f;
    dot = fmaf(g[i], s[i] * rz, dot);
  }
  dot = warp_reduce_sum(dot);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    if (e >= E) continue;
    const float dx = (g[i] - dot) * rz * s[i] * (1.0f - s[i]);
    float* out = dlogits + t * E + e;
    *out = accumulate ? __fadd_rn(*out, dx) : dx;  // no FMA contraction: see router_backward
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.

// Calls f(std::integral_constant<int, kPerLane>{}) with the fewest experts a lane (1 .. 16) that
// cover E.
template <typename F>
void with_per_lane(int E, F&& f) {
  if (E <= 32) return f(std::integral_constant<int, 1>{});
  if (E <= 64) return f(std::integral_constant<int, 2>{});
  if (E <= 128) return f(std::integral_constant<int, 4>{});
  if (E <= 256) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

unsigned token_blocks(int64_t tokens) {
  return static_cast<unsigned>(ceil_div<int64_t>(tokens, kWarps));
}

int expert_threads(int E) {
  return static_cast<int>(ceil_div(E, 32)) * 32;
}

void check_experts(int64_t tokens, int E, int topk) {
  REPLAY_REQUIRE(
      E >= 1 && E <= kMoeMaxExperts,
      "experts must be in [1, " + std::to_string(kMoeMaxExperts) + "], got " + std::to_string(E));
  REPLAY_REQUIRE(topk >= 1 && topk <= kMoeMaxTopk && topk <= E,
                 "topk must be in [1, min(32, experts)], got " + std::to_string(topk));
  REPLAY_REQUIRE(
      tokens >= 1 && tokens * E < INT32_MAX && tokens * topk < INT32_MAX,
      "tokens must be positive with tokens * experts below 2^31, got " + std::to_string(tokens));
}

void check_aux(const AuxLossShape& s, const void* workspace, size_t workspace_bytes) {
  check_experts(s.tokens, s.experts, s.topk);
  REPLAY_REQUIRE(s.seq_len >= 1 && s.tokens % s.seq_len == 0,
                 "the auxiliary loss's seq_len must divide tokens (" + std::to_string(s.tokens) +
                     " tokens, seq_len " + std::to_string(s.seq_len) + ")");
  REPLAY_REQUIRE(s.sequences() <= 65535, "the auxiliary loss takes at most 65535 sequences");
  REPLAY_REQUIRE(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                 "the auxiliary loss workspace must be non-null and 16-byte aligned");
  REPLAY_REQUIRE(workspace_bytes >= router_aux_loss_workspace_bytes(s),
                 "auxiliary loss workspace too small: " + std::to_string(workspace_bytes) + " < " +
                     std::to_string(router_aux_loss_workspace_bytes(s)));
}

}  // namespace

void check_router_shape(const RouterShape& s) {
  check_experts(s.tokens, s.experts, s.topk);
  REPLAY_REQUIRE(s.groups >= 1 && s.groups <= kMoeMaxGroups && s.experts % s.groups == 0,
                 "groups must be in [1, 32] and divide experts (" + std::to_string(s.experts) +
                     " experts, " + std::to_string(s.groups) + " groups)");
  REPLAY_REQUIRE(s.groups == 1 || s.group_size() >= 2,
                 "a group needs at least two experts (its score is the sum of its top two)");
  REPLAY_REQUIRE(s.topk_groups >= 1 && s.topk_groups <= s.groups,
                 "topk_groups must be in [1, groups], got " + std::to_string(s.topk_groups));
  REPLAY_REQUIRE(s.topk <= s.topk_groups * s.group_size(),
                 "topk (" + std::to_string(s.topk) + ") exceeds the experts of the kept groups (" +
                     std::to_string(s.topk_groups * s.group_size()) + ")");
  REPLAY_REQUIRE(std::isfinite(s.route_scale), "route_scale must be finite");
}

void router_forward(int32_t* indices, float* weights, const float* logits, const float* bias,
                    const RouterShape& shape, cudaStream_t stream) {
  check_router_shape(shape);
  REPLAY_REQUIRE(indices != nullptr && weights != nullptr && logits != nullptr,
                 "router_forward needs indices, weights and logits");
  with_per_lane(shape.experts, [&](auto P) {
    router_forward_kernel<P.value><<<token_blocks(shape.tokens), kThreads, 0, stream>>>(
        indices, weights, logits, bias, shape.tokens, shape.experts, shape.groups,
        shape.topk_groups, shape.topk, shape.route_scale);
    REPLAY_LAUNCH_CHECK();
  });
}

void router_backward(float* dlogits, const float* dweights, const float* logits,
                     const int32_t* indices, const RouterShape& shape, bool accumulate,
                     cudaStream_t stream) {
  check_router_shape(shape);
  REPLAY_REQUIRE(dlogits != nullptr && dweights != nullptr && logits != nullptr && indices,
                 "router_backward needs dlogits, dweights, logits and indices");
  router_backward_kernel<<<token_blocks(shape.tokens), kThreads, 0, stream>>>(
      dlogits, dweights, logits, indices, shape.tokens, shape.experts, shape.topk,
      shape.route_scale, accumulate);
  REPLAY_LAUNCH_CHECK();
}

void moe_count_experts(int32_t* load, const int32_t* indices, int64_t tokens, int topk, int experts,
                       bool accumulate, cudaStream_t stream) {
  check_experts(tokens, experts, topk);
  REPLAY_REQUIRE(load != nullptr && indices != nullptr, "moe_count_experts needs load, indices");
  count_experts_kernel<<<1, kCountThreads, 0, stream>>>(load, indices, tokens * topk, experts,
                                                        accumulate);
  REPLAY_LAUNCH_CHECK();
}

void router_bias_update(float* bias, int32_t* load, int experts, float rate, bool reset_load,
                        cudaStream_t stream) {
  REPLAY_REQUIRE(experts >= 1 && experts <= kMoeMaxExperts, "experts must be in [1, 512]");
  REPLAY_REQUIRE(bias != nullptr && load != nullptr, "router_bias_update needs bias and load");
  REPLAY_REQUIRE(std::isfinite(rate), "the bias update rate must be finite");
  bias_update_kernel<<<1, expert_threads(experts), 0, stream>>>(bias, load, experts, rate,
                                                                reset_load);
  REPLAY_LAUNCH_CHECK();
}

size_t router_aux_loss_workspace_bytes(const AuxLossShape& shape) {
  REPLAY_REQUIRE(shape.seq_len >= 1 && shape.tokens >= 1 && shape.experts >= 1,
                 "auxiliary loss shape must be positive");
  return aux_layout(shape, nullptr, nullptr);
}

void router_aux_loss_forward(float* loss, const float* logits, const int32_t* indices,
                             const AuxLossShape& shape, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  check_aux(shape, workspace, workspace_bytes);
  REPLAY_REQUIRE(loss != nullptr && logits != nullptr && indices != nullptr,
                 "router_aux_loss_forward needs loss, logits and indices");
  AuxWorkspace ws{};
  aux_layout(shape, workspace, &ws);
  const int E = shape.experts;
  with_per_lane(E, [&](auto P) {
    aux_rows_kernel<P.value>
        <<<token_blocks(shape.tokens), kThreads, 0, stream>>>(ws.rz, logits, shape.tokens, E);
    REPLAY_LAUNCH_CHECK();
  });
  const int64_t parts = aux_parts(shape);
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(shape.sequences()));
  aux_partials_kernel<<<grid, expert_threads(E), 0, stream>>>(ws, logits, indices, shape.seq_len, E,
                                                              shape.topk, parts);
  REPLAY_LAUNCH_CHECK();
  aux_finalize_kernel<<<1, expert_threads(E), 0, stream>>>(
      loss, ws, shape.sequences(), shape.seq_len, E, shape.topk, parts, shape.coeff);
  REPLAY_LAUNCH_CHECK();
}

void router_aux_loss_backward(float* dlogits, const float* dloss, const float* logits,
                              const AuxLossShape& shape, bool accumulate, const void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  check_aux(shape, workspace, workspace_bytes);
  REPLAY_REQUIRE(dlogits != nullptr && logits != nullptr,
                 "router_aux_loss_backward needs dlogits and logits");
  AuxWorkspace ws{};
  aux_layout(shape, const_cast<void*>(workspace), &ws);  // the backward only reads it
  const float g_scale =
      shape.coeff / (static_cast<float>(shape.sequences()) * static_cast<float>(shape.seq_len));
  with_per_lane(shape.experts, [&](auto P) {
    aux_backward_kernel<P.value><<<token_blocks(shape.tokens), kThreads, 0, stream>>>(
        dlogits, dloss, logits, ws, shape.tokens, shape.seq_len, shape.experts, g_scale,
        accumulate);
    REPLAY_LAUNCH_CHECK();
  });
}

}  // namespace replay::moe
