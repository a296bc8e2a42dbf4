// diffusion_reference.cpp: the fp64 references of diffusion.h's kernels.
#include "workloads/unet/diffusion_reference.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/philox.h"
#include "workloads/unet/diffusion.h"

namespace replay::unet::ref {

namespace {

constexpr double kPi = 3.14159265358979323846;

// Box-Muller of the words (a, b): the pair (r cos(2 pi u(b)), r sin(2 pi u(b))).
void box_muller(uint32_t a, uint32_t b, double& n0, double& n1) {
  const double r = std::sqrt(-2.0 * std::log(static_cast<double>(philox_uniform(a))));
  const double angle = 2.0 * kPi * static_cast<double>(philox_uniform(b));
  n0 = r * std::cos(angle);
  n1 = r * std::sin(angle);
}

}  // namespace

std::vector<double> betas(int steps, double start, double end) {
  REPLAY_REQUIRE(steps >= 2 && start > 0.0 && end > start, "betas: bad schedule");
  const double lo = std::sqrt(start), hi = std::sqrt(end);
  const double step = (hi - lo) / static_cast<double>(steps - 1);
  std::vector<double> b(static_cast<size_t>(steps));
  for (int t = 0; t < steps; ++t) {
    const double root = lo + step * static_cast<double>(t);
    b[static_cast<size_t>(t)] = root * root;
  }
  return b;
}

std::vector<double> alphas_cumprod(int steps, double start, double end) {
  const std::vector<double> b = betas(steps, start, end);
  std::vector<double> acp(b.size());
  double p = 1.0;
  for (size_t t = 0; t < b.size(); ++t) {
    p *= 1.0 - b[t];
    acp[t] = p;
  }
  return acp;
}

int32_t diffusion_timestep(uint64_t seed, uint64_t position, uint64_t g) {
  return diffusion_timestep_from_bits(philox_block(seed, position, g).x);
}

double diffusion_normal(uint64_t seed, uint64_t position, uint64_t e) {
  const Philox4 p = philox_block(seed, position, e / 4);
  double n[4];
  box_muller(p.x, p.y, n[0], n[1]);
  box_muller(p.z, p.w, n[2], n[3]);
  return n[e % 4];
}

void diffusion_sample(int32_t* timesteps, double* noisy, double* v_target, double* latent,
                      double* noise, const double* moments, int64_t N, int C, int64_t H, int64_t W,
                      int64_t first_sample, uint64_t seed, uint64_t position) {
  const int64_t HW = H * W, E = HW * C;
  REPLAY_REQUIRE(N >= 1 && C >= 1 && HW >= 1 && E % 4 == 0 && first_sample >= 0,
                 "ref::diffusion_sample: bad shape");
  const std::vector<double> acp = alphas_cumprod();
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t g = static_cast<uint64_t>(first_sample + n);
    const int32_t t = diffusion_timestep(seed, position, g);
    timesteps[n] = t;
    const double a = std::sqrt(acp[static_cast<size_t>(t)]);
    const double b = std::sqrt(1.0 - acp[static_cast<size_t>(t)]);
    for (int64_t p = 0; p < HW; ++p) {
      for (int c = 0; c < C; ++c) {
        const int64_t local = p * C + c;
        const uint64_t e = g * static_cast<uint64_t>(E) + static_cast<uint64_t>(local);
        const double mean = moments[(n * 2 * C + c) * HW + p];
        const double logvar = moments[(n * 2 * C + C + c) * HW + p];
        const double clamped = std::min(std::max(logvar, static_cast<double>(kLogvarMin)),
                                        static_cast<double>(kLogvarMax));
        const double eps1 = diffusion_normal(seed, position + 1, e);
        const double z = diffusion_normal(seed, position + 2, e);
        const double x0 =
            (mean + std::exp(0.5 * clamped) * eps1) * static_cast<double>(kLatentScale);
        const int64_t out = n * E + local;
        noisy[out] = a * x0 + b * z;
        v_target[out] = a * z - b * x0;
        if (latent) latent[out] = x0;
        if (noise) noise[out] = z;
      }
    }
  }
}

double mse_loss(const double* pred, const double* target, int64_t n, double* sample_loss,
                int64_t batch) {
  REPLAY_REQUIRE(n >= 1 && batch >= 1 && n % batch == 0, "ref::mse_loss: bad sizes");
  const int64_t per = n / batch;
  double total = 0.0;
  for (int64_t s = 0; s < batch; ++s) {
    double sum = 0.0;
    for (int64_t i = s * per; i < (s + 1) * per; ++i) {
      const double d = pred[i] - target[i];
      sum += d * d;
    }
    if (sample_loss) sample_loss[s] = sum / static_cast<double>(per);
    total += sum;
  }
  return total / static_cast<double>(n);
}

void mse_loss_backward(double* dpred, const double* pred, const double* target, int64_t n,
                       double dloss) {
  for (int64_t i = 0; i < n; ++i)
    dpred[i] = 2.0 * (pred[i] - target[i]) * dloss / static_cast<double>(n);
}

void timestep_embedding(double* out, const int32_t* timesteps, int64_t batch, int channels,
                        bool flip_sin_to_cos, double freq_shift, double max_period) {
  REPLAY_REQUIRE(channels >= 2 && channels % 2 == 0, "ref::timestep_embedding: odd channels");
  const int half = channels / 2;
  for (int64_t n = 0; n < batch; ++n) {
    for (int j = 0; j < half; ++j) {
      const double freq =
          std::exp(-std::log(max_period) * static_cast<double>(j) / (half - freq_shift));
      const double arg = static_cast<double>(timesteps[n]) * freq;
      const double first = flip_sin_to_cos ? std::cos(arg) : std::sin(arg);
      const double second = flip_sin_to_cos ? std::sin(arg) : std::cos(arg);
      out[n * channels + j] = first;
      out[n * channels + half + j] = second;
    }
  }
}

double gaussian_v_loss_floor(double tau2) {
  REPLAY_REQUIRE(tau2 >= 0.0, "ref::gaussian_v_loss_floor: negative variance");
  const std::vector<double> acp = alphas_cumprod();
  double sum = 0.0;
  for (double a2 : acp) sum += tau2 / (a2 * tau2 + 1.0 - a2);
  return sum / static_cast<double>(acp.size());
}

}  // namespace replay::unet::ref
