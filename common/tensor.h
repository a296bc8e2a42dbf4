// tensor.h: DType and TensorView, a non-owning (pointer, dtype, shape, strides) view. Cheap to
// copy; memory always belongs to the Arena (or, in tests, to the test).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/check.h"

namespace replay {

enum class DType : uint8_t { kBF16, kFP16, kFP32, kFP8E4M3, kFP8E5M2, kINT32, kINT64, kUINT8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
    case DType::kINT32:
      return 4;
    case DType::kINT64:
      return 8;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kUINT8:
      return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
    case DType::kFP8E4M3:
      return "fp8e4m3";
    case DType::kFP8E5M2:
      return "fp8e5m2";
    case DType::kINT32:
      return "int32";
    case DType::kINT64:
      return "int64";
    case DType::kUINT8:
      return "uint8";
  }
  return "?";
}

// Row-major view of up to kMaxDims dimensions. Strides are in elements.
struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kFP32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* ptr, DType t, std::initializer_list<int64_t> dims) : data(ptr), dtype(t) {
    REPLAY_REQUIRE(dims.size() <= static_cast<size_t>(kMaxDims), "too many dimensions");
    ndim = static_cast<int>(dims.size());
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
    set_contiguous_strides();
  }

  void set_contiguous_strides() {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      stride[i] = s;
      s *= shape[i];
    }
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }

  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }

  // Typed pointer; the caller states the element type it expects.
  template <typename T>
  T* as(DType expected) const {
    REPLAY_REQUIRE(dtype == expected, std::string("tensor is ") + dtype_name(dtype) +
                                          ", expected " + dtype_name(expected));
    return static_cast<T*>(data);
  }

  std::string describe() const {
    std::string s = std::string(dtype_name(dtype)) + "[";
    for (int i = 0; i < ndim; ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

}  // namespace replay
