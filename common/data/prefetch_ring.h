// prefetch_ring.h: the read-ahead ring under the workloads' data streams (BatchStream for token
// files, unet::LatentStream for latent files). A prefetch thread fills slots of pinned host memory
// with batch after batch (the owner's fill function says what a batch is and how it is read); the
// training thread takes one batch a step and issues its host-to-device copies outside any captured
// region, after which an event marks the slot as read. The thread refills a slot only once the
// copies that read it have finished, and the training thread waits only when the thread is behind
// (a stall, counted and timed). A read error on the prefetch thread is rethrown by the take() of
// the batch that failed.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace replay::data {

class PrefetchRing {
 public:
  struct Options {
    size_t slot_bytes = 0;
    int slots = 4;  // batches read ahead
    // Plain host buffers and no CUDA call at all (the copies are the owner's synchronous memcpy):
    // the ring's logic, testable without a GPU.
    bool host_only = false;
  };
  // Reads batch `b` (counted from the last start()) into a slot's `slot_bytes`. Runs on the
  // prefetch thread, one call at a time.
  using Fill = std::function<void(int64_t b, void* slot)>;
  // Enqueues the copies of a slot's batch on `stream` (or copies it synchronously, host_only).
  using Copy = std::function<void(const void* slot, cudaStream_t stream)>;

  // Allocates the slots (pinned host memory and one event each unless host_only) on the current
  // device. Construct before any capture; start() starts the prefetch thread.
  PrefetchRing(const Options& options, Fill fill);
  // Stops and joins the thread, waits for the last copies, frees the slots.
  ~PrefetchRing();
  PrefetchRing(const PrefetchRing&) = delete;
  PrefetchRing& operator=(const PrefetchRing&) = delete;

  // Starts the prefetch thread at batch 0. Again before the first take() (a seek, a data-parallel
  // shard): stops the thread, runs `reconfigure` while no thread reads the owner's state, and
  // starts over at batch 0 of what fill now reads. `who` names the caller in the error after a
  // take().
  void start();
  void restart(const char* who, const std::function<void()>& reconfigure);

  // The next batch: waits for it when the thread is behind (a stall), calls copy(slot, stream) and
  // records the slot's event on `stream`. Must run outside any captured region (`who` names the
  // caller in the error): its copies read a different slot every step.
  void take(cudaStream_t stream, const char* who, const Copy& copy);

  int64_t taken() const;         // batches handed out
  int64_t stalls() const;        // take() calls that had to wait for the prefetch thread
  double stall_seconds() const;  // the time they waited
  bool host_only() const { return options_.host_only; }

 private:
  struct PinnedFree {
    void operator()(void* p) const { cudaFreeHost(p); }
  };
  struct EventDestroy {
    void operator()(CUevent_st* e) const { cudaEventDestroy(e); }
  };
  struct Slot {
    std::vector<unsigned char> host;                   // host_only
    std::unique_ptr<void, PinnedFree> pinned;          // otherwise
    std::unique_ptr<CUevent_st, EventDestroy> copied;  // recorded after the slot's copies
    void* data = nullptr;
  };

  void stop();
  void loop();

  Options options_;
  Fill fill_;
  int device_ = -1;
  std::vector<Slot> slots_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int64_t produced_ = 0;  // batches [0, produced_) since the start are in the ring or taken
  int64_t consumed_ = 0;  // batches [0, consumed_) have had their copies issued (restart: none)
  int64_t stalls_ = 0;
  std::chrono::steady_clock::duration stall_time_{};
  bool stop_ = false;
  std::exception_ptr error_;  // the prefetch thread's failure at batch produced_
  std::thread thread_;
};

}  // namespace replay::data
