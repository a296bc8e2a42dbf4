// caching_pool.h: what N13 and N15 share, a caching allocator over one slab planned before any
// capture, as a framework's pool is: it knows when a block is released, not who will still read
// it or which graphs may run on it at the same time.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.h"

class CachingPool {
 public:
  explicit CachingPool(size_t bytes) : size_(bytes) { EX_CHECK(cudaMalloc(&slab_, bytes)); }
  ~CachingPool() { cudaFree(slab_); }
  // A released block of the same size if there is one (the most recently released), else a new one.
  void* allocate(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    for (size_t i = free_.size(); i-- > 0;) {
      if (free_[i].bytes == bytes) {
        void* ptr = free_[i].ptr;
        free_.erase(free_.begin() + i);
        return ptr;
      }
    }
    if (top_ + bytes > size_) {
      std::printf("CHECK FAILED: caching pool of %zu bytes exhausted\n", size_);
      std::exit(1);
    }
    Block block{slab_ + top_, bytes};
    top_ += bytes;
    used_.push_back(block);
    return block.ptr;
  }
  void release(void* ptr) {
    for (const Block& b : used_) {
      if (b.ptr == ptr) free_.push_back(b);
    }
  }

 private:
  struct Block {
    char* ptr;
    size_t bytes;
  };
  char* slab_ = nullptr;
  size_t size_ = 0;
  size_t top_ = 0;
  std::vector<Block> used_;  // every block ever handed out
  std::vector<Block> free_;  // released blocks, ready for reuse
};
