// readback.h: ReadbackRing, how the host learns a step's scalars without waiting for the step: a
// captured kernel copies chosen device scalars into a pinned, device-mapped ring every step, and
// the host reads step s - lag while step s is still running. Progress lines never stall the GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace replay::graphs {

// Selected device scalars are copied every step, by a captured kernel, into slot (*iteration %
// slots) of a pinned, device-mapped host ring, with the iteration as a tag. After enqueuing step s
// the host records one event (outside any graph); read(s - lag) waits for step s - lag only, never
// for the current step.
enum class ScalarType { kF32, kI32, kI64 };

struct ReadbackField {
  std::string name;
  const void* device;  // a device scalar (e.g. &scalars->loss)
  ScalarType type;
};

struct ReadbackSample {
  int64_t iteration = -1;
  std::vector<std::string> names;
  std::vector<double> values;
  double get(const std::string& name) const;  // throws naming an unknown field
};

struct ReadbackSlot;  // one slot of the pinned ring (readback.cu)

class ReadbackRing {
 public:
  static constexpr int kMaxFields = 8;

  // `iteration`: a device int64 holding the 0-based index of the executing step when copy() runs
  // (StepScalars::iteration, with copy() before end_step()). Allocates the pinned ring and the
  // events: set-up only.
  ReadbackRing(int slots, const int64_t* iteration, std::vector<ReadbackField> fields);
  ~ReadbackRing();
  ReadbackRing(const ReadbackRing&) = delete;
  ReadbackRing& operator=(const ReadbackRing&) = delete;

  // Inside the step (captured in graph modes): one kernel writes every field into the slot.
  void copy(cudaStream_t stream) const;
  // The device iteration of the first step the host enqueues (0 unless the run resumes from a
  // checkpoint): host step s is device iteration first + s. Before the first step only.
  void set_first_iteration(int64_t iteration);
  // After the host has enqueued a step (outside graphs): records that step's event.
  void step_enqueued(cudaStream_t stream);
  int64_t steps_enqueued() const { return enqueued_; }

  // Step s's values, s one of the last `slots` steps enqueued: waits for that step's event only.
  // Throws when the slot holds another iteration (the device counter and the host disagree).
  ReadbackSample read(int64_t s) const;
  // The same without waiting: nothing when step s has not finished.
  std::optional<ReadbackSample> try_read(int64_t s) const;

 private:
  ReadbackSample decode(int64_t s) const;
  void check_readable(int64_t s) const;

  int slots_ = 0;
  const int64_t* iteration_ = nullptr;
  std::vector<ReadbackField> fields_;
  ReadbackSlot* host_ = nullptr;    // pinned, mapped
  ReadbackSlot* device_ = nullptr;  // the same memory as the device sees it
  std::vector<cudaEvent_t> events_;
  int64_t enqueued_ = 0;
  int64_t first_iteration_ = 0;
};

}  // namespace replay::graphs
