// check.h: one checking header for every library replay calls (CUDA runtime, cuBLASLt, cuDNN, the
// cuDNN frontend, NCCL, MPI, HDF5). A failed call throws replay::Error whose message names the
// library, the status string, the call, file:line and the rank. Library code throws; main() catches
// (see replay::run_main) and turns the error into a clear message and a non-zero exit.
//
// The header includes no library header: a status type is a template parameter, and check.cpp, the
// only file that sees every library, instantiates the check for cudaError_t, cublasStatus_t,
// cudnnStatus_t and ncclResult_t. So a TensorView (tensor.h includes this) costs no cuDNN or NCCL
// parse, and a call site, which has its library's header anyway, gets the right message.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace replay {

// The error every replay component throws. what() is the full one-line message.
class Error : public std::runtime_error {
 public:
  Error(std::string library, std::string status, std::string message)
      : std::runtime_error(std::move(message)),
        library_(std::move(library)),
        status_(std::move(status)) {}
  const std::string& library() const { return library_; }  // "CUDA", "cuBLASLt", "replay", ...
  const std::string& status() const { return status_; }    // the library's status string

 private:
  std::string library_;
  std::string status_;
};

// The rank printed in error messages and logs; -1 (the default) prints nothing.
void set_error_rank(int rank);
int error_rank();

// Throws Error with "<library> error <status> in <call> at <file>:<line> [rank r]: <detail>".
[[noreturn]] void throw_error(const char* library, const std::string& status, const char* call,
                              const char* file, int line, const std::string& detail = {});

// --host-delay-us: a host busy-wait of this many microseconds after every kernel launch
// (REPLAY_LAUNCH_CHECK) and every library launch (cuBLASLt matmul, cuDNN execute), so eager work
// pays it per launch and a graph only while it is captured: what a slower host (Python, a
// framework's dispatcher) costs, and what graphs hide. Process-wide, 0 (off) by default; set it
// before the run, not while launches are in flight.
void set_host_launch_delay_us(double microseconds);
double host_launch_delay_us();

namespace detail {
// Defined for cudaError_t, cublasStatus_t, cudnnStatus_t and ncclResult_t (check.cpp).
template <typename Status>
void check(Status status, const char* call, const char* file, int line);
// After a kernel launch: the launch's error (cudaGetLastError), then the host launch delay.
void check_launch(int cuda_status, const char* file, int line);
// Before a library launch: the host launch delay alone.
void host_launch_delay();
void check_mpi(int status, const char* call, const char* file, int line);
void check_hdf5(int64_t status, const char* call, const char* file, int line);
// After an expected failure (a refused capture, a failed graph update), the sticky-free part of the
// error state is cleared so that a later check does not blame an innocent launch.
void clear_last_cuda_error();
}  // namespace detail

}  // namespace replay

#define REPLAY_CUDA_CHECK(call) ::replay::detail::check((call), #call, __FILE__, __LINE__)
#define REPLAY_CUBLAS_CHECK(call) ::replay::detail::check((call), #call, __FILE__, __LINE__)
#define REPLAY_CUDNN_CHECK(call) ::replay::detail::check((call), #call, __FILE__, __LINE__)
#define REPLAY_NCCL_CHECK(call) ::replay::detail::check((call), #call, __FILE__, __LINE__)
#define REPLAY_MPI_CHECK(call) ::replay::detail::check_mpi((call), #call, __FILE__, __LINE__)
// HDF5 calls return herr_t or hid_t; a negative value is a failure.
#define REPLAY_HDF5_CHECK(call) \
  ::replay::detail::check_hdf5(static_cast<int64_t>(call), #call, __FILE__, __LINE__)
// Every kernel launch is followed by this: it reports launch-configuration errors at once.
#define REPLAY_LAUNCH_CHECK() \
  ::replay::detail::check_launch(static_cast<int>(cudaGetLastError()), __FILE__, __LINE__)

// Precondition check for replay's own code: throws Error("replay", "invalid argument", ...).
#define REPLAY_REQUIRE(cond, detail_msg)                                                \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::replay::throw_error("replay", "precondition failed", #cond, __FILE__, __LINE__, \
                            (detail_msg));                                              \
  } while (0)
