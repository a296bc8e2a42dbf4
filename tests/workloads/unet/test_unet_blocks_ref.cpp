// The fp64 residual block and spatial transformer (workloads/unet/block_reference.h) on the CPU:
// they are the blocks the GPU model builds (the same parameters, in ParamStore order and sizes, for
// the tiny preset's first residual block with a shortcut and its first transformer);
// every parameter's gradient, the input's and the timestep embedding's against central finite
// differences of the forward, with and without the residual block's 1x1 shortcut, self-attention
// over the pixels and cross-attention to a context longer and shorter than them; and the
// attention reference against identities (uniform scores average the values).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tests/support/compare.h"
#include "workloads/unet/block_reference.h"
#include "workloads/unet/unet_workload.h"

namespace replay::unet {
namespace {

using ref::Vec;
using test::dot;
using test::grad_close;
using test::numeric_grad;

Vec normal(size_t n, uint64_t seed, double mean = 0.0, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(mean, stddev);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// Random parameters (norm scales around 1) of the shapes in `p`.
template <typename P>
void randomize(P& p, uint64_t seed) {
  for (Vec* v : p.all()) {
    if (v->empty()) continue;
    *v = normal(v->size(), ++seed, 0.0, 0.4);
  }
}

TEST(UnetBlockRef, ResnetGradientsMatchFiniteDifferences) {
  for (const bool shortcut : {true, false}) {
    ref::ResnetDims d;
    d.N = 2, d.H = 3, d.W = 2, d.Cin = 4, d.Cout = shortcut ? 6 : 4, d.T = 5, d.G = 2;
    ref::ResnetParams p = ref::ResnetParams::shaped_like(d);
    randomize(p, shortcut ? 10 : 20);
    for (size_t c = 0; c < p.norm1_w.size(); ++c) p.norm1_w[c] += 1.0;
    for (size_t c = 0; c < p.norm2_w.size(); ++c) p.norm2_w[c] += 1.0;
    Vec x = normal(static_cast<size_t>(d.N * d.H * d.W * d.Cin), 31, 0.3, 1.5);
    Vec temb = normal(static_cast<size_t>(d.N * d.T), 32);
    const Vec w = normal(static_cast<size_t>(d.N * d.H * d.W * d.Cout), 33);
    Vec out;
    auto loss = [&] {
      ref::resnet_forward(out, d, p, x, temb);
      return dot(w, out);
    };
    loss();
    ref::ResnetParams g;
    Vec dx, dtemb;
    ref::resnet_backward(g, dx, dtemb, d, p, x, temb, w);
    const std::string at = shortcut ? " (1x1 shortcut)" : " (identity shortcut)";
    EXPECT_TRUE(grad_close("resnet dx" + at, dx, numeric_grad(x, loss), 1e-6));
    EXPECT_TRUE(grad_close("resnet dtemb" + at, dtemb, numeric_grad(temb, loss), 1e-6));
    const std::vector<Vec*> ps = p.all(), gs = g.all();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i]->empty()) continue;
      EXPECT_TRUE(grad_close("resnet parameter " + std::to_string(i) + at, *gs[i],
                             numeric_grad(*ps[i], loss), 1e-6));
    }
  }
}

TEST(UnetBlockRef, TransformerGradientsMatchFiniteDifferences) {
  for (const int64_t L : {3, 7}) {  // a context shorter and longer than the 4 pixels
    ref::TransformerDims d;
    d.N = 2, d.S = 4, d.C = 8, d.L = L, d.D = 6, d.heads = 2, d.G = 2;
    ref::TransformerParams p = ref::TransformerParams::shaped_like(d);
    randomize(p, 40 + static_cast<uint64_t>(L));
    for (Vec* v : {&p.norm_w, &p.ln1_w, &p.ln2_w, &p.ln3_w})
      for (double& s : *v) s += 1.0;
    Vec x = normal(static_cast<size_t>(d.N * d.S * d.C), 51, 0.2, 1.2);
    const Vec ctx = normal(static_cast<size_t>(d.N * d.L * d.D), 52);
    const Vec w = normal(x.size(), 53);
    Vec out;
    auto loss = [&] {
      ref::transformer_forward(out, d, p, x, ctx);
      return dot(w, out);
    };
    loss();
    ref::TransformerParams g;
    Vec dx;
    ref::transformer_backward(g, dx, d, p, x, ctx, w);
    const std::string at = " (context " + std::to_string(L) + ")";
    EXPECT_TRUE(grad_close("transformer dx" + at, dx, numeric_grad(x, loss), 1e-6));
    const std::vector<Vec*> ps = p.all(), gs = g.all();
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(grad_close("transformer parameter " + std::to_string(i) + at, *gs[i],
                             numeric_grad(*ps[i], loss), 1e-6));
  }
}

// The sizes of the model's parameters whose names start with `prefix`, in ParamStore order.
std::vector<int64_t> model_sizes(const UnetStructure& s, const std::string& prefix) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < s.parameter_names.size(); ++i)
    if (s.parameter_names[i].rfind(prefix, 0) == 0) out.push_back(s.parameter_sizes[i]);
  return out;
}
template <typename P>
std::vector<int64_t> reference_sizes(P& p) {
  std::vector<int64_t> out;
  for (Vec* v : p.all())
    if (!v->empty()) out.push_back(static_cast<int64_t>(v->size()));
  return out;
}

TEST(UnetBlockRef, ReferencesHaveTheModelsParametersInItsOrder) {
  const UnetConfig c = preset_config("tiny");
  const UnetStructure s = unet_structure(c);
  ref::ResnetDims rd;  // down_blocks.1.resnets.0: 32 -> 64 channels, with the 1x1 shortcut
  rd.Cin = c.channels(0), rd.Cout = c.channels(1), rd.T = c.time_dim(), rd.G = c.groups;
  ref::ResnetParams rp = ref::ResnetParams::shaped_like(rd);
  EXPECT_EQ(model_sizes(s, "down_blocks.1.resnets.0."), reference_sizes(rp));
  rd.Cin = rd.Cout;  // down_blocks.1.resnets.1: no shortcut
  rp = ref::ResnetParams::shaped_like(rd);
  EXPECT_EQ(model_sizes(s, "down_blocks.1.resnets.1."), reference_sizes(rp));
  ref::TransformerDims td;  // down_blocks.0.attentions.0
  td.C = c.channels(0), td.D = c.context_dim, td.L = c.context_len, td.G = c.groups;
  td.heads = c.channels(0) / c.head_dim;
  ref::TransformerParams tp = ref::TransformerParams::shaped_like(td);
  EXPECT_EQ(model_sizes(s, "down_blocks.0.attentions.0."), reference_sizes(tp));
}

TEST(UnetBlockRef, AttentionOfEqualKeysAveragesTheValues) {
  const int64_t N = 1, Sq = 3, Skv = 5, C = 4, heads = 2;
  const Vec q = normal(static_cast<size_t>(N * Sq * C), 61);
  const Vec k(static_cast<size_t>(N * Skv * C), 0.5);  // every key alike: uniform weights
  const Vec v = normal(static_cast<size_t>(N * Skv * C), 62);
  Vec o(static_cast<size_t>(N * Sq * C));
  ref::attention_forward(o.data(), q.data(), k.data(), v.data(), N, Sq, Skv, C, heads);
  for (int64_t i = 0; i < Sq; ++i)
    for (int64_t c = 0; c < C; ++c) {
      double mean = 0.0;
      for (int64_t j = 0; j < Skv; ++j) mean += v[static_cast<size_t>(j * C + c)] / Skv;
      EXPECT_NEAR(o[static_cast<size_t>(i * C + c)], mean, 1e-12);
    }
}

}  // namespace
}  // namespace replay::unet
