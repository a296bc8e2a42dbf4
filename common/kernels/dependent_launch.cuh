// dependent_launch.cuh: programmatic dependent launch (sm_90+) for a small kernel that consumes
// what the kernel before it in the stream wrote: launch_dependent() on the host,
// allow_dependent_launch() and wait_for_previous_grid() on the device.
//
// A kernel launched with launch_dependent() may be placed on the SMs before the kernel ahead of it
// has finished, once every block of that one has called allow_dependent_launch() (or exited). It
// calls wait_for_previous_grid() before it touches memory; that returns when the kernel ahead has
// finished and its writes are visible. The launch latency of a small second pass (microseconds,
// against a 30-60 us GPT-3-sized backward) then hides under the first kernel's tail. Both device
// calls are no-ops when no dependent launch is involved, and stream capture records the
// dependency as a programmatic graph edge, so eager and graphed runs behave alike.
#pragma once

#include <cuda_runtime.h>

#include "common/check.h"

namespace replay {

// Called by every block of a kernel whose successor may be a dependent launch.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Called by a dependent-launched kernel before its first memory access.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel` on `stream` as a programmatic dependent of the kernel before it. The caller
// checks the launch (REPLAY_LAUNCH_CHECK).
template <typename... Params, typename... Args>
inline void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                             Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  REPLAY_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

}  // namespace replay
