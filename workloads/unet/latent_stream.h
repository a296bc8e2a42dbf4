// latent_stream.h: streaming UNet batches from a latent file (datasets/unet.md) into the step's
// static input buffers, the prefetch path the token workloads use (common/data/batch_stream.h). A
// prefetch thread reads batch after batch of common/data's BatchOrder (shuffled per epoch from the
// seed) into a ring of pinned host buffers; next() issues the asynchronous copies outside any
// captured region. For training splits larger than what replay-unet holds in pinned memory, or
// with --data-stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/data/batch_stream.h"
#include "common/data/prefetch_ring.h"
#include "workloads/unet/latent_file.h"

namespace replay::unet {

struct LatentStreamOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  // The samples the stream visits: [0, num_samples) of the file (0: its whole training split).
  int64_t num_samples = 0;
  int ring_slots = 4;  // batches read ahead
  // The text embeddings as bf16 bits (a bf16 model) instead of the file's fp16.
  bool text_bf16 = false;
  // Plain host buffers and a synchronous memcpy into host destinations in next(), with no CUDA call
  // at all: the ring's logic, testable without a GPU. Workloads leave it false.
  bool host_only = false;
};

class LatentStream {
 public:
  // Opens and validates `path` against `shape` (LatentFile; shape.micro_batch is the batch).
  // Allocates the ring (pinned buffers and one event per slot unless host_only) on the current
  // device and starts the prefetch thread. Construct before any capture.
  LatentStream(const std::string& path, const LatentDataShape& shape,
               const LatentStreamOptions& options);
  // Stops and joins the prefetch thread, waits for the last copies, frees the ring.
  ~LatentStream();
  LatentStream(const LatentStream&) = delete;
  LatentStream& operator=(const LatentStream&) = delete;

  // Copies the next batch into the step's buffers: moments [B, 2C, H, W] fp16 bits, text
  // [B, L, D] fp16 (or bf16) bits. Device pointers: two asynchronous copies on `stream` and an
  // event recorded for the slot; it returns at once unless the prefetch thread is behind (a stall:
  // it waits and counts it). Must run outside any captured region. A read error on the prefetch
  // thread is rethrown here, at the batch that failed.
  void next(cudaStream_t stream, void* dst_moments, void* dst_text);

  // Makes batch `index` of the order the next one next() hands out (a resumed run). Only before
  // the first next().
  void seek(int64_t index);
  // The order's index of the batch the next next() hands out.
  int64_t position() const;

  const LatentFileInfo& info() const { return file_.info(); }
  int64_t num_samples() const { return num_samples_; }
  int64_t delivered() const;     // batches handed out by next()
  int64_t stalls() const;        // next() calls that had to wait for the prefetch thread
  double stall_seconds() const;  // the time they waited

 private:
  void fill(int64_t b, void* slot);  // the ring's prefetch thread: batch b since the last start

  LatentFile file_;  // read only by the prefetch thread once it runs
  LatentStreamOptions options_;
  int64_t batch_, moment_elements_, text_elements_, num_samples_;
  // The prefetch thread's own (changed only while it is stopped: seek).
  data::BatchOrder order_;
  std::vector<int64_t> rows_;
  int64_t first_ = 0;        // the order's index of the ring's batch 0 (seek)
  data::PrefetchRing ring_;  // last: destroyed first, its thread stopped before the rest goes
};

}  // namespace replay::unet
