// arena.h: one device allocation per run. A workload first describes every buffer it will need in
// an ArenaPlan (name, size, lifetime); buffers whose lifetimes do not overlap share memory. The
// Arena then makes the single cudaMalloc, prints a memory table, and hands out views. Nothing
// allocates afterwards, so graphs add no memory over eager execution.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace replay {

// Inclusive range of step phases during which a buffer holds live data. Phases are the workload's
// own numbering (for a transformer: forward of layer i, backward of layer i, ...). The default
// spans the whole run: parameters, gradients, optimizer state, graph I/O.
struct Lifetime {
  static constexpr int kForever = std::numeric_limits<int>::max();
  int begin = 0;
  int end = kForever;
  bool overlaps(const Lifetime& o) const { return begin <= o.end && o.begin <= end; }
};

using BufferId = int;

class ArenaPlan {
 public:
  struct Entry {
    std::string name;
    std::string group;  // for the memory table: "params", "grads", "optimizer", "activations", ...
    size_t bytes = 0;
    size_t alignment = 256;
    Lifetime life;
    size_t offset = 0;  // assigned by plan()
  };

  // Adds a buffer; returns its id. Sizes of zero are allowed (the view is empty).
  BufferId add(std::string name, size_t bytes, std::string group = "other", Lifetime life = {},
               size_t alignment = 256);
  BufferId add(std::string name, DType dtype, int64_t elements, std::string group = "other",
               Lifetime life = {});

  // Assigns offsets: largest buffers first, each at the lowest aligned offset that does not overlap
  // a placed buffer whose lifetime overlaps its own. Deterministic. Called by Arena; callable in
  // tests.
  void plan();
  bool planned() const { return planned_; }

  size_t total_bytes() const;  // arena size after plan()
  size_t sum_bytes() const;    // sum of all buffers, without sharing
  const Entry& entry(BufferId id) const { return entries_.at(static_cast<size_t>(id)); }
  const std::vector<Entry>& entries() const { return entries_; }

  // Throws Error when the planned arena exceeds `available` bytes, naming the largest consumers.
  void check_fits(size_t available, const std::string& device_name) const;
  // The memory table: one line per group and the largest buffers, with the saving from sharing.
  std::string table(int largest = 8) const;

 private:
  std::vector<Entry> entries_;
  size_t total_ = 0;
  bool planned_ = false;
};

class Arena {
 public:
  // Plans (if not yet planned), checks free device memory, and makes the run's one allocation.
  // The contents are poisoned with 0xFF bytes (NaN for every float type) so that a read of memory
  // no kernel wrote shows up in the tests.
  explicit Arena(ArenaPlan plan, int device);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void* data(BufferId id) const;
  size_t bytes(BufferId id) const { return plan_.entry(id).bytes; }
  template <typename T>
  T* as(BufferId id) const {
    return static_cast<T*>(data(id));
  }
  // A contiguous view; the view may not be larger than the buffer.
  TensorView view(BufferId id, DType dtype, std::initializer_list<int64_t> shape) const;

  size_t size_bytes() const { return plan_.total_bytes(); }
  const ArenaPlan& plan() const { return plan_; }
  std::string table() const { return plan_.table(); }

 private:
  ArenaPlan plan_;
  char* base_ = nullptr;
  int device_ = 0;
};

}  // namespace replay
