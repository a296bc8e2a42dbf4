// diffusion.h: the Stable Diffusion v2 training objective on the device (issue 28): the DDPM noise
// schedule, latents sampled from the stored VAE moments, a timestep and Gaussian noise per sample
// drawn from a graph-layer Philox slot, the noised latent and the v-prediction target, the mean
// squared error with its gradient, and the sinusoidal timestep embedding. fp32 math; the UNet's
// tensors in 16-bit storage, NHWC. fp64 CPU references: diffusion_reference.h.
//
// Schedule (1000 steps). beta_t = (sqrt(0.00085) + (sqrt(0.012) - sqrt(0.00085)) * t / 999)^2,
// t = 0 .. 999: linear in sqrt(beta), what diffusers calls "scaled_linear" and what the MLPerf
// reference's ldm make_beta_schedule("linear", linear_start 0.00085, linear_end 0.012) computes
// (it also squares a linspace of square roots; the "linear beta 0.00085 to 0.012" is that
// schedule, not betas linear in t). alphas_cumprod[t] = prod_{s <= t} (1 - beta_s), in fp64;
// alphas_cumprod[0] = 0.99915 and sqrt(alphas_cumprod[999]) = 0.068265 (Lin et al. 2023, the
// signal SD keeps at its last step). The device table holds a_t = sqrt(acp_t) and
// b_t = sqrt(1 - acp_t) as fp32, computed in fp64 by diffusion_schedule_init once at set-up.
//
// One training sample (the MLPerf reference's LatentDiffusion.p_losses with parameterization "v"):
//   moments   [2C, H, W] fp16 (NCHW, as the VAE emits them and the data file stores them):
//             channels 0 .. C-1 the posterior mean, C .. 2C-1 its log-variance
//   t         uniform in [0, 1000)
//   latent    = (mean + exp(0.5 * clamp(logvar, -30, 20)) * eps1) * 0.18215   (the clamp is the
//               VAE's DiagonalGaussianDistribution's)
//   noisy     = a_t * latent + b_t * noise          -> the UNet's input, NHWC, storage type
//   v_target  = a_t * noise - b_t * latent          -> fp32 NHWC: it only feeds the loss, 64 KiB a
//               sample, and fp32 keeps the target from being rounded before the subtraction
//   loss      = mean over the batch's N * H * W * C elements of (pred - v_target)^2
// eps1 and noise are independent standard normals per element.
//
// The draws. diffusion_sample owns kDiffusionRngPositions consecutive Philox positions per call:
// P = slot->offset + rng.op_offset (register the op with that many positions), read on the device
// at run time, so a captured launch draws new numbers at every replay (RngTracker::advance moves
// the slot) and an eager launch at the same step draws the same ones. With g = first_sample + n the
// sample's index in the step's global batch and e = ((g * H + h) * W + w) * C + c the element's
// index in that batch, NHWC:
//   t_n        = (philox_block(seed, P, g).x * 1000) >> 32   (diffusion_timestep_from_bits)
//   eps1[e]    = normal(P + 1, e),   noise[e] = normal(P + 2, e)
//   normal(p, e): component e % 4 of the Box-Muller transform of philox_block(seed, p, e / 4),
//   (x, y, z, w) -> (r(x) cos(2 pi u(y)), r(x) sin(2 pi u(y)), r(z) cos(2 pi u(w)),
//   r(z) sin(2 pi u(w))), r(v) = sqrt(-2 ln u(v)), u = philox_uniform (in (0, 1], so ln is finite)
// Numbering by the global sample makes the draws independent of how a step is split: rank r of D
// data-parallel ranks passes first_sample = r * micro_batch (with gradient accumulation,
// micro-batch k passes (k * D + r) * micro_batch: any numbering that gives each sample of the step
// its own index), and together they draw what one GPU running the whole global batch draws. An
// evaluation that must see the same noisy inputs every time passes a slot that is never advanced
// (or restored before each evaluation).
//
// Requirements: dtype kFP16 or kBF16 (the UNet's storage); C * H * W a multiple of 4; every pointer
// 16-byte aligned (arena buffers are 256-byte aligned). Launchers only enqueue work on `stream`: no
// allocation, no synchronization, no host read of device memory; scalars that change between steps
// (the RNG slot, the loss scale) are read through device pointers, so every launch can be captured.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/philox.h"
#include "common/tensor.h"

namespace replay::unet {

inline constexpr int kTrainTimesteps = 1000;
inline constexpr double kBetaStart = 0.00085;
inline constexpr double kBetaEnd = 0.012;
inline constexpr float kLatentScale = 0.18215f;  // the SD VAE's scale factor
inline constexpr float kLogvarMin = -30.0f;      // DiagonalGaussianDistribution's clamp
inline constexpr float kLogvarMax = 20.0f;
inline constexpr uint64_t kDiffusionRngPositions = 3;  // t, eps1, noise
inline constexpr int kTimestepChannels = 320;          // SD2: the UNet's base width

// The timestep of 32 random bits: floor(bits * 1000 / 2^32), uniform over [0, 1000) to within
// 2^-32 (a multiply and a shift: the same integer on host and device).
REPLAY_HOST_DEVICE int32_t diffusion_timestep_from_bits(uint32_t bits) {
  return static_cast<int32_t>((static_cast<uint64_t>(bits) * kTrainTimesteps) >> 32);
}

// The schedule table: [2][kTrainTimesteps] fp32, row 0 a_t = sqrt(alphas_cumprod[t]), row 1
// b_t = sqrt(1 - alphas_cumprod[t]).
inline constexpr size_t kScheduleTableFloats = 2 * static_cast<size_t>(kTrainTimesteps);
inline constexpr size_t kScheduleTableBytes = kScheduleTableFloats * sizeof(float);

// Fills the table (one small kernel, fp64 math). Once at set-up, before the first step; it is a
// pure function of nothing, so capturing it is allowed but pointless.
void diffusion_schedule_init(float* table, cudaStream_t stream);

// The latents of one batch. channels is C (4 for SD), height and width the latent's (64 for SD's
// 512 x 512 images).
struct LatentShape {
  int64_t batch = 1;
  int channels = 4;
  int64_t height = 64, width = 64;

  int64_t pixels() const { return height * width; }
  int64_t sample_elements() const { return pixels() * channels; }
  int64_t elements() const { return batch * sample_elements(); }
};

// Throws Error naming the shape when it breaks the requirements above.
void check_latent_shape(const LatentShape& s);

// Samples one batch (see the definition above). moments: [N, 2C, H, W] fp16, the batch as the data
// file stores it. Writes noisy [N, H, W, C] in `dtype`, v_target [N, H, W, C] fp32, timesteps [N]
// int32 (for the timestep embedding). table: diffusion_schedule_init's.
void diffusion_sample(DType dtype, void* noisy, float* v_target, int32_t* timesteps,
                      const __half* moments, const float* table, const LatentShape& s,
                      int64_t first_sample, RngArgs rng, cudaStream_t stream);

// Workspace of mse_loss_forward: per-tile partial sums, 4 bytes each (1 KiB at N = 64 of SD's
// latents: 4 tiles of 4096 elements a sample). A pure function of the shape.
size_t mse_loss_workspace_bytes(const LatentShape& s);

// loss[0] = mean over all elements of (pred - target)^2, fp32; sample_loss[n] (when not null) the
// mean over sample n's elements. pred [N, H, W, C] in `dtype` (the UNet's output), target fp32 (the
// v-target). Deterministic: each sample is cut into tiles of a fixed size, each tile summed by one
// block in a fixed order, the tiles and samples added in index order by a one-block kernel; no
// atomics.
void mse_loss_forward(DType dtype, float* loss, float* sample_loss, const void* pred,
                      const float* target, const LatentShape& s, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// dpred = 2 * (pred - target) * dloss[0] / (N * H * W * C), in `dtype`. dloss is a device scalar:
// 1, or the dynamic loss scale under fp16 (train::StepIO::loss_scale), so the same captured launch
// scales by whatever the scale is at each replay. dpred may alias pred.
void mse_loss_backward(DType dtype, void* dpred, const void* pred, const float* target,
                       const float* dloss, const LatentShape& s, cudaStream_t stream);

// The sinusoidal timestep embedding, diffusers' get_timestep_embedding with SD2's configuration
// (UNet2DConditionModel defaults, also SD2's config.json: flip_sin_to_cos = true, freq_shift = 0;
// the same as the ldm UNet's timestep_embedding). For channel i of `channels` (even), half =
// channels / 2, j = i mod half:
//   freq_j = exp(-ln(max_period) * j / (half - freq_shift)),  arg = t * freq_j
//   out[n, i] = cos(arg) for i < half, sin(arg) otherwise        (flip_sin_to_cos)
//             = sin(arg) for i < half, cos(arg) otherwise        (otherwise)
// computed in fp32 in diffusers' order (the exponent, the division, exp, the product, sin or cos,
// each rounded to fp32), so the output matches diffusers' to an ulp or two of fp32 before
// rounding to the storage type. out [N, channels] in kFP16, kBF16 or kFP32. Forward only: t is an
// input, nothing before it learns.
struct TimestepEmbeddingConfig {
  int channels = kTimestepChannels;
  bool flip_sin_to_cos = true;
  float freq_shift = 0.0f;
  float max_period = 10000.0f;
};
void timestep_embedding(DType dtype, void* out, const int32_t* timesteps, int64_t batch,
                        const TimestepEmbeddingConfig& config, cudaStream_t stream);

}  // namespace replay::unet
