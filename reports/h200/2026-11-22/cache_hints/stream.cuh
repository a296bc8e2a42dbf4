// stream.cuh: what this folder's probes share. stream_us times `call` the way the suite's stream protocol does:
// one graph of 24 calls over 3 buffer sets (call(i % 3)), launched 14 times; the median of the last 12, in us a call.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);        \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

inline double stream_us(cudaStream_t s, const std::function<void(int)>& call) {
  const int calls = 24, sets = 3;
  cudaGraph_t g;
  cudaGraphExec_t ex;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) call(i % sets);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ex, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < 14; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ex, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(1e3 * ms / calls);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ex));
  CK(cudaGraphDestroy(g));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
