// batch_stream.h: streaming batches from a token file into the step's static input buffers. A
// prefetch thread reads batches in a deterministic order into a ring of pinned host buffers; next()
// issues the asynchronous copies (inputs = tokens[:, :-1], targets = tokens[:, 1:]) outside any
// captured region.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common/data/prefetch_ring.h"
#include "common/data/token_file.h"

namespace replay::data {

// The order in which batches visit rows. Epoch e holds floor(N / micro_batch) batches; in
// sequential order batch i of an epoch is rows [i * mb, (i + 1) * mb), in shuffled order it is
// entries [i * mb, (i + 1) * mb) of a permutation of all N rows drawn from (seed, e). The N mod mb
// rows left over are skipped in that epoch. After the last batch of an epoch the next epoch begins:
// the order wraps around for as many steps as a run takes. A pure function of (N, mb, shuffle,
// seed, index).
class BatchOrder {
 public:
  BatchOrder(int64_t num_sequences, int64_t micro_batch, bool shuffle, uint64_t seed);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // The micro_batch rows of global batch `index` (epoch index / batches_per_epoch()).
  void rows(int64_t index, int64_t* out);

 private:
  int64_t num_sequences_, micro_batch_, batches_per_epoch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t perm_epoch_ = -1;  // the epoch perm_ was drawn for
  std::vector<int64_t> perm_;
};

struct StreamOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  // The rows the stream visits: [first_row, first_row + num_rows) of the file (0 rows: to the end).
  // The training stream of a run with a held-out split stops short of it.
  int64_t first_row = 0;
  int64_t num_rows = 0;
  // Data parallelism: this stream's batch b is batch b * stride + offset of the order (rank r of n
  // ranks: stride n, offset r), so the ranks read disjoint batches of one global order.
  int64_t stride = 1, offset = 0;
  int ring_slots = 4;  // batches read ahead
  // Plain host buffers and a synchronous memcpy into host destinations in next(), with no CUDA call
  // at all: the ring's logic, testable without a GPU. Workloads leave it false.
  bool host_only = false;
};

class BatchStream {
 public:
  // Takes the validated file. Allocates the ring (pinned host buffers and one event per slot unless
  // host_only) on the current device and starts the prefetch thread. Construct before any capture.
  BatchStream(TokenFile file, const StreamOptions& options);
  // Stops and joins the prefetch thread, waits for the last copies, frees the ring.
  ~BatchStream();
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // Copies the next batch into the step's static buffers, each [micro_batch, seq_len] int32:
  // dst_tokens = tokens[:, :-1], dst_targets = tokens[:, 1:]. Device pointers: two asynchronous 2-D
  // copies on `stream` and an event recorded for the slot; it returns at once unless the prefetch
  // thread is behind (a stall: it waits and counts it). Must run outside any captured region. A
  // read error on the prefetch thread is rethrown here, at the batch that failed.
  void next(cudaStream_t stream, int32_t* dst_tokens, int32_t* dst_targets);

  // Makes batch `index` of the order (BatchOrder) the next one next() hands out: a run resumed from
  // a checkpoint continues the order where the saved run stopped. Only before the first next().
  void seek(int64_t index);
  // Data parallelism (StreamOptions::stride and offset), only before the first next().
  void shard(int64_t stride, int64_t offset);
  // The order's index of the batch the next next() hands out (batches since index 0, not since
  // the seek).
  int64_t position() const;

  const TokenFileInfo& info() const { return file_.info(); }
  int64_t num_rows() const { return num_rows_; }  // the rows it visits
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t delivered() const;     // batches handed out by next()
  int64_t stalls() const;        // next() calls that had to wait for the prefetch thread
  double stall_seconds() const;  // the time they waited

 private:
  void fill(int64_t b, void* slot);  // the ring's prefetch thread: batch b since the last start

  TokenFile file_;  // read only by the prefetch thread once it runs
  StreamOptions options_;
  int64_t micro_batch_, seq_len_, num_rows_, batches_per_epoch_;
  // The prefetch thread's own (changed only while it is stopped: seek, shard).
  BatchOrder order_;
  std::vector<int64_t> rows_;
  int64_t first_ = 0;  // the order's index of the ring's batch 0 (seek)
  PrefetchRing ring_;  // last: destroyed first, its thread stopped before the rest goes
};

// Rows [first, first + count) of rows of seq_len + 1 tokens as one micro-batch of inputs and
// targets (dst_tokens = rows[:, :-1], dst_targets = rows[:, 1:]): two 2-D copies on `stream` from
// pinned host memory into device buffers of [count, seq_len] int32. Outside any capture.
void copy_rows_to_device(const int32_t* rows, int64_t count, int64_t seq_len, cudaStream_t stream,
                         int32_t* dst_tokens, int32_t* dst_targets);

// A held-out split read once into pinned memory (rows [first_row, first_row + count) of a file),
// handed out in order, a micro-batch at a time, for evaluation: every evaluation sees the same
// rows.
class HeldOutRows {
 public:
  HeldOutRows(const TokenFile& file, int64_t first_row, int64_t count);
  ~HeldOutRows();
  HeldOutRows(const HeldOutRows&) = delete;
  HeldOutRows& operator=(const HeldOutRows&) = delete;

  int64_t count() const { return count_; }
  // Micro-batch `index` (rows [index * mb, (index + 1) * mb) of the split) into the device buffers.
  void copy(int64_t index, int64_t micro_batch, cudaStream_t stream, int32_t* dst_tokens,
            int32_t* dst_targets) const;

 private:
  int64_t count_, seq_len_;
  int32_t* rows_ = nullptr;  // pinned
};

}  // namespace replay::data
