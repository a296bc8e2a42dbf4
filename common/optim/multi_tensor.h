// multi_tensor.h: the device table behind replay's "multi-tensor apply" kernels (AdamW, grad norm):
// one entry per tensor plus a list of fixed-size chunks, built once at set-up into caller-provided
// device memory, so that one launch covers every parameter of the model.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/check.h"

namespace replay {

// Elements [start, start + length) of tensor `tensor`. Chunks never span tensors and start at
// multiples of kTensorChunkElements, so chunks of 16-byte aligned tensors are 16-byte aligned.
struct TensorChunk {
  int64_t start;
  int32_t tensor;
  int32_t length;
};

// Fixed, hardware-independent chunking: per-chunk partial sums (grad norm) match on any GPU.
constexpr int64_t kTensorChunkElements = 16384;

// What a kernel receives: device pointers into the packed table.
template <class Entry>
struct MultiTensorTable {
  const Entry* tensors = nullptr;
  const TensorChunk* chunks = nullptr;
  int num_tensors = 0;
  int num_chunks = 0;
  int64_t numel = 0;  // over all tensors
};

// Host-side builder. Entry is a trivially copyable struct with an int64_t `numel` member.
template <class Entry>
class MultiTensorBuilder {
  static_assert(std::is_trivially_copyable_v<Entry>, "table entries are copied byte-wise");

 public:
  void add(const Entry& entry) {
    REPLAY_REQUIRE(entry.numel > 0, "empty tensor in a multi-tensor table");
    const auto index = static_cast<int32_t>(entries_.size());
    entries_.push_back(entry);
    for (int64_t start = 0; start < entry.numel; start += kTensorChunkElements) {
      const int64_t length = std::min(kTensorChunkElements, entry.numel - start);
      chunks_.push_back(TensorChunk{start, index, static_cast<int32_t>(length)});
    }
    numel_ += entry.numel;
  }

  int num_tensors() const { return static_cast<int>(entries_.size()); }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }

  // Device bytes the packed table needs: entries, then chunks at a 16-byte boundary.
  size_t device_bytes() const { return chunks_offset() + chunks_.size() * sizeof(TensorChunk); }

  // The same, for tensors of these sizes: what an arena plan needs before any pointer exists.
  static size_t device_bytes_for(const std::vector<int64_t>& numels) {
    return (numels.size() * sizeof(Entry) + 15) / 16 * 16 +
           chunk_count(numels) * sizeof(TensorChunk);
  }
  static size_t chunk_count(const std::vector<int64_t>& numels) {
    size_t chunks = 0;
    for (int64_t n : numels)
      chunks += static_cast<size_t>((n + kTensorChunkElements - 1) / kTensorChunkElements);
    return chunks;
  }

  // Copies the table into `device` (16-byte aligned, at least device_bytes()) and waits for the
  // copy: a set-up step, never part of a training step.
  MultiTensorTable<Entry> build(void* device, size_t bytes, cudaStream_t stream) const {
    REPLAY_REQUIRE(!entries_.empty(), "multi-tensor table has no tensors");
    REPLAY_REQUIRE(bytes >= device_bytes(), "multi-tensor table needs " +
                                                std::to_string(device_bytes()) + " bytes, got " +
                                                std::to_string(bytes));
    REPLAY_REQUIRE(reinterpret_cast<uintptr_t>(device) % 16 == 0,
                   "table memory not 16-byte aligned");
    REPLAY_REQUIRE(chunks_.size() <= static_cast<size_t>(INT32_MAX), "too many chunks");
    std::vector<char> host(device_bytes());
    std::memcpy(host.data(), entries_.data(), entries_.size() * sizeof(Entry));
    std::memcpy(host.data() + chunks_offset(), chunks_.data(),
                chunks_.size() * sizeof(TensorChunk));
    REPLAY_CUDA_CHECK(
        cudaMemcpyAsync(device, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` dies at return
    MultiTensorTable<Entry> table;
    table.tensors = static_cast<const Entry*>(device);
    table.chunks =
        reinterpret_cast<const TensorChunk*>(static_cast<char*>(device) + chunks_offset());
    table.num_tensors = num_tensors();
    table.num_chunks = num_chunks();
    table.numel = numel_;
    return table;
  }

 private:
  size_t chunks_offset() const { return (entries_.size() * sizeof(Entry) + 15) / 16 * 16; }

  std::vector<Entry> entries_;
  std::vector<TensorChunk> chunks_;
  int64_t numel_ = 0;
};

}  // namespace replay
