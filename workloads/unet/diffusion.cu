// diffusion.cu: the diffusion objective's kernels (diffusion.h): the schedule table, the sampling
// of noised latents and v-targets, the MSE loss and its gradient, the timestep embedding.
//
// These tensors are small next to the UNet's (a batch of 64 SD latents is 1M elements, 4 MB of
// fp32), so the kernels aim at plain coalesced access and fixed orders, not at bandwidth tricks:
// the sampling kernel gives a thread four consecutive NHWC elements (one Philox block of each
// normal stream), reads the NCHW moments with a stride of H * W between channels (consecutive
// threads read consecutive pixels, so each channel's reads are coalesced) and transposes to NHWC
// on the way; the loss sums fixed tiles per block and the tiles in index order in a second, single
// block; the embedding gives a thread one output.
#include "workloads/unet/diffusion.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/check.h"
#include "common/device_utils.cuh"

namespace replay::unet {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kLossTile = 4096;  // elements a block of the loss sums: 16 per thread
constexpr int kLossFinalizeThreads = 1024;

__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_float(bf16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

unsigned grid_for(int64_t work, int threads) {
  // A grid-stride loop covers the rest; the cap keeps the grid's x dimension legal.
  return static_cast<unsigned>(std::clamp<int64_t>((work + threads - 1) / threads, 1, 1 << 30));
}

// ---------------------------------------------------------------------------------------------------
// Schedule.

// Thread t multiplies out alphas_cumprod[t] in fp64. The explicit _rn intrinsics keep the compiler
// from fusing a multiply and an add into an FMA, so the table is what the host's plain fp64 loop
// gives, to within the final rounding to fp32.
__global__ void schedule_kernel(float* table) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= kTrainTimesteps) return;
  const double lo = sqrt(kBetaStart), hi = sqrt(kBetaEnd);
  const double step = __ddiv_rn(__dadd_rn(hi, -lo), static_cast<double>(kTrainTimesteps - 1));
  double acp = 1.0;
  for (int s = 0; s <= t; ++s) {
    const double root = __dadd_rn(lo, __dmul_rn(step, static_cast<double>(s)));
    acp = __dmul_rn(acp, __dadd_rn(1.0, -__dmul_rn(root, root)));
  }
  table[t] = static_cast<float>(sqrt(acp));
  table[kTrainTimesteps + t] = static_cast<float>(sqrt(__dadd_rn(1.0, -acp)));
}

// ---------------------------------------------------------------------------------------------------
// Sampling.

// Two standard normals from two 32-bit words (Box-Muller, see diffusion.h).
__device__ __forceinline__ void box_muller(uint32_t a, uint32_t b, float& n0, float& n1) {
  const float r = sqrtf(-2.0f * logf(philox_uniform(a)));
  float s, c;
  sincospif(2.0f * philox_uniform(b), &s, &c);
  n0 = r * c;
  n1 = r * s;
}

__device__ __forceinline__ void normals4(const Philox4& p, float (&n)[4]) {
  box_muller(p.x, p.y, n[0], n[1]);
  box_muller(p.z, p.w, n[2], n[3]);
}

// Thread q owns elements 4q .. 4q + 3 of the batch (NHWC), all in one sample since C * H * W is a
// multiple of 4.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sample_kernel(T* noisy, float* v_target, int32_t* timesteps, const __half* moments,
                  const float* table, int64_t batch, int C, int64_t pixels, int64_t first_sample,
                  RngArgs rng) {
  const PhiloxSlot slot = *rng.slot;  // read at run time: a graph replay sees the advanced offset
  const uint64_t position = slot.offset + rng.op_offset;
  const int64_t sample_elements = pixels * C;
  const int64_t quads = batch * sample_elements / 4;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = 4 * q;
    const int64_t n = e0 / sample_elements;
    const int64_t local = e0 - n * sample_elements;
    const uint64_t g = static_cast<uint64_t>(first_sample + n);
    const int32_t t = diffusion_timestep_from_bits(philox_block(slot.seed, position, g).x);
    if (local == 0) timesteps[n] = t;
    const float a = table[t], b = table[kTrainTimesteps + t];
    const uint64_t block =
        g * static_cast<uint64_t>(sample_elements / 4) + static_cast<uint64_t>(local / 4);
    float eps1[4], noise[4];
    normals4(philox_block(slot.seed, position + 1, block), eps1);
    normals4(philox_block(slot.seed, position + 2, block), noise);
    const __half* sample_moments = moments + n * 2 * sample_elements;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t l = local + j;
      const int64_t p = l / C;
      const int c = static_cast<int>(l - p * C);
      const float mean = __half2float(sample_moments[c * pixels + p]);
      const float logvar = __half2float(sample_moments[(C + c) * pixels + p]);
      const float stddev = expf(0.5f * fminf(fmaxf(logvar, kLogvarMin), kLogvarMax));
      const float latent = (mean + stddev * eps1[j]) * kLatentScale;
      noisy[e0 + j] = from_float<T>(a * latent + b * noise[j]);
      v_target[e0 + j] = a * noise[j] - b * latent;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// MSE loss.

// Block (tile, n): the squared errors of sample n's elements [tile * kLossTile, ...), thread t
// taking elements t, t + kThreads, ... of the tile; one partial per block.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mse_partial_kernel(float* partials, const T* pred, const float* target,
                       int64_t sample_elements) {
  __shared__ float scratch[32];
  const int64_t n = blockIdx.y;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kLossTile;
  const int64_t end = std::min<int64_t>(begin + kLossTile, sample_elements);
  const T* p = pred + n * sample_elements;
  const float* y = target + n * sample_elements;
  float sum = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float d = to_float(p[i]) - y[i];
    sum = fmaf(d, d, sum);
  }
  sum = block_sum_once(sum, scratch);
  if (threadIdx.x == 0) partials[n * gridDim.x + blockIdx.x] = sum;
}

// One block: thread k adds the tiles of samples k, k + blockDim.x, ... in tile order (a sample's
// sum), then the block adds the threads' sums in a fixed tree.
__global__ void __launch_bounds__(kLossFinalizeThreads)
    mse_finalize_kernel(float* loss, float* sample_loss, const float* partials, int64_t batch,
                        int tiles, int64_t sample_elements) {
  __shared__ float scratch[32];
  float total = 0.0f;
  for (int64_t n = threadIdx.x; n < batch; n += blockDim.x) {
    float s = 0.0f;
    for (int k = 0; k < tiles; ++k) s += partials[n * tiles + k];
    if (sample_loss) sample_loss[n] = s / static_cast<float>(sample_elements);
    total += s;
  }
  total = block_sum_once(total, scratch);
  if (threadIdx.x == 0)
    loss[0] = static_cast<float>(static_cast<double>(total) /
                                 static_cast<double>(batch * sample_elements));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mse_backward_kernel(T* dpred, const T* pred, const float* target, const float* dloss,
                        float two_over_count, int64_t count) {
  const float scale = dloss[0] * two_over_count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dpred[i] = from_float<T>((to_float(pred[i]) - target[i]) * scale);
}

// ---------------------------------------------------------------------------------------------------
// Timestep embedding.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    timestep_embedding_kernel(T* out, const int32_t* timesteps, int64_t batch, int channels,
                              bool flip, float neg_log_max_period, float denominator) {
  const int half = channels / 2;
  const int64_t count = batch * channels;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = k / channels;
    const int i = static_cast<int>(k - n * channels);
    const int j = i < half ? i : i - half;
    // diffusers: exponent = -ln(max_period) * arange(half) / (half - shift); exp; t * freq.
    const float exponent = (neg_log_max_period * static_cast<float>(j)) / denominator;
    const float arg = static_cast<float>(timesteps[n]) * expf(exponent);
    const bool first_half = i < half;
    const float v = (first_half == flip) ? cosf(arg) : sinf(arg);
    out[k] = from_float<T>(v);
  }
}

void check_storage(DType dtype, const char* op) {
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16,
                 std::string(op) + ": storage must be fp16 or bf16, got " + dtype_name(dtype));
}

int loss_tiles(const LatentShape& s) {
  return static_cast<int>((s.sample_elements() + kLossTile - 1) / kLossTile);
}

}  // namespace

void diffusion_schedule_init(float* table, cudaStream_t stream) {
  REPLAY_REQUIRE(table != nullptr, "diffusion_schedule_init: null table");
  schedule_kernel<<<(kTrainTimesteps + kThreads - 1) / kThreads, kThreads, 0, stream>>>(table);
  REPLAY_LAUNCH_CHECK();
}

void check_latent_shape(const LatentShape& s) {
  // The message is built only on failure: launchers call this on every step.
  auto shape = [&] {
    return "latent shape [N " + std::to_string(s.batch) + ", C " + std::to_string(s.channels) +
           ", H " + std::to_string(s.height) + ", W " + std::to_string(s.width) + "]";
  };
  REPLAY_REQUIRE(s.batch >= 1 && s.channels >= 1 && s.height >= 1 && s.width >= 1,
                 shape() + ": every dimension must be positive");
  REPLAY_REQUIRE(s.sample_elements() % 4 == 0,
                 shape() + ": C * H * W must be a multiple of 4 (a thread draws four normals)");
  REPLAY_REQUIRE(s.batch <= (int64_t{1} << 31) - 1, shape() + ": too many samples for one launch");
}

void diffusion_sample(DType dtype, void* noisy, float* v_target, int32_t* timesteps,
                      const __half* moments, const float* table, const LatentShape& s,
                      int64_t first_sample, RngArgs rng, cudaStream_t stream) {
  check_storage(dtype, "diffusion_sample");
  check_latent_shape(s);
  REPLAY_REQUIRE(noisy && v_target && timesteps && moments && table,
                 "diffusion_sample: null pointer");
  REPLAY_REQUIRE(rng.slot != nullptr,
                 "diffusion_sample: no RNG slot (register the op with the "
                 "RngTracker: kDiffusionRngPositions positions)");
  REPLAY_REQUIRE(first_sample >= 0, "diffusion_sample: negative first_sample");
  REPLAY_REQUIRE(aligned16(noisy) && aligned16(v_target) && aligned16(moments),
                 "diffusion_sample: noisy, v_target and moments must be 16-byte aligned");
  const unsigned grid = grid_for(s.elements() / 4, kThreads);
  if (dtype == DType::kFP16) {
    sample_kernel<__half><<<grid, kThreads, 0, stream>>>(static_cast<__half*>(noisy), v_target,
                                                         timesteps, moments, table, s.batch,
                                                         s.channels, s.pixels(), first_sample, rng);
  } else {
    sample_kernel<bf16><<<grid, kThreads, 0, stream>>>(static_cast<bf16*>(noisy), v_target,
                                                       timesteps, moments, table, s.batch,
                                                       s.channels, s.pixels(), first_sample, rng);
  }
  REPLAY_LAUNCH_CHECK();
}

size_t mse_loss_workspace_bytes(const LatentShape& s) {
  check_latent_shape(s);
  return static_cast<size_t>(s.batch) * static_cast<size_t>(loss_tiles(s)) * sizeof(float);
}

void mse_loss_forward(DType dtype, float* loss, float* sample_loss, const void* pred,
                      const float* target, const LatentShape& s, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  check_storage(dtype, "mse_loss_forward");
  check_latent_shape(s);
  REPLAY_REQUIRE(loss && pred && target && workspace, "mse_loss_forward: null pointer");
  REPLAY_REQUIRE(s.batch <= 65535, "mse_loss_forward: at most 65535 samples (grid y)");
  const size_t need = mse_loss_workspace_bytes(s);
  REPLAY_REQUIRE(workspace_bytes >= need, "mse_loss_forward: workspace of " +
                                              std::to_string(workspace_bytes) + " bytes, needs " +
                                              std::to_string(need));
  const int tiles = loss_tiles(s);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.batch));
  float* partials = static_cast<float*>(workspace);
  if (dtype == DType::kFP16) {
    mse_partial_kernel<__half><<<grid, kThreads, 0, stream>>>(
        partials, static_cast<const __half*>(pred), target, s.sample_elements());
  } else {
    mse_partial_kernel<bf16><<<grid, kThreads, 0, stream>>>(
        partials, static_cast<const bf16*>(pred), target, s.sample_elements());
  }
  REPLAY_LAUNCH_CHECK();
  mse_finalize_kernel<<<1, kLossFinalizeThreads, 0, stream>>>(loss, sample_loss, partials, s.batch,
                                                              tiles, s.sample_elements());
  REPLAY_LAUNCH_CHECK();
}

void mse_loss_backward(DType dtype, void* dpred, const void* pred, const float* target,
                       const float* dloss, const LatentShape& s, cudaStream_t stream) {
  check_storage(dtype, "mse_loss_backward");
  check_latent_shape(s);
  REPLAY_REQUIRE(dpred && pred && target && dloss, "mse_loss_backward: null pointer");
  const int64_t count = s.elements();
  const float two_over_count = static_cast<float>(2.0 / static_cast<double>(count));
  const unsigned grid = grid_for(count, kThreads);
  if (dtype == DType::kFP16) {
    mse_backward_kernel<__half><<<grid, kThreads, 0, stream>>>(
        static_cast<__half*>(dpred), static_cast<const __half*>(pred), target, dloss,
        two_over_count, count);
  } else {
    mse_backward_kernel<bf16><<<grid, kThreads, 0, stream>>>(static_cast<bf16*>(dpred),
                                                             static_cast<const bf16*>(pred), target,
                                                             dloss, two_over_count, count);
  }
  REPLAY_LAUNCH_CHECK();
}

void timestep_embedding(DType dtype, void* out, const int32_t* timesteps, int64_t batch,
                        const TimestepEmbeddingConfig& config, cudaStream_t stream) {
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16 || dtype == DType::kFP32,
                 std::string("timestep_embedding: output must be fp16, bf16 or fp32, got ") +
                     dtype_name(dtype));
  REPLAY_REQUIRE(out && timesteps, "timestep_embedding: null pointer");
  REPLAY_REQUIRE(batch >= 1, "timestep_embedding: batch must be positive");
  REPLAY_REQUIRE(config.channels >= 2 && config.channels % 2 == 0,
                 "timestep_embedding: channels must be even and positive, got " +
                     std::to_string(config.channels));
  const float denominator = static_cast<float>(config.channels / 2) - config.freq_shift;
  REPLAY_REQUIRE(denominator > 0.0f && config.max_period > 1.0f,
                 "timestep_embedding: needs half - freq_shift > 0 and max_period > 1");
  // diffusers multiplies the Python float -ln(max_period) into an fp32 tensor: rounded to fp32.
  const float neg_log = static_cast<float>(-std::log(static_cast<double>(config.max_period)));
  const unsigned grid = grid_for(batch * config.channels, kThreads);
  switch (dtype) {
    case DType::kFP16:
      timestep_embedding_kernel<__half><<<grid, kThreads, 0, stream>>>(
          static_cast<__half*>(out), timesteps, batch, config.channels, config.flip_sin_to_cos,
          neg_log, denominator);
      break;
    case DType::kBF16:
      timestep_embedding_kernel<bf16><<<grid, kThreads, 0, stream>>>(
          static_cast<bf16*>(out), timesteps, batch, config.channels, config.flip_sin_to_cos,
          neg_log, denominator);
      break;
    default:
      timestep_embedding_kernel<float><<<grid, kThreads, 0, stream>>>(
          static_cast<float*>(out), timesteps, batch, config.channels, config.flip_sin_to_cos,
          neg_log, denominator);
      break;
  }
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::unet
