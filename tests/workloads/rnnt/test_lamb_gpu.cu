// LAMB (common/optim/lamb.h), RNN-T's optimizer, against an fp64 CPU reference: three steps over a
// table of tensors of ragged sizes (several chunks, a tensor without weight decay, a zero tensor
// whose trust ratio falls back to 1, fp16, bf16 and fp32 model copies), the gradient scale and the
// learning rate read on the device; a no-op step touches nothing; reruns are bitwise identical.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/check.h"
#include "common/optim/lamb.h"

namespace replay {
namespace {

struct RefTensor {
  std::vector<double> w, m, v;
  bool wd = true;
};

// One LAMB step in fp64 (lamb.h's formulas).
void lamb_reference(std::vector<RefTensor>& ts, const std::vector<std::vector<float>>& grads,
                    const LambHyper& h, double lr, int64_t step, double grad_scale) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(step));
  for (size_t k = 0; k < ts.size(); ++k) {
    RefTensor& t = ts[k];
    const size_t n = t.w.size();
    std::vector<double> u(n);
    double ww = 0, uu = 0;
    for (size_t i = 0; i < n; ++i) {
      const double g = grads[k][i] * grad_scale;
      t.m[i] = h.beta1 * t.m[i] + (1.0 - h.beta1) * g;
      t.v[i] = h.beta2 * t.v[i] + (1.0 - h.beta2) * g * g;
      u[i] = (t.m[i] / bc1) / (std::sqrt(t.v[i] / bc2) + h.eps) +
             (t.wd ? h.weight_decay : 0.0) * t.w[i];
      ww += t.w[i] * t.w[i];
      uu += u[i] * u[i];
    }
    const double r = (ww > 0 && uu > 0) ? std::sqrt(ww) / std::sqrt(uu) : 1.0;
    for (size_t i = 0; i < n; ++i) t.w[i] -= lr * r * u[i];
  }
}

TEST(Lamb, ThreeStepsMatchTheFp64ReferenceAndRerunsAreBitwise) {
  const std::vector<int64_t> sizes = {40000, 1000, 7, 16384, 333};
  const std::vector<DType> models = {DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP16,
                                     DType::kFP16};
  const LambHyper h;
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  // One buffer per kind, tensors at 16-element offsets.
  std::vector<int64_t> off;
  int64_t end = 0;
  for (int64_t n : sizes) {
    off.push_back(end);
    end += (n + 15) / 16 * 16;
  }
  std::vector<float> w(static_cast<size_t>(end), 0.0f);
  std::vector<RefTensor> ref(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    ref[k].wd = k != 1;
    for (int64_t i = 0; i < sizes[k]; ++i) {
      const float x = k == 2 ? 0.0f : 0.1f * nd(gen);  // tensor 2 starts at zero: ratio 1
      w[static_cast<size_t>(off[k] + i)] = x;
      ref[k].w.push_back(x);
    }
    ref[k].m.assign(static_cast<size_t>(sizes[k]), 0.0);
    ref[k].v.assign(static_cast<size_t>(sizes[k]), 0.0);
  }
  float *dw, *dg, *dm, *dv, *scalars;
  void* dmodel;
  int64_t* dstep;
  int32_t* dnoop;
  const size_t fb = static_cast<size_t>(end) * sizeof(float);
  REPLAY_CUDA_CHECK(cudaMalloc(&dw, fb));
  REPLAY_CUDA_CHECK(cudaMalloc(&dg, fb));
  REPLAY_CUDA_CHECK(cudaMalloc(&dm, fb));
  REPLAY_CUDA_CHECK(cudaMalloc(&dv, fb));
  REPLAY_CUDA_CHECK(cudaMalloc(&dmodel, fb));
  REPLAY_CUDA_CHECK(cudaMalloc(&scalars, 2 * sizeof(float)));
  REPLAY_CUDA_CHECK(cudaMalloc(&dstep, sizeof(int64_t)));
  REPLAY_CUDA_CHECK(cudaMalloc(&dnoop, sizeof(int32_t)));
  REPLAY_CUDA_CHECK(cudaMemcpy(dw, w.data(), fb, cudaMemcpyHostToDevice));
  REPLAY_CUDA_CHECK(cudaMemset(dm, 0, fb));
  REPLAY_CUDA_CHECK(cudaMemset(dv, 0, fb));
  REPLAY_CUDA_CHECK(cudaMemset(dnoop, 0, sizeof(int32_t)));
  // The model copies hold 2- or 4-byte words in 4-byte slots, padded: the downloads read it all.
  REPLAY_CUDA_CHECK(cudaMemset(dmodel, 0, fb));
  AdamWTableBuilder b;
  for (size_t k = 0; k < sizes.size(); ++k) {
    void* model = static_cast<char*>(dmodel) + off[k] * 4;  // 4 bytes a slot whatever the type
    TensorView mv(model, models[k], {sizes[k]});
    b.add(dw + off[k], mv, dg + off[k], dm + off[k], dv + off[k], sizes[k], ref[k].wd);
  }
  void* table_mem;
  REPLAY_CUDA_CHECK(cudaMalloc(&table_mem, b.device_bytes()));
  const AdamWTable table = b.build(table_mem, b.device_bytes(), nullptr);
  const size_t wsb = lamb_workspace_bytes(table.num_chunks, table.num_tensors);
  EXPECT_LE(wsb, lamb_workspace_bound(total, static_cast<int64_t>(sizes.size())));
  void* ws;
  REPLAY_CUDA_CHECK(cudaMalloc(&ws, wsb));

  const float lr = 0.01f, gscale = 0.5f;
  const float host_scalars[2] = {lr, gscale};
  REPLAY_CUDA_CHECK(
      cudaMemcpy(scalars, host_scalars, sizeof(host_scalars), cudaMemcpyHostToDevice));
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> grads(sizes.size());
    std::vector<float> g(static_cast<size_t>(end), 0.0f);
    for (size_t k = 0; k < sizes.size(); ++k)
      for (int64_t i = 0; i < sizes[k]; ++i) {
        const float x = nd(gen);
        grads[k].push_back(x);
        g[static_cast<size_t>(off[k] + i)] = x;
      }
    REPLAY_CUDA_CHECK(cudaMemcpy(dg, g.data(), fb, cudaMemcpyHostToDevice));
    REPLAY_CUDA_CHECK(cudaMemcpy(dstep, &step, sizeof(step), cudaMemcpyHostToDevice));
    lamb_step(table, h, scalars, dstep, scalars + 1, dnoop, ws, wsb, nullptr);
    lamb_reference(ref, grads, h, lr, step, gscale);
  }
  std::vector<float> got(static_cast<size_t>(end));
  REPLAY_CUDA_CHECK(cudaMemcpy(got.data(), dw, fb, cudaMemcpyDeviceToHost));
  std::vector<char> model_bytes(fb);
  REPLAY_CUDA_CHECK(cudaMemcpy(model_bytes.data(), dmodel, fb, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (size_t k = 0; k < sizes.size(); ++k)
    for (int64_t i = 0; i < sizes[k]; ++i) {
      const double r = ref[k].w[static_cast<size_t>(i)];
      const float x = got[static_cast<size_t>(off[k] + i)];
      const double err = std::fabs(x - r) / (std::fabs(r) + 1e-3);
      worst = std::max(worst, err);
      ASSERT_LT(err, 2e-4) << "tensor " << k << " element " << i << ": " << x << " vs " << r;
    }
  // The model copies are the master weights rounded to their types.
  for (size_t k = 0; k < sizes.size(); ++k) {
    const char* base = model_bytes.data() + off[k] * 4;
    for (int64_t i = 0; i < sizes[k]; ++i) {
      const float x = got[static_cast<size_t>(off[k] + i)];
      if (models[k] == DType::kFP16) {
        __half hv;
        std::memcpy(&hv, base + i * 2, 2);
        ASSERT_EQ(__half2float(hv), __half2float(__float2half_rn(x))) << k << " " << i;
      } else if (models[k] == DType::kBF16) {
        __nv_bfloat16 bv;
        std::memcpy(&bv, base + i * 2, 2);
        ASSERT_EQ(__bfloat162float(bv), __bfloat162float(__float2bfloat16_rn(x))) << k << " " << i;
      } else {
        float fv;
        std::memcpy(&fv, base + i * 4, 4);
        ASSERT_EQ(fv, x) << k << " " << i;
      }
    }
  }
  std::printf("LAMB: 3 steps, worst relative error %.3g against fp64\n", worst);

  // A no-op step touches nothing.
  const int32_t one = 1;
  REPLAY_CUDA_CHECK(cudaMemcpy(dnoop, &one, sizeof(one), cudaMemcpyHostToDevice));
  lamb_step(table, h, scalars, dstep, scalars + 1, dnoop, ws, wsb, nullptr);
  std::vector<float> after(static_cast<size_t>(end));
  REPLAY_CUDA_CHECK(cudaMemcpy(after.data(), dw, fb, cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(after.data(), got.data(), fb));

  // A rerun from the same state gives the same bits.
  REPLAY_CUDA_CHECK(cudaMemset(dnoop, 0, sizeof(int32_t)));
  // The model copies hold 2- or 4-byte words in 4-byte slots, padded: the downloads read it all.
  REPLAY_CUDA_CHECK(cudaMemset(dmodel, 0, fb));
  std::vector<float> m0(static_cast<size_t>(end)), v0(static_cast<size_t>(end));
  REPLAY_CUDA_CHECK(cudaMemcpy(m0.data(), dm, fb, cudaMemcpyDeviceToHost));
  REPLAY_CUDA_CHECK(cudaMemcpy(v0.data(), dv, fb, cudaMemcpyDeviceToHost));
  std::vector<float> first(static_cast<size_t>(end)), second(static_cast<size_t>(end));
  for (int rep = 0; rep < 2; ++rep) {
    REPLAY_CUDA_CHECK(cudaMemcpy(dw, got.data(), fb, cudaMemcpyHostToDevice));
    REPLAY_CUDA_CHECK(cudaMemcpy(dm, m0.data(), fb, cudaMemcpyHostToDevice));
    REPLAY_CUDA_CHECK(cudaMemcpy(dv, v0.data(), fb, cudaMemcpyHostToDevice));
    lamb_step(table, h, scalars, dstep, scalars + 1, dnoop, ws, wsb, nullptr);
    REPLAY_CUDA_CHECK(
        cudaMemcpy(rep == 0 ? first.data() : second.data(), dw, fb, cudaMemcpyDeviceToHost));
  }
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), fb));
  for (void* p : {static_cast<void*>(dw), static_cast<void*>(dg), static_cast<void*>(dm),
                  static_cast<void*>(dv), dmodel, static_cast<void*>(scalars),
                  static_cast<void*>(dstep), static_cast<void*>(dnoop), table_mem, ws})
    cudaFree(p);
}

}  // namespace
}  // namespace replay
