// compare.h: what every op test uses: the tolerance table, element-wise comparison that prints the
// worst element on failure, seeded random inputs, and a small RAII device buffer for tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // the typed cudaMalloc DeviceBuffer uses
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <functional>
#include <string>
#include <vector>

#include "common/tensor.h"  // DType

namespace replay::test {

struct Tolerance {
  double atol;
  double rtol;
};

// The tolerance table: one entry per (op, direction, storage type), e.g. "layernorm.fwd.bf16".
// An unknown key is a test bug and fails loudly.
Tolerance tolerance(const std::string& key);

// Passes when |got - ref| <= atol + rtol * |ref| for every element and nothing is NaN/Inf where ref
// is finite. On failure: how many elements failed, the worst one (index, got, ref, error), the
// first few.
::testing::AssertionResult all_close(const std::string& what, const float* got, const double* ref,
                                     size_t n, Tolerance tol);
::testing::AssertionResult all_close(const std::string& what, const std::vector<float>& got,
                                     const std::vector<double>& ref, Tolerance tol);
// Bitwise equality of two float arrays (eager against graphed runs), naming the first difference.
::testing::AssertionResult bit_equal(const std::string& what, const void* a, const void* b,
                                     size_t bytes);
// The same for two vectors, which must also have the same length.
template <typename T>
::testing::AssertionResult same_bits(const std::string& what, const std::vector<T>& a,
                                     const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  return bit_equal(what, a.data(), b.data(), a.size() * sizeof(T));
}

// Seeded inputs; never zeros.
std::vector<float> random_uniform(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
std::vector<float> random_normal(size_t n, uint64_t seed, float mean = 0.0f, float stddev = 1.0f);

// Conversions between float and bf16 (round to nearest even), and rounding a float vector through
// bf16 so that references see exactly the inputs the GPU sees.
std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x);
std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& x);
std::vector<float> round_bf16(const std::vector<float>& x);
// The same for a 16-bit storage type named at run time (fp16 or bf16), as raw bits: the tests of
// ops that take either.
uint16_t to_bits(float v, DType t);
float from_bits(uint16_t b, DType t);
std::vector<uint16_t> to_storage(const std::vector<float>& v, DType t);
std::vector<float> from_storage(const std::vector<uint16_t>& v, DType t);
std::vector<double> to_double(const std::vector<float>& x);

// Finite differences for the fp64 CPU references: d loss / d v by central differences, perturbing
// each element of v in turn (and restoring it); grad_close passes when max |analytic - numeric| <=
// tol * max |numeric| and names the worst element otherwise; dot is the plain inner product (a
// scalar loss from an upstream gradient).
std::vector<double> numeric_grad(std::vector<double>& v, const std::function<double()>& loss,
                                 double h = 1e-6);
::testing::AssertionResult grad_close(const std::string& what, const std::vector<double>& analytic,
                                      const std::vector<double>& numeric, double tol = 1e-6);
double dot(const std::vector<double>& a, const std::vector<double>& b);

// Owning device buffer for tests only (workloads use the Arena). Contents start as 0xFF bytes
// (NaN).
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&ptr_, n * sizeof(T) + 16) != cudaSuccess)
      throw std::runtime_error("cudaMalloc");
    // Synchronous set-up: the memset runs on the legacy stream, which replay's non-blocking streams
    // do not wait for, so wait here before anything else touches the buffer.
    if (cudaMemset(ptr_, 0xFF, n * sizeof(T) + 16) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess)
      throw std::runtime_error("cudaMemset");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    // A pageable cudaMemcpy may return before its DMA lands: wait, as above.
    if (cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess)
      throw std::runtime_error("cudaMemcpy H2D");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H");
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace replay::test
