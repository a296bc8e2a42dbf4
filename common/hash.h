// hash.h: the project's 64-bit content hash (FNV-1a over little-endian 64-bit words, then the tail
// bytes), fed in pieces of any size: loss and weight hashes in reports, checkpoint data checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace replay {

class Hasher {
 public:
  void update(const void* data, size_t bytes);
  uint64_t value() const;
  std::string hex() const;  // 16 hex digits

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
  unsigned char tail_[8] = {};
  size_t tail_bytes_ = 0;
};

}  // namespace replay
