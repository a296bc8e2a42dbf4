// idle.cu: a low-power wait on the device (see timing.h, gpu_idle).
#include "common/bench/timing.h"
#include "common/check.h"

namespace replay::bench {
namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread polls the global timer, sleeping between reads: one SM barely awake, the rest idle.
__global__ void idle_kernel(unsigned long long ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < ns) __nanosleep(10000);
}

}  // namespace

void gpu_idle(cudaStream_t stream, double ms) {
  REPLAY_REQUIRE(ms >= 0 && ms <= 60e3, "idle time must be in [0, 60 s]");
  if (ms == 0) return;
  idle_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(ms * 1e6));
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::bench
