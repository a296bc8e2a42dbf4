// hash.cpp: Hasher (hash.h).
#include "common/hash.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace replay {

namespace {
constexpr uint64_t kFnvPrime = 0x100000001b3ull;
}

void Hasher::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0 && tail_bytes_ > 0) {  // complete a word begun by the previous piece
    tail_[tail_bytes_++] = *p++;
    --bytes;
    if (tail_bytes_ == 8) {
      uint64_t w;
      std::memcpy(&w, tail_, 8);
      h_ = (h_ ^ w) * kFnvPrime;
      tail_bytes_ = 0;
    }
  }
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h_ = (h_ ^ w) * kFnvPrime;
  }
  std::memcpy(tail_ + tail_bytes_, p, bytes);
  tail_bytes_ += bytes;
}

uint64_t Hasher::value() const {
  uint64_t h = h_;
  for (size_t i = 0; i < tail_bytes_; ++i) h = (h ^ tail_[i]) * kFnvPrime;
  return h;
}

std::string Hasher::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, value());
  return buf;
}

}  // namespace replay
