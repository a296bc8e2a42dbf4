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
  kHostBranch,          // a host if/else chosen per step, frozen at capture (N1)
  kShapeChange,         // the region's input changes shape after capture (N5)
  kReplayOrder,         // two regions sharing scratch, the reader replayed before the writer (N14)
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
  // Regions the fault is planted in: 2 for replay-order (site 0 writes the shared scratch, site 1,
  // a later layer region, reads it), 1 for the others.
  int sites() const { return fault_ == Fault::kReplayOrder ? 2 : 1; }

  // Adds the planted operation's arguments to the region's (`site`: which of sites() regions):
  // "fault.probe" (written: the four floats the planted kernel writes, so --verify-graphs compares
  // them); for stale-input "fault.input" (read), which each call hands out as the other of two
  // identical buffers (a double-buffered input); for shape-change "fault.input" (read) with 4 and 8
  // elements on alternate calls (a variable-length batch); for replay-order "fault.scratch"
  // (read-write, the buffer both sites share).
  void add_args(RegionArgs& args, int site = 0);
  // Enqueues the planted operation at the end of the region's work on `stream`; `args` are the
  // region's arguments of this run (those add_args contributed among them).
  void enqueue(cudaStream_t stream, const RegionArgs& args, int site = 0);
  // --inject overflow (nothing for the other faults): a one-block kernel that sets the first four
  // gradients to +Inf when *iteration == kOverflowStep. The trainer calls it before the gradient
  // norm, whose found-inf check must then skip the update and back the loss scale off.
  void plant_overflow(float* grads, int64_t count, const int64_t* iteration,
                      cudaStream_t stream) const;

 private:
  Fault fault_;
  uint64_t seed_;
  float* buffers_ = nullptr;  // probe [4], input A [4], input B [4], scratch [4], input [8]
  int64_t host_counter_ = 0;  // scalar-by-value's step, rng-by-value's offset, host-branch's step
  int64_t args_calls_ = 0;    // stale-input: which input buffer; shape-change: which shape
  cudaStream_t side_ = nullptr;  // unjoined-stream
  cudaEvent_t fork_ = nullptr;
};

}  // namespace replay::graphs
