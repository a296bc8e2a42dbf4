// safetensors.h: reading and writing the safetensors format, the tensor file PyTorch, JAX and
// Hugging Face read (`safetensors.torch.load_file`). A file is an 8-byte little-endian header
// length N, N bytes of JSON (each tensor's dtype, shape and [begin, end) byte offsets into the
// data section, plus a "__metadata__" map of strings), then the data section: the tensors' bytes,
// row-major, back to back, in the header's offset order.
//
// The reader trusts nothing: a short file, a header past the end, malformed JSON, an unknown dtype,
// offsets that disagree with the shape, overlap, gaps or a data section of the wrong length are
// errors naming the file and the tensor. The writer never leaves a half-written file: it writes a
// temporary sibling, fsyncs it and renames it over the final name only when every byte is in.
//
// Content check (replay's addition, ignored by other readers): with `hash` on, the writer stores
// the Hasher value of the whole data section in the metadata key kDataHashKey, and Reader::read_all
// verifies it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/tensor.h"

namespace replay::safetensors {

inline constexpr const char* kDataHashKey = "replay.data_hash";
// The format's own limit on the header (safetensors rejects larger ones).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// The format's dtype names: BF16, F16, F32, F8_E4M3, F8_E5M2, I32, I64, U8. Throws Error for a
// name replay cannot hold.
const char* dtype_tag(DType t);
DType dtype_from_tag(const std::string& name);
// "[2, 3]", "[]" for a scalar.
std::string shape_string(const std::vector<int64_t>& shape);

struct TensorEntry {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;   // [] for a scalar (one element)
  uint64_t begin = 0, end = 0;  // byte offsets in the data section (set by the writer and reader)

  int64_t numel() const;
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }
};

using Metadata = std::map<std::string, std::string>;

class Reader {
 public:
  // Opens `path` and validates its header against the file's size; reads no tensor data.
  explicit Reader(std::string path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }  // in data order
  const TensorEntry* find(const std::string& name) const;               // nullptr when absent
  const Metadata& metadata() const { return metadata_; }
  // The metadata value of `key`, or "" when the file has none.
  std::string meta(const std::string& key) const;
  uint64_t data_bytes() const { return data_bytes_; }

  // One tensor's bytes into `host` (exactly entry.bytes()).
  void read(const TensorEntry& entry, void* host) const;
  // Streams the whole data section in order, each tensor in pieces of at most `piece` bytes:
  // fn(tensor, byte offset within it, data, bytes). When the file carries kDataHashKey, the data
  // are hashed on the way and a mismatch throws after the last piece.
  void read_all(const std::function<void(const TensorEntry&, uint64_t, const void*, size_t)>& fn,
                size_t piece = size_t{64} << 20) const;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  uint64_t data_start_ = 0, data_bytes_ = 0;
  std::vector<TensorEntry> tensors_;
  Metadata metadata_;
};

class Writer {
 public:
  // Creates the temporary sibling of `path` (".<name>.tmp.<pid>" in the same directory) and writes
  // the header; nothing appears at `path` until commit(). Offsets are assigned in the given order.
  // Throws Error naming the directory when it cannot be written.
  Writer(std::string path, std::vector<TensorEntry> tensors, Metadata metadata, bool hash = true);
  // Removes the temporary file unless commit() succeeded.
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  // Appends the next `bytes` of the data section (tensors in order, any piece size).
  void write(const void* data, size_t bytes);
  // Every byte written: stores the hash, flushes and fsyncs the file, renames it to `path` and
  // fsyncs the directory. Throws when fewer or more bytes than the tensors need were written.
  void commit();

 private:
  std::string path_, tmp_path_;
  std::vector<TensorEntry> tensors_;
  std::FILE* file_ = nullptr;
  uint64_t data_start_ = 0, data_bytes_ = 0, written_ = 0;
  long hash_at_ = -1;  // file position of the hash's 16 digits, -1 without a hash
  bool committed_ = false;
  Hasher hasher_;
};

}  // namespace replay::safetensors
