// syncfree.cu: the step-scalar kernels, found-inf over a multi-tensor table, grad-norm wiring and the
// pinned readback ring.
#include "graphs/syncfree.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>

#include "common/check.h"

namespace replay::graphs {

// ---- Step scalars ----

namespace {

__global__ void init_step_scalars_kernel(StepScalars* s, float loss_scale, int32_t hysteresis) {
  StepScalars v{};
  v.loss_scale = loss_scale;
  v.grad_scale = 1.0f;
  v.hysteresis_left = hysteresis;
  *s = v;
}

__global__ void begin_step_kernel(StepScalars* s) {
  s->found_inf = 0;
  s->noop = 0;
}

// Writes only the fields it owns, so a kernel on another stream may write the others (loss, say).
__global__ void prepare_optimizer_kernel(StepScalars* s, LrSchedule schedule) {
  StepScalars v = *s;
  prepare_optimizer_update(v, schedule);
  s->noop = v.noop;
  s->step = v.step;
  s->lr = v.lr;
}

__global__ void end_step_kernel(StepScalars* s, LossScalerConfig scaler, bool scale) {
  StepScalars v = *s;
  if (scale) {
    loss_scaler_update(v, scaler);
    s->loss_scale = v.loss_scale;
    s->growth_tracker = v.growth_tracker;
    s->hysteresis_left = v.hysteresis_left;
  }
  s->iteration = v.iteration + 1;
}

__global__ void compute_lr_kernel(const int64_t* step, float* lr, LrSchedule schedule) {
  *lr = lr_at(schedule, *step - 1);
}

}  // namespace

BufferId plan_step_scalars(ArenaPlan& plan, const std::string& name) {
  return plan.add(name, sizeof(StepScalars), "graphs", Lifetime{}, 16);
}

TensorView step_scalars_view(StepScalars* s) {
  return TensorView(s, DType::kUINT8, {static_cast<int64_t>(sizeof(StepScalars))});
}

void init_step_scalars(StepScalars* s, float loss_scale, int32_t hysteresis, cudaStream_t stream) {
  REPLAY_REQUIRE(s != nullptr && reinterpret_cast<uintptr_t>(s) % alignof(StepScalars) == 0,
                 "StepScalars must be non-null and 8-byte aligned");
  REPLAY_REQUIRE(loss_scale > 0.0f, "the loss scale must be positive");
  REPLAY_REQUIRE(hysteresis >= 1, "loss-scaler hysteresis must be at least 1");
  init_step_scalars_kernel<<<1, 1, 0, stream>>>(s, loss_scale, hysteresis);
  REPLAY_LAUNCH_CHECK();
}

void validate(const LrSchedule& sc) {
  REPLAY_REQUIRE(sc.base_lr >= 0.0f && sc.min_lr >= 0.0f, "learning rates must be non-negative");
  switch (sc.kind) {
    case LrKind::kWarmupCosine:
      REPLAY_REQUIRE(sc.warmup_steps >= 1, "warm-up + cosine: warmup_steps must be >= 1");
      REPLAY_REQUIRE(sc.total_steps > sc.warmup_steps, "warm-up + cosine: total_steps must exceed warmup_steps");
      break;
    case LrKind::kWarmupConstant:
      REPLAY_REQUIRE(sc.warmup_steps >= 1, "warm-up + constant: warmup_steps must be >= 1");
      break;
    case LrKind::kRnntWarmupHoldDecay:
      REPLAY_REQUIRE(sc.steps_per_epoch >= 1, "RNN-T schedule: steps_per_epoch must be >= 1");
      REPLAY_REQUIRE(sc.warmup_epochs >= 0 && sc.hold_epochs >= 0, "RNN-T schedule: epochs must be >= 0");
      REPLAY_REQUIRE(sc.gamma > 0.0f && sc.gamma <= 1.0f, "RNN-T schedule: gamma must be in (0, 1]");
      break;
  }
}

void begin_step(StepScalars* s, cudaStream_t stream) {
  begin_step_kernel<<<1, 1, 0, stream>>>(s);
  REPLAY_LAUNCH_CHECK();
}

void prepare_optimizer(const LrSchedule& schedule, StepScalars* s, cudaStream_t stream) {
  validate(schedule);
  prepare_optimizer_kernel<<<1, 1, 0, stream>>>(s, schedule);
  REPLAY_LAUNCH_CHECK();
}

void end_step(StepScalars* s, const LossScalerConfig* scaler, cudaStream_t stream) {
  if (scaler != nullptr) {
    REPLAY_REQUIRE(scaler->growth_interval >= 1 && scaler->hysteresis >= 1, "loss scaler: interval and hysteresis >= 1");
    REPLAY_REQUIRE(scaler->backoff_factor > 0.0f && scaler->backoff_factor < 1.0f &&
                       scaler->growth_factor > 1.0f,
                   "loss scaler: backoff in (0, 1), growth > 1");
  }
  end_step_kernel<<<1, 1, 0, stream>>>(s, scaler ? *scaler : LossScalerConfig{}, scaler != nullptr);
  REPLAY_LAUNCH_CHECK();
}

void compute_lr(const LrSchedule& schedule, const int64_t* step, float* lr, cudaStream_t stream) {
  validate(schedule);
  compute_lr_kernel<<<1, 1, 0, stream>>>(step, lr, schedule);
  REPLAY_LAUNCH_CHECK();
}

// ---- Found-inf ----

namespace {

constexpr int kFoundInfThreads = 256;

// All-ones exponent: Inf or NaN. Masks for one element, and for two 16-bit elements in a 32-bit word.
__device__ __forceinline__ bool nonfinite32(uint32_t w) { return (w & 0x7f800000u) == 0x7f800000u; }
__device__ __forceinline__ bool nonfinite16(uint32_t h, uint32_t exp_mask) { return (h & exp_mask) == exp_mask; }
__device__ __forceinline__ bool nonfinite_word(uint32_t w, bool fp32, uint32_t exp_mask16) {
  if (fp32) return nonfinite32(w);
  return nonfinite16(w & 0xffffu, exp_mask16) || nonfinite16(w >> 16, exp_mask16);
}

// One block per chunk; every block reads its chunk with 16-byte loads where aligned, then the tail.
__global__ void __launch_bounds__(kFoundInfThreads)
    found_inf_kernel(FoundInfTable table, int32_t* __restrict__ found_inf) {
  const TensorChunk chunk = table.chunks[blockIdx.x];
  const FoundInfTensor t = table.tensors[chunk.tensor];
  const bool fp32 = t.dtype == static_cast<int32_t>(DType::kFP32);
  const uint32_t exp_mask16 = t.dtype == static_cast<int32_t>(DType::kBF16) ? 0x7f80u : 0x7c00u;
  const int64_t esize = fp32 ? 4 : 2;
  const char* base = static_cast<const char*>(t.data) + chunk.start * esize;
  const int64_t bytes = static_cast<int64_t>(chunk.length) * esize;
  const int64_t vec_bytes = reinterpret_cast<uintptr_t>(base) % 16 == 0 ? bytes / 16 * 16 : 0;
  bool bad = false;
  for (int64_t off = 16 * static_cast<int64_t>(threadIdx.x); off < vec_bytes; off += 16 * kFoundInfThreads) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(base + off));
    bad |= nonfinite_word(v.x, fp32, exp_mask16) | nonfinite_word(v.y, fp32, exp_mask16) |
           nonfinite_word(v.z, fp32, exp_mask16) | nonfinite_word(v.w, fp32, exp_mask16);
  }
  for (int64_t i = vec_bytes / esize + threadIdx.x; i < chunk.length; i += kFoundInfThreads) {
    bad |= fp32 ? nonfinite32(reinterpret_cast<const uint32_t*>(base)[i])
                : nonfinite16(reinterpret_cast<const uint16_t*>(base)[i], exp_mask16);
  }
  // Every writer stores the same value, so the result does not depend on which block wins.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1;
}

}  // namespace

void FoundInfTableBuilder::add(const TensorView& tensor) {
  REPLAY_REQUIRE(tensor.dtype == DType::kBF16 || tensor.dtype == DType::kFP16 || tensor.dtype == DType::kFP32,
                 std::string("found-inf checks bf16, fp16 or fp32 tensors, got ") + dtype_name(tensor.dtype));
  REPLAY_REQUIRE(tensor.is_contiguous(), "found-inf tensors must be contiguous");
  REPLAY_REQUIRE(tensor.data != nullptr &&
                     reinterpret_cast<uintptr_t>(tensor.data) % dtype_size(tensor.dtype) == 0,
                 "found-inf tensors must be non-null and aligned to their element size");
  builder_.add(FoundInfTensor{tensor.data, tensor.numel(), static_cast<int32_t>(tensor.dtype), 0});
}

void check_found_inf(const FoundInfTable& table, int32_t* found_inf, cudaStream_t stream) {
  REPLAY_REQUIRE(table.tensors != nullptr && table.num_chunks > 0, "found-inf table not built");
  REPLAY_REQUIRE(found_inf != nullptr, "found-inf flag must be given");
  found_inf_kernel<<<static_cast<unsigned>(table.num_chunks), kFoundInfThreads, 0, stream>>>(table, found_inf);
  REPLAY_LAUNCH_CHECK();
}

void clip_grad_norm(const GradNormTable& table, float max_norm, StepScalars* s, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  REPLAY_REQUIRE(s != nullptr, "clip_grad_norm needs the step scalars");
  grad_norm(table, max_norm, &s->loss_scale, &s->grad_norm, &s->grad_scale, &s->found_inf, workspace,
            workspace_bytes, stream);
}

// ---- Readback ring ----

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

__global__ void readback_kernel(ReadbackSlot* ring, int slots, const int64_t* iteration, ReadbackParams p) {
  const int64_t it = *iteration;
  ReadbackSlot* slot = ring + ((it % slots) + slots) % slots;  // a corrupt negative counter stays in bounds
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
  REPLAY_REQUIRE(slots >= 2, "a readback ring needs at least 2 slots (the host reads at least one step late)");
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
  for (cudaEvent_t& e : events_) REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
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

void ReadbackRing::step_enqueued(cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(enqueued_ % slots_)], stream));
  enqueued_ += 1;
}

void ReadbackRing::check_readable(int64_t s) const {
  REPLAY_REQUIRE(s >= 0 && s < enqueued_,
                 "readback of step " + std::to_string(s) + ": only " + std::to_string(enqueued_) + " steps enqueued");
  REPLAY_REQUIRE(s >= enqueued_ - slots_, "readback of step " + std::to_string(s) + ": its slot was reused (ring of " +
                                              std::to_string(slots_) + " slots, " + std::to_string(enqueued_) +
                                              " steps enqueued); read with a lag below the ring size");
}

ReadbackSample ReadbackRing::decode(int64_t s) const {
  const volatile ReadbackSlot& slot = host_[s % slots_];
  const int64_t tag = slot.tag;
  if (tag != s + 1) {
    throw Error("replay", "readback mismatch",
                "readback ring: the slot of step " + std::to_string(s) + " holds iteration " + std::to_string(tag - 1) +
                    "; the device iteration counter and the host's step count disagree (register StepScalars as "
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
      case ScalarType::kI32: v = static_cast<int32_t>(static_cast<uint32_t>(raw)); break;
      case ScalarType::kI64: v = static_cast<double>(static_cast<int64_t>(raw)); break;
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
