// check.cpp: status-to-message translation for every library replay calls.
#include "common/check.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn_graph.h>
#include <mpi.h>   // MPI_Error_string
#include <hdf5.h>  // H5Eprint2

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace replay {

namespace {
std::atomic<int> g_error_rank{-1};
std::atomic<int64_t> g_launch_delay_ns{0};

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
    default:
      return "CUBLAS_STATUS_UNKNOWN";
  }
}
}  // namespace

void set_error_rank(int rank) {
  g_error_rank.store(rank);
}
int error_rank() {
  return g_error_rank.load();
}

void set_host_launch_delay_us(double microseconds) {
  REPLAY_REQUIRE(microseconds >= 0 && microseconds <= 1e6, "host delay must be in [0, 1e6] us");
  g_launch_delay_ns.store(static_cast<int64_t>(microseconds * 1e3), std::memory_order_relaxed);
}
double host_launch_delay_us() {
  return static_cast<double>(g_launch_delay_ns.load(std::memory_order_relaxed)) / 1e3;
}

void throw_error(const char* library, const std::string& status, const char* call, const char* file,
                 int line, const std::string& detail) {
  std::ostringstream os;
  os << library << " error " << status << " in " << call << " at " << file << ":" << line;
  if (int r = error_rank(); r >= 0) os << " [rank " << r << "]";
  if (!detail.empty()) os << ": " << detail;
  throw Error(library, status, os.str());
}

namespace detail {

namespace {

void report(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  std::string s = std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
  throw_error("CUDA", s, call, file, line);
}

void report(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw_error("cuBLASLt", cublas_status_name(status), call, file, line);
}

void report(cudnnStatus_t status, const char* call, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  throw_error("cuDNN", cudnnGetErrorString(status), call, file, line, last);
}

void report(ncclResult_t status, const char* call, const char* file, int line) {
  if (status == ncclSuccess) return;
  // ncclGetLastError takes a communicator; nullptr asks for the last error of any.
  const char* last = ncclGetLastError(nullptr);
  throw_error("NCCL", ncclGetErrorString(status), call, file, line, last ? last : "");
}

}  // namespace

// The template every call site instantiates by declaration (check.h); its four instantiations live
// here, where the library headers are.
template <typename Status>
void check(Status status, const char* call, const char* file, int line) {
  report(status, call, file, line);
}
template void check(cudaError_t, const char*, const char*, int);
template void check(cublasStatus_t, const char*, const char*, int);
template void check(cudnnStatus_t, const char*, const char*, int);
template void check(ncclResult_t, const char*, const char*, int);

void host_launch_delay() {
  const int64_t ns = g_launch_delay_ns.load(std::memory_order_relaxed);
  if (ns <= 0) return;
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < end) {
  }
}

void check_launch(int cuda_status, const char* file, int line) {
  check(static_cast<cudaError_t>(cuda_status), "kernel launch", file, line);
  host_launch_delay();
}

void check_mpi(int status, const char* call, const char* file, int line) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Error_string(status, text, &len);
  throw_error("MPI", len > 0 ? std::string(text, len) : "error " + std::to_string(status), call,
              file, line);
}

void check_hdf5(int64_t status, const char* call, const char* file, int line) {
  if (status >= 0) return;
  // Collect HDF5's own error stack into the message rather than letting it print on its own.
  std::string stack;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* out = static_cast<std::string*>(data);
        if (n > 0) *out += "; ";
        *out += e->func_name ? e->func_name : "?";
        *out += ": ";
        *out += e->desc ? e->desc : "";
        return 0;
      },
      &stack);
  H5Eclear2(H5E_DEFAULT);
  throw_error("HDF5", "failure (" + std::to_string(status) + ")", call, file, line, stack);
}

void clear_last_cuda_error() {
  (void)cudaGetLastError();
}

}  // namespace detail
}  // namespace replay
