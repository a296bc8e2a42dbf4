// faults.h: the catalogue of CUDA-graph faults a training step can be given (--inject), and
// FaultInjector, which plants one of them inside one region of a step plan (exercises/README.md,
// "Fault injection in the workloads"). The injector only plants; the graph layer's own diagnostics
// (capture-fault classification, the argument check before each replay, --verify-graphs) detect
// and name it. Every planted kernel is one block touching four floats.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "graphs/step_plan.h"

namespace replay::graphs {

enum class Fault {
  kNone,
  kHostSync,            // cudaStreamSynchronize in the region (guide C1)
  kMalloc,              // cudaMalloc + cudaFree in the region (C2, M8)
  kScalarByValue,       // a host step counter passed to a kernel by value (N4)
  kRngByValue,          // a Philox draw given seed and offset by value (C14)
  kStaleInput,          // the region's input re-pointed after capture (N3)
  kUnjoinedStream,      // a side stream forked in the region and never joined (C5)
  kLegacyStream,        // a kernel launched on the legacy default stream (C7, N11)
  kCollectiveMismatch,  // data parallel: rank 1 captures one extra all-reduce (train/trainer.cpp)
  kRankStall,           // multi-GPU: rank 1 stops enqueuing before step 2 (train/trainer.cpp)
  kOverflow,            // step kOverflowStep's gradients made infinite (train/trainer.cpp)
};

// --inject overflow: the step (0-based, counted from the first timed step) whose gradients are made
// infinite, as an fp16 overflow would make them.
constexpr int64_t kOverflowStep = 2;

// One entry of the catalogue.
struct FaultInfo {
  Fault fault;
  const char* name;  // the --inject value: "host-sync-in-capture"
  const char* what;  // one line: the bug it plants and who detects it
};
// Every fault but kNone, in the order --inject help lists them.
const std::vector<FaultInfo>& fault_catalogue();
// The catalogue, one "  name  what" line each (`--inject help`, and a bad value's error).
std::string describe_faults();
// The Fault an --inject value names; "" is kNone; anything else throws Error listing the catalogue.
Fault parse_fault(const std::string& name);
const char* fault_name(Fault fault);  // "" for kNone

class FaultInjector {
 public:
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
  void add_args(RegionArgs& args);
  // Enqueues the planted operation at the end of the region's work on `stream`; `args` are the
  // region's arguments of this run (those add_args contributed among them).
  void enqueue(cudaStream_t stream, const RegionArgs& args);
  // --inject overflow (nothing for the other faults): a one-block kernel that sets the first four
  // gradients to +Inf when *iteration == kOverflowStep. The trainer calls it before the gradient
  // norm, whose found-inf check must then skip the update and back the loss scale off.
  void plant_overflow(float* grads, int64_t count, const int64_t* iteration,
                      cudaStream_t stream) const;

 private:
  Fault fault_;
  uint64_t seed_;
  float* buffers_ = nullptr;  // probe [4], input A [4], input B [4]
  int64_t host_counter_ = 0;  // scalar-by-value's step and rng-by-value's offset, kept on the host
  int64_t args_calls_ = 0;    // stale-input: which input buffer add_args hands out
  cudaStream_t side_ = nullptr;  // unjoined-stream
  cudaEvent_t fork_ = nullptr;
};

}  // namespace replay::graphs
