// diffusion_reference.h: fp64 CPU references for the diffusion objective's kernels (diffusion.h),
// with their conventions: the schedule, the Philox draws (the same counters, so the same timesteps
// bit for bit and the same normals to within the kernels' fp32 math), latent sampling, noising and
// the v-target, the MSE loss and its gradient, the sinusoidal timestep embedding. Also the loss
// floor of data whose scaled latent is Gaussian given what the model sees. Naive loops: meant for
// test shapes and set-up, not for speed.
#pragma once

#include <cstdint>
#include <vector>

namespace replay::unet::ref {

// beta_t = (sqrt(start) + (sqrt(end) - sqrt(start)) * t / (steps - 1))^2, t = 0 .. steps - 1.
std::vector<double> betas(int steps = 1000, double start = 0.00085, double end = 0.012);
// alphas_cumprod[t] = prod_{s <= t} (1 - beta_s).
std::vector<double> alphas_cumprod(int steps = 1000, double start = 0.00085, double end = 0.012);

// The timestep of global sample g drawn at Philox position `position` (diffusion.h).
int32_t diffusion_timestep(uint64_t seed, uint64_t position, uint64_t g);
// Standard normal number e of the stream at `position` (Box-Muller of philox_block(seed, position,
// e / 4), component e % 4), in fp64 from the same 32-bit words the kernel uses.
double diffusion_normal(uint64_t seed, uint64_t position, uint64_t e);

// diffusion_sample (diffusion.h) in fp64. moments [N, 2C, H, W] (NCHW); writes timesteps [N],
// noisy and v_target [N, H, W, C] (NHWC), and, when not null, the scaled latent and the noise
// (NHWC) they were made from. `position` is slot offset + op_offset: the first of the op's three.
void diffusion_sample(int32_t* timesteps, double* noisy, double* v_target, double* latent,
                      double* noise, const double* moments, int64_t N, int C, int64_t H, int64_t W,
                      int64_t first_sample, uint64_t seed, uint64_t position);

// Mean of (pred - target)^2 over n elements; sample_loss (when not null) the mean over each of
// `batch` equal samples.
double mse_loss(const double* pred, const double* target, int64_t n, double* sample_loss = nullptr,
                int64_t batch = 1);
// dpred = 2 * (pred - target) * dloss / n.
void mse_loss_backward(double* dpred, const double* pred, const double* target, int64_t n,
                       double dloss);

// out [batch, channels] (channels even): diffusers' get_timestep_embedding in exact arithmetic.
void timestep_embedding(double* out, const int32_t* timesteps, int64_t batch, int channels,
                        bool flip_sin_to_cos = true, double freq_shift = 0.0,
                        double max_period = 10000.0);

// The lowest mean loss any model can reach when the scaled latent x0 is, element by element and
// given everything the model sees (the text), Gaussian with a known mean and variance tau2, and t
// is uniform over the schedule: the mean over t of
//   Var(v | z_t) = tau2 / (acp_t * tau2 + 1 - acp_t),   z_t = a_t x0 + b_t noise,
//   v = a_t noise - b_t x0
// (tau2 = 1 with nothing known: predicting v = 0 on unit-variance data scores exactly 1).
double gaussian_v_loss_floor(double tau2);

}  // namespace replay::unet::ref
