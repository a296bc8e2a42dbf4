// readback.cu: the pinned readback ring and its one-thread copy kernel.
#include "graphs/readback.h"

#include <cstring>

#include "common/check.h"

namespace replay::graphs {

struct ReadbackSlot {
  int64_t tag;  // iteration + 1 of the step that wrote the slot; 0 while never written
  uint64_t raw[ReadbackRing::kMaxFields];
};

namespace {

struct ReadbackParams {
  const void* src[ReadbackRing::kMaxFields];
  int32_t type[ReadbackRing::kMaxFields];
  int32_t count;
};

__global__ void readback_kernel(ReadbackSlot* ring, int slots, const int64_t* iteration,
                                ReadbackParams p) {
  const int64_t it = *iteration;
  ReadbackSlot* slot =
      ring + ((it % slots) + slots) % slots;  // a corrupt negative counter stays in bounds
  for (int k = 0; k < p.count; ++k) {
    slot->raw[k] = p.type[k] == static_cast<int32_t>(ScalarType::kI64)
                       ? *static_cast<const uint64_t*>(p.src[k])
                       : static_cast<uint64_t>(*static_cast<const uint32_t*>(p.src[k]));
  }
  __threadfence_system();  // the values reach host memory before the tag that vouches for them
  *reinterpret_cast<volatile int64_t*>(&slot->tag) = it + 1;
}

}  // namespace

double ReadbackSample::get(const std::string& name) const {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return values[i];
  throw Error("replay", "invalid argument", "readback field '" + name + "' does not exist");
}

ReadbackRing::ReadbackRing(int slots, const int64_t* iteration, std::vector<ReadbackField> fields)
    : slots_(slots), iteration_(iteration), fields_(std::move(fields)) {
  REPLAY_REQUIRE(slots >= 2,
                 "a readback ring needs at least 2 slots (the host reads at least one step late)");
  REPLAY_REQUIRE(iteration != nullptr, "the readback ring needs the device iteration counter");
  REPLAY_REQUIRE(!fields_.empty() && fields_.size() <= static_cast<size_t>(kMaxFields),
                 "a readback ring copies 1 to " + std::to_string(kMaxFields) + " fields");
  for (const ReadbackField& f : fields_) {
    const size_t align = f.type == ScalarType::kI64 ? 8 : 4;
    REPLAY_REQUIRE(f.device != nullptr && reinterpret_cast<uintptr_t>(f.device) % align == 0,
                   "readback field '" + f.name + "' must be a non-null, aligned device scalar");
  }
  const size_t bytes = sizeof(ReadbackSlot) * static_cast<size_t>(slots_);
  REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), bytes, cudaHostAllocMapped));
  std::memset(static_cast<void*>(host_), 0, bytes);
  REPLAY_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
  events_.resize(static_cast<size_t>(slots_), nullptr);
  for (cudaEvent_t& e : events_)
    REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

ReadbackRing::~ReadbackRing() {
  for (cudaEvent_t e : events_)
    if (e) cudaEventDestroy(e);
  if (host_) cudaFreeHost(host_);
}

void ReadbackRing::copy(cudaStream_t stream) const {
  ReadbackParams p{};
  p.count = static_cast<int32_t>(fields_.size());
  for (size_t k = 0; k < fields_.size(); ++k) {
    p.src[k] = fields_[k].device;
    p.type[k] = static_cast<int32_t>(fields_[k].type);
  }
  readback_kernel<<<1, 1, 0, stream>>>(device_, slots_, iteration_, p);
  REPLAY_LAUNCH_CHECK();
}

void ReadbackRing::set_first_iteration(int64_t iteration) {
  REPLAY_REQUIRE(enqueued_ == 0, "ReadbackRing::set_first_iteration after a step was enqueued");
  REPLAY_REQUIRE(iteration >= 0, "ReadbackRing::set_first_iteration: negative iteration");
  first_iteration_ = iteration;
}

void ReadbackRing::step_enqueued(cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(enqueued_ % slots_)], stream));
  enqueued_ += 1;
}

void ReadbackRing::check_readable(int64_t s) const {
  REPLAY_REQUIRE(s >= 0 && s < enqueued_, "readback of step " + std::to_string(s) + ": only " +
                                              std::to_string(enqueued_) + " steps enqueued");
  REPLAY_REQUIRE(s >= enqueued_ - slots_,
                 "readback of step " + std::to_string(s) + ": its slot was reused (ring of " +
                     std::to_string(slots_) + " slots, " + std::to_string(enqueued_) +
                     " steps enqueued); read with a lag below the ring size");
}

ReadbackSample ReadbackRing::decode(int64_t s) const {
  const int64_t it = first_iteration_ + s;  // the device's iteration of host step s
  const volatile ReadbackSlot& slot = host_[it % slots_];
  const int64_t tag = slot.tag;
  if (tag != it + 1) {
    throw Error("replay", "readback mismatch",
                "readback ring: the slot of iteration " + std::to_string(it) + " holds iteration " +
                    std::to_string(tag - 1) +
                    "; the device iteration counter and the host's step count disagree (register "
                    "StepScalars as "
                    "StepPlan state, and run ReadbackRing::copy before end_step in every step)");
  }
  ReadbackSample out;
  out.iteration = s;
  for (size_t k = 0; k < fields_.size(); ++k) {
    const uint64_t raw = slot.raw[k];
    double v = 0;
    switch (fields_[k].type) {
      case ScalarType::kF32: {
        const auto bits = static_cast<uint32_t>(raw);
        float f;
        std::memcpy(&f, &bits, 4);
        v = f;
        break;
      }
      case ScalarType::kI32:
        v = static_cast<int32_t>(static_cast<uint32_t>(raw));
        break;
      case ScalarType::kI64:
        v = static_cast<double>(static_cast<int64_t>(raw));
        break;
    }
    out.names.push_back(fields_[k].name);
    out.values.push_back(v);
  }
  return out;
}

ReadbackSample ReadbackRing::read(int64_t s) const {
  check_readable(s);
  REPLAY_CUDA_CHECK(cudaEventSynchronize(events_[static_cast<size_t>(s % slots_)]));
  return decode(s);
}

std::optional<ReadbackSample> ReadbackRing::try_read(int64_t s) const {
  check_readable(s);
  const cudaError_t status = cudaEventQuery(events_[static_cast<size_t>(s % slots_)]);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not a failure
    return std::nullopt;
  }
  REPLAY_CUDA_CHECK(status);
  return decode(s);
}

}  // namespace replay::graphs
