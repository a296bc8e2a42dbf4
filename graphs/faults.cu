// faults.cu: the fault catalogue, the planted faults of --inject and their one-block kernels.
#include "graphs/faults.h"

#include <cstdio>

#include "common/check.h"
#include "common/philox.h"

namespace replay::graphs {

namespace {

constexpr int kProbe = 4;  // floats the planted kernels write
// buffers_: probe, input A, input B, replay-order's scratch (kProbe floats each), then
// shape-change's input (kLongInput floats, all 1).
constexpr int kScratch = 3 * kProbe;
constexpr int kLongInput = 2 * kProbe;
constexpr int kLongInputAt = 4 * kProbe;
constexpr int kBufferFloats = kLongInputAt + kLongInput;

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

// probe = the sum of input[0..n), n passed by value (the size a graph keeps from its capture).
__global__ void fault_sum_kernel(float* probe, const float* input, int n) {
  if (threadIdx.x < kProbe) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += input[i];
    probe[threadIdx.x] = sum;
  }
}

// probe = 2 * scratch: replay-order's reader of what the writer (fault_count_kernel) left there.
__global__ void fault_double_kernel(float* probe, const float* scratch) {
  if (threadIdx.x < kProbe) probe[threadIdx.x] = 2.0f * scratch[threadIdx.x];
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
      {Fault::kHostBranch, "host-branch",
       "an if/else the host chooses per step (accumulate or reset): the graph replays the branch "
       "taken at capture, --verify-graphs names the output"},
      {Fault::kShapeChange, "shape-change",
       "the region's input alternates between 4 and 8 elements (a variable-length batch): the "
       "argument check names region, argument and both shapes before the replay"},
      {Fault::kReplayOrder, "replay-order",
       "two layer regions share a scratch buffer, the first writes it, the second reads it; the "
       "graphs hold the read before the write (replayed out of capture order): --verify-graphs "
       "names the output"},
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
  REPLAY_CUDA_CHECK(cudaMalloc(&buffers_, kBufferFloats * sizeof(float)));
  // Probe and scratch 0; both inputs the same bytes, so reading either gives the same result.
  REPLAY_CUDA_CHECK(cudaMemset(buffers_, 0, kBufferFloats * sizeof(float)));
  if (fault_ == Fault::kShapeChange) {
    const std::vector<float> ones(kLongInput, 1.0f);
    REPLAY_CUDA_CHECK(cudaMemcpy(buffers_ + kLongInputAt, ones.data(), kLongInput * sizeof(float),
                                 cudaMemcpyHostToDevice));
  }
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

void FaultInjector::add_args(RegionArgs& args, int site) {
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
  if (fault_ == Fault::kShapeChange) {
    // The bug: the batch's length changes from step to step (8, 4, 8, ... elements of one buffer),
    // where a graph keeps the length it was captured with.
    const int64_t n = args_calls_ % 2 == 0 ? kLongInput : kProbe;
    args_calls_ += 1;
    args.read("fault.input", TensorView(buffers_ + kLongInputAt, DType::kFP32, {n}));
  }
  if (fault_ == Fault::kReplayOrder)
    args.read_write("fault.scratch", TensorView(buffers_ + kScratch, DType::kFP32, {kProbe}));
  (void)site;  // both replay-order sites declare the same buffers
}

void FaultInjector::enqueue(cudaStream_t stream, const RegionArgs& args, int site) {
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
    case Fault::kHostBranch:
      // `if (step % 2 == 0) accumulate; else reset;` decided on the host: a graph holds the one
      // branch it was captured with and replays it every step.
      host_counter_ += 1;
      if (host_counter_ % 2 == 0) {
        fault_count_kernel<<<1, 32, 0, stream>>>(probe);
      } else {
        fault_store_value_kernel<<<1, 32, 0, stream>>>(probe, 0.0f);
      }
      REPLAY_LAUNCH_CHECK();
      return;
    case Fault::kShapeChange: {
      // The kernel's size from the input's shape, passed by value: a graph keeps the captured one.
      const TensorView& input = args["fault.input"];
      fault_sum_kernel<<<1, 32, 0, stream>>>(probe, static_cast<const float*>(input.data),
                                             static_cast<int>(input.numel()));
      REPLAY_LAUNCH_CHECK();
      return;
    }
    case Fault::kReplayOrder: {
      // Eagerly, in step order: site 0 advances the shared scratch (the writer), site 1 reads it.
      // Captured, the sites swap: the graphs hold the read before the write, as when the second
      // region's graph is replayed before the first's, and the read sees the previous step's
      // scratch (guide N14).
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      const bool writer = (site == 0) == (capturing != cudaStreamCaptureStatusActive);
      float* scratch = buffers_ + kScratch;
      if (writer) {
        fault_count_kernel<<<1, 32, 0, stream>>>(scratch);
      } else {
        fault_double_kernel<<<1, 32, 0, stream>>>(probe, scratch);
      }
      REPLAY_LAUNCH_CHECK();
      return;
    }
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
