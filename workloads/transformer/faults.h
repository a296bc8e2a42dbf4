// faults.h: FaultInjector, the hook behind --inject: one planted CUDA-graph bug inside one region
// of the transformer step (exercises/README.md, "Fault injection in the workloads"). The hook only
// plants; the graph layer's own diagnostics (capture-fault classification, the argument check
// before each replay, --verify-graphs) detect and name it. Every planted kernel is one block
// touching four floats.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "graphs/step_plan.h"

namespace replay::transformer {

enum class Fault {
  kNone,
  kHostSync,        // cudaStreamSynchronize in the region (guide C1)
  kMalloc,          // cudaMalloc + cudaFree in the region (C2, M8)
  kScalarByValue,   // a host step counter passed to a kernel by value (N4)
  kRngByValue,      // a Philox draw given seed and offset by value (C14)
  kStaleInput,      // the region's input re-pointed after capture (N3)
  kUnjoinedStream,  // a side stream forked in the region and never joined (C5)
  kLegacyStream,    // a kernel launched on the legacy default stream (C7, N11)
};

// The Fault an --inject value names (bench::injectable_faults()); "" is kNone; else throws Error.
Fault parse_fault(const std::string& name);

class FaultInjector {
 public:
  // The region the fault is planted in (the first layer's forward of the first micro-batch).
  static constexpr const char* kRegion = "layer0.fwd";

  // Set-up, outside any capture: the probe and input buffers, and for unjoined-stream the side
  // stream and its fork event. `seed` feeds rng-by-value. Synchronizes.
  FaultInjector(Fault fault, uint64_t seed);
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  Fault fault() const { return fault_; }

  // Adds the planted operation's arguments to the region's: "fault.probe" (written: the four floats
  // the planted kernel writes, so --verify-graphs compares them) and, for stale-input,
  // "fault.input" (read), which each call hands out as the other of two identical buffers (a
  // double-buffered input).
  void add_args(graphs::RegionArgs& args);
  // Enqueues the planted operation at the end of the region's work on `stream`; `args` are the
  // region's arguments of this run (those add_args contributed among them).
  void enqueue(cudaStream_t stream, const graphs::RegionArgs& args);

 private:
  Fault fault_;
  uint64_t seed_;
  float* buffers_ = nullptr;  // probe [4], input A [4], input B [4]
  int64_t host_counter_ = 0;  // scalar-by-value's step and rng-by-value's offset, kept on the host
  int64_t args_calls_ = 0;    // stale-input: which input buffer add_args hands out
  cudaStream_t side_ = nullptr;  // unjoined-stream
  cudaEvent_t fork_ = nullptr;
};

}  // namespace replay::transformer
