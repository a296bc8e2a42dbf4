// Which per-layer graphs make cudaGraphLaunch block the host? Each configuration captures the same ops
// into `graphs` graphs, then runs 12 steps that launch every graph once, the host up to two steps
// ahead of the GPU as replay's step loop runs it (after enqueuing step k it waits for step k - 2), and
// prints the host time each step's launches took. Ops: replay's cuDNN fused attention forward (GPT-3
// 175B TP4 shape) and backward, a cuBLASLt GEMM (2048 x 12288 x 12288 with bias), LayerNorm forward
// and backward and the dropout-residual forward and backward. Build: see build.sh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/attention.h"
#include "common/check.h"
#include "common/context.h"
#include "common/gemm.h"
#include "common/kernels/dropout.h"
#include "common/kernels/norms.h"

using namespace replay;
using bf16 = __nv_bfloat16;
using Op = std::function<void()>;

int main() {
  Context ctx(0);
  cudaStream_t s = ctx.stream();
  const int64_t M = 2048;
  const int C = 12288;
  auto dev = [](size_t bytes) {
    void* p = nullptr;
    REPLAY_CUDA_CHECK(cudaMalloc(&p, bytes));
    REPLAY_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
  };
  auto* x = static_cast<bf16*>(dev(M * C * 2));
  auto* y = static_cast<bf16*>(dev(M * C * 2));
  auto* z = static_cast<bf16*>(dev(M * C * 2));
  auto* w = static_cast<bf16*>(dev(size_t(C) * C * 2));
  auto* gamma = static_cast<bf16*>(dev(C * 2));
  auto* beta = static_cast<bf16*>(dev(C * 2));
  auto* bias = static_cast<bf16*>(dev(C * 2));
  auto* mean = static_cast<float*>(dev(M * 4));
  auto* rstd = static_cast<float*>(dev(M * 4));
  auto* dg = static_cast<float*>(dev(C * 4));
  auto* db = static_cast<float*>(dev(C * 4));
  std::vector<bf16> ones(size_t(M) * C, __float2bfloat16(1.0f));
  REPLAY_CUDA_CHECK(cudaMemcpy(x, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice));
  REPLAY_CUDA_CHECK(cudaMemcpy(rstd, std::vector<float>(M, 1.0f).data(), M * 4, cudaMemcpyHostToDevice));
  const size_t ln_ws = layernorm_backward_workspace_bytes(M, C);
  const size_t dr_ws = dropout_residual_backward_workspace_bytes(M, C);
  void* ws_ln = dev(ln_ws);
  void* ws_dr = dev(dr_ws);
  void* ws_gemm = dev(64 << 20);
  const RngArgs rng{static_cast<PhiloxSlot*>(dev(sizeof(PhiloxSlot))), 0};

  GemmDesc desc;
  desc.m = M, desc.n = C, desc.k = C, desc.trans_b = true, desc.epilogue = Epilogue::kBias;
  GemmPlan gemm(ctx.cublaslt(), desc);
  GemmArgs ga;
  ga.a = x, ga.b = w, ga.d = z, ga.bias = bias, ga.workspace = ws_gemm, ga.workspace_bytes = 64 << 20;

  AttentionCache cache;
  AttentionDesc ad;
  ad.heads_q = ad.heads_kv = 24, ad.seq_q = 2048, ad.head_dim_qk = 128, ad.causal = true;
  const AttentionPlan& attention = cache.get(ctx, ad);
  const size_t att_ws = cache.max_workspace_bytes();
  void* ws_att = dev(att_ws);
  const size_t qkv = size_t(2048) * 24 * 128 * 2;
  AttentionIO io;
  io.q = dev(qkv), io.k = dev(qkv), io.v = dev(qkv), io.o = dev(qkv);
  io.stats = static_cast<float*>(dev(24 * 2048 * 4));
  AttentionGrads grads;
  grads.d_o = dev(qkv), grads.dq = dev(qkv), grads.dk = dev(qkv), grads.dv = dev(qkv);

  const Op att_fwd = [&] { attention.forward(ctx, s, io, rng, ws_att, att_ws); };
  const Op att_bwd = [&] { attention.backward(ctx, s, io, grads, rng, ws_att, att_ws); };
  const Op mm = [&] { gemm.run(s, ga); };
  const Op ln_fwd = [&] { layernorm_forward(z, mean, rstd, x, gamma, beta, M, C, 1e-5f, s); };
  const Op ln_bwd = [&] { layernorm_backward(z, dg, db, y, x, gamma, mean, rstd, M, C, false, false, ws_ln, ln_ws, s); };
  const Op dr_fwd = [&] { dropout_residual_forward(z, x, bias, y, M, C, 0.1f, rng, s); };
  const Op dr_bwd = [&] { dropout_residual_backward(z, db, y, M, C, 0.1f, rng, false, ws_dr, dr_ws, s); };

  struct Config {
    std::string name;
    std::vector<Op> ops;
    int graphs;
    bool eager;
  };
  std::vector<Config> configs;
  for (int g : {2, 4, 6, 8, 10, 12, 16, 24}) configs.push_back({"attention fwd", {att_fwd}, g, false});
  configs.push_back({"attention fwd (eager)", {att_fwd}, 24, true});
  configs.push_back({"attention fwd + bwd", {att_fwd, att_bwd}, 16, false});
  configs.push_back({"attention fwd + 3 GEMMs", {att_fwd, mm, mm, mm}, 8, false});
  configs.push_back({"attention fwd + 3 GEMMs", {att_fwd, mm, mm, mm}, 12, false});
  configs.push_back({"3 GEMMs", {mm, mm, mm}, 16, false});
  configs.push_back({"3 GEMMs", {mm, mm, mm}, 48, false});
  configs.push_back({"LN fwd, GEMM, dropout fwd, LN bwd, GEMM, dropout bwd",
                     {ln_fwd, mm, dr_fwd, ln_bwd, mm, dr_bwd}, 16, false});
  configs.push_back({"12 x LN bwd", std::vector<Op>(12, ln_bwd), 48, false});

  const int steps = 12, lag = 2;
  std::vector<cudaEvent_t> ev(steps + 1);
  for (auto& e : ev) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
  for (const Config& c : configs) {
    for (const Op& op : c.ops) op();  // set-up outside capture (function attributes, plans)
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<cudaGraphExec_t> execs(c.eager ? 0 : c.graphs);
    for (auto& e : execs) {
      cudaGraph_t g;
      REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (const Op& op : c.ops) op();
      REPLAY_CUDA_CHECK(cudaStreamEndCapture(s, &g));
      REPLAY_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
      REPLAY_CUDA_CHECK(cudaGraphUpload(e, s));
      REPLAY_CUDA_CHECK(cudaGraphDestroy(g));
    }
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> host(steps);
    for (int k = 0; k < steps; ++k) {
      REPLAY_CUDA_CHECK(cudaEventRecord(ev[k], s));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < c.graphs; ++i) {
        if (c.eager) {
          for (const Op& op : c.ops) op();
        } else {
          REPLAY_CUDA_CHECK(cudaGraphLaunch(execs[i], s));
        }
      }
      host[k] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (k + 1 - lag >= 1) REPLAY_CUDA_CHECK(cudaEventSynchronize(ev[k + 1 - lag]));  // step k - lag is done
    }
    REPLAY_CUDA_CHECK(cudaEventRecord(ev[steps], s));
    REPLAY_CUDA_CHECK(cudaEventSynchronize(ev[steps]));
    float ms = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[steps - 1], ev[steps]));
    std::printf("%2d %s a step of [%s]: GPU %7.2f ms a step; host enqueue per step (ms):", c.graphs,
                c.eager ? "eager repeats" : "graphs", c.name.c_str(), ms);
    for (double h : host) std::printf(" %.2f", h);
    std::printf("\n");
    std::fflush(stdout);
    for (auto& e : execs) REPLAY_CUDA_CHECK(cudaGraphExecDestroy(e));
  }
  return 0;
}
