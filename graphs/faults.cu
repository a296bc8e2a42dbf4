// faults.cu: the fault catalogue, the planted faults of --inject and their one-block kernels.
#include "graphs/faults.h"

#include <cstdio>

#include "common/check.h"
#include "common/philox.h"

namespace replay::graphs {

namespace {

constexpr int kProbe = 4;  // floats the planted kernels write

// probe = value, broadcast: what a kernel that takes a changing scalar by value records.
__global__ void fault_store_value_kernel(float* probe, float value) {
  if (threadIdx.x < kProbe) probe[threadIdx.x] = value;
}

// probe = four uniforms drawn at (seed, offset), both passed by value.
__global__ void fault_draw_kernel(float* probe, uint64_t seed, uint64_t offset) {
  if (threadIdx.x == 0) {
    const Philox4 r = philox_block(seed, offset, 0);
    probe[0] = philox_uniform(r.x), probe[1] = philox_uniform(r.y);
    probe[2] = philox_uniform(r.z), probe[3] = philox_uniform(r.w);
  }
}

// probe = input + 1.
__global__ void fault_copy_kernel(float* probe, const float* input) {
  if (threadIdx.x < kProbe) probe[threadIdx.x] = input[threadIdx.x] + 1.0f;
}

// probe += 1: visible only where the kernel really ran.
__global__ void fault_count_kernel(float* probe) {
  if (threadIdx.x < kProbe) probe[threadIdx.x] += 1.0f;
}

// grads[0..count) = +Inf in the step whose iteration is `at`.
__global__ void fault_overflow_kernel(float* grads, int64_t count, const int64_t* iteration,
                                      int64_t at) {
  if (*iteration == at && threadIdx.x < count) grads[threadIdx.x] = __int_as_float(0x7f800000);
}

}  // namespace

const std::vector<FaultInfo>& fault_catalogue() {
  static const std::vector<FaultInfo> faults = {
      {Fault::kHostSync, "host-sync-in-capture",
       "cudaStreamSynchronize inside the region: capture refused (error 900, host sync)"},
      {Fault::kMalloc, "malloc-in-capture",
       "cudaMalloc/cudaFree inside the region: capture refused (error 900, memory allocation)"},
      {Fault::kScalarByValue, "scalar-by-value",
       "a host step counter passed to a kernel by value: frozen at capture, --verify-graphs names "
       "the output"},
      {Fault::kRngByValue, "rng-by-value",
       "a random op given its Philox seed/offset by value: every replay draws the same numbers, "
       "--verify-graphs names the output"},
      {Fault::kStaleInput, "stale-input",
       "the region's input re-pointed after capture: the argument check names region and argument"},
      {Fault::kUnjoinedStream, "unjoined-stream",
       "a side stream forked inside the region and never joined: capture refused (error 904)"},
      {Fault::kLegacyStream, "legacy-stream",
       "a kernel on the legacy default stream: runs at capture, missing from the graph, "
       "--verify-graphs names the output"},
      {Fault::kCollectiveMismatch, "collective-mismatch",
       "data parallel (--dp 2+, --graphs full): rank 1 captures one extra all-reduce; the capture "
       "check names it before the first replay, which would hang"},
      {Fault::kRankStall, "rank-stall",
       "multi-GPU (2+ processes): rank 1 stops enqueuing before step 2, as a hung host thread "
       "would; the other ranks' watchdog gives up after --comm-timeout-s and names the wait"},
      {Fault::kOverflow, "overflow",
       "step 2's gradients made infinite (an fp16 overflow): the found-inf check skips exactly "
       "that update, the weights stay, the loss scale backs off (needs --steps 3 or more)"},
  };
  return faults;
}

std::string describe_faults() {
  std::string text;
  for (const FaultInfo& f : fault_catalogue()) {
    char line[256];
    std::snprintf(line, sizeof(line), "  %-22s %s\n", f.name, f.what);
    text += line;
  }
  return text;
}

Fault parse_fault(const std::string& name) {
  if (name.empty()) return Fault::kNone;
  for (const FaultInfo& f : fault_catalogue())
    if (name == f.name) return f.fault;
  throw Error("replay", "invalid argument",
              "--inject: unknown fault '" + name + "' (one of):\n" + describe_faults());
}

const char* fault_name(Fault fault) {
  for (const FaultInfo& f : fault_catalogue())
    if (f.fault == fault) return f.name;
  return "";
}

FaultInjector::FaultInjector(Fault fault, uint64_t seed) : fault_(fault), seed_(seed) {
  REPLAY_CUDA_CHECK(cudaMalloc(&buffers_, 3 * kProbe * sizeof(float)));
  // Probe 0; both inputs the same bytes, so reading either gives the same result.
  REPLAY_CUDA_CHECK(cudaMemset(buffers_, 0, 3 * kProbe * sizeof(float)));
  if (fault_ == Fault::kUnjoinedStream) {
    REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  }
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
}

FaultInjector::~FaultInjector() {
  if (fork_) cudaEventDestroy(fork_);
  if (side_) cudaStreamDestroy(side_);
  if (buffers_) cudaFree(buffers_);
}

void FaultInjector::add_args(RegionArgs& args) {
  if (fault_ == Fault::kNone || fault_ == Fault::kCollectiveMismatch ||
      fault_ == Fault::kRankStall || fault_ == Fault::kOverflow)
    return;
  args.write("fault.probe", TensorView(buffers_, DType::kFP32, {kProbe}));
  if (fault_ == Fault::kStaleInput) {
    // The bug: a new buffer every call (as a loader handing out fresh tensors), where a graph keeps
    // the one it was captured with.
    float* input = buffers_ + kProbe * (1 + args_calls_ % 2);
    args_calls_ += 1;
    args.read("fault.input", TensorView(input, DType::kFP32, {kProbe}));
  }
}

void FaultInjector::enqueue(cudaStream_t stream, const RegionArgs& args) {
  float* probe = buffers_;
  switch (fault_) {
    case Fault::kNone:
    case Fault::kCollectiveMismatch:  // planted by the trainer's optimizer, among its collectives
    case Fault::kRankStall:           // planted by the trainer's step loop
    case Fault::kOverflow:            // planted by the trainer's optimizer (plant_overflow)
      return;
    case Fault::kHostSync:
      // Harmless eagerly (a stall); forbidden while capturing.
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    case Fault::kMalloc: {
      void* scratch = nullptr;
      REPLAY_CUDA_CHECK(cudaMalloc(&scratch, 256));
      REPLAY_CUDA_CHECK(cudaFree(scratch));
      return;
    }
    case Fault::kScalarByValue:
      // The host's own count of steps, baked into the launch: a graph replays the captured one.
      host_counter_ += 1;
      fault_store_value_kernel<<<1, 32, 0, stream>>>(probe, static_cast<float>(host_counter_));
      REPLAY_LAUNCH_CHECK();
      return;
    case Fault::kRngByValue:
      // The offset advances on the host; a graph replays the draw it captured.
      host_counter_ += 1;
      fault_draw_kernel<<<1, 32, 0, stream>>>(probe, seed_, static_cast<uint64_t>(host_counter_));
      REPLAY_LAUNCH_CHECK();
      return;
    case Fault::kStaleInput:
      // Reads the input it is given now; a graph reads the one it was captured with.
      fault_copy_kernel<<<1, 32, 0, stream>>>(probe,
                                              static_cast<const float*>(args["fault.input"].data));
      REPLAY_LAUNCH_CHECK();
      return;
    case Fault::kUnjoinedStream:
      // Forked correctly, never joined back into `stream`.
      REPLAY_CUDA_CHECK(cudaEventRecord(fork_, stream));
      REPLAY_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
      fault_count_kernel<<<1, 32, 0, side_>>>(probe);
      REPLAY_LAUNCH_CHECK();
      return;
    case Fault::kLegacyStream:
      // Stream 0 instead of `stream`: unordered with the region eagerly; with a non-blocking
      // capture stream it runs once at capture and is not in the graph.
      fault_count_kernel<<<1, 32, 0, cudaStreamLegacy>>>(probe);
      REPLAY_LAUNCH_CHECK();
      return;
  }
}

void FaultInjector::plant_overflow(float* grads, int64_t count, const int64_t* iteration,
                                   cudaStream_t stream) const {
  if (fault_ != Fault::kOverflow) return;
  REPLAY_REQUIRE(grads != nullptr && count > 0 && iteration != nullptr,
                 "--inject overflow: no gradients to plant in");
  fault_overflow_kernel<<<1, 32, 0, stream>>>(grads, count < kProbe ? count : kProbe, iteration,
                                              kOverflowStep);
  REPLAY_LAUNCH_CHECK();
}

}  // namespace replay::graphs
