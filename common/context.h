// context.h: the per-process device context. Owns the device choice, non-blocking streams, the
// cuBLASLt and cuDNN handles bound to the work stream, and the run's Arena; reports the environment
// (GPU, clocks, driver and library versions) for benchmark headers and JSON.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/arena.h"

namespace replay {

// Ordered (key, value) pairs: printed as the benchmark header and written into the JSON summary.
struct EnvironmentReport {
  std::vector<std::pair<std::string, std::string>> fields;
  std::string get(const std::string& key) const;
  std::string to_text() const;  // "key: value" lines
};

class Context {
 public:
  // Selects `device`, checks it is a GPU replay can run on (compute capability 9.0, unless
  // allow_any_gpu), creates one work stream and `side_streams` more (all non-blocking), and the
  // library handles. Throws Error with a clear message when there is no such GPU.
  explicit Context(int device = 0, int side_streams = 2, bool allow_any_gpu = false);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  const cudaDeviceProp& props() const { return props_; }
  int sm_count() const { return props_.multiProcessorCount; }

  // The work stream: every op of a step is launched on it (or on side streams forked from it).
  cudaStream_t stream() const { return stream_; }
  cudaStream_t side_stream(int i) const { return side_streams_.at(static_cast<size_t>(i)); }
  int side_stream_count() const { return static_cast<int>(side_streams_.size()); }

  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  cudnnHandle_t cudnn() const { return cudnn_; }  // bound to stream()

  // The run's single allocation; created once, after planning.
  Arena& create_arena(ArenaPlan plan);
  bool has_arena() const { return arena_ != nullptr; }
  Arena& arena() const;

  EnvironmentReport environment() const;

  // Number of CUDA devices visible, 0 when there is no driver or no GPU (never throws).
  static int device_count();

 private:
  int device_ = 0;
  cudaDeviceProp props_{};
  cudaStream_t stream_ = nullptr;
  std::vector<cudaStream_t> side_streams_;
  cublasLtHandle_t cublaslt_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  std::unique_ptr<Arena> arena_;
};

}  // namespace replay
