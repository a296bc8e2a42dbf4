// common.h: what every exercise shares: --mode parsing, the exit-77 GPU check, CUDA checks that
// print the error name, the setup and graph steps that are not what an exercise is about (streams,
// events, zeroed buffers, end-capture-and-instantiate, one replay read back), the one result line a
// test checks, event timing, a spin kernel, and a child-process runner for the exercises whose
// broken mode crashes or hangs.
#pragma once

#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

// A call that must succeed: the exercise is not about it, so a failure ends the program (exit 1).
#define EX_CHECK(call)                                                                        \
  do {                                                                                        \
    cudaError_t ex_err_ = (call);                                                             \
    if (ex_err_ != cudaSuccess) {                                                             \
      std::printf("CHECK FAILED: %s -> %s (%d) at %s:%d\n", #call, cudaGetErrorName(ex_err_), \
                  static_cast<int>(ex_err_), __FILE__, __LINE__);                             \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// A call that may fail on purpose: returns its error and clears the thread's last-error slot, so
// the next check only sees new errors.
#define EX_TRY(call) ex::tried(call)

namespace ex {

inline cudaError_t tried(cudaError_t err) {
  cudaGetLastError();
  return err;
}

// "cudaErrorStreamCaptureUnsupported (900)".
inline std::string name(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + std::to_string(static_cast<int>(err)) + ")";
}

// The capture-related errors: 900 unsupported .. 907 captured event (cudaErrorStreamCapture*).
inline bool is_capture_error(cudaError_t err) {
  return err >= cudaErrorStreamCaptureUnsupported && err <= cudaErrorCapturedEvent;
}

enum class Mode { kBroken, kFixed };

struct Args {
  Mode mode = Mode::kBroken;
  bool child = false;  // set by run_child: this process is the child doing the risky part
  const char* mode_name() const { return mode == Mode::kBroken ? "broken" : "fixed"; }
  bool broken() const { return mode == Mode::kBroken; }
};

// Parses `--mode broken|fixed` (and the internal `--child`). Makes no CUDA call, so an exercise can
// still set CUDA environment variables afterwards.
inline Args parse_args(int argc, char** argv, const char* id) {
  Args args;
  bool have_mode = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mode") == 0 && i + 1 < argc) {
      const char* m = argv[++i];
      have_mode = std::strcmp(m, "broken") == 0 || std::strcmp(m, "fixed") == 0;
      args.mode = std::strcmp(m, "fixed") == 0 ? Mode::kFixed : Mode::kBroken;
    } else if (std::strcmp(argv[i], "--child") == 0) {
      args.child = true;
    }
  }
  if (!have_mode) {
    std::fprintf(stderr, "usage: %s --mode broken|fixed   (exercise %s)\n", argv[0], id);
    std::exit(2);
  }
  return args;
}

// Exits 77 (CTest's skip) when fewer than `min_devices` CUDA devices are visible.
inline void require_gpu(int min_devices = 1) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (count < min_devices) {
    std::printf("SKIPPED: %d CUDA device(s) visible, this exercise needs %d\n", count, min_devices);
    std::exit(77);
  }
}

// A non-blocking stream: it does not synchronize implicitly with the legacy default stream (C7).
inline cudaStream_t nonblocking_stream() {
  cudaStream_t stream;
  EX_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

// An event for ordering only (cudaEventDisableTiming): a fork, a join, a "done" mark.
inline cudaEvent_t untimed_event() {
  cudaEvent_t event;
  EX_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

// `count` elements of device memory set to zero (cudaMalloc, then cudaMemset).
template <typename T>
T* device_zeros(size_t count = 1) {
  T* data;
  EX_CHECK(cudaMalloc(&data, count * sizeof(T)));
  EX_CHECK(cudaMemset(data, 0, count * sizeof(T)));
  return data;
}

// *device, copied to the host with a blocking cudaMemcpy (once the work that writes it is done).
template <typename T>
T read_back(const T* device) {
  T host{};
  EX_CHECK(cudaMemcpy(&host, device, sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// The executable of a captured graph.
inline cudaGraphExec_t instantiate(cudaGraph_t graph) {
  cudaGraphExec_t exec;
  EX_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  return exec;
}

// Ends the capture on `stream`, which must succeed, stores the graph in *graph and returns its
// executable.
inline cudaGraphExec_t end_capture_and_instantiate(cudaStream_t stream, cudaGraph_t* graph) {
  EX_CHECK(cudaStreamEndCapture(stream, graph));
  return instantiate(*graph);
}

// How many nodes a graph has.
inline size_t node_count(cudaGraph_t graph) {
  size_t n = 0;
  EX_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  return n;
}

// Destroys an executable, then the graph it was instantiated from.
inline void destroy_graph(cudaGraphExec_t exec, cudaGraph_t graph) {
  EX_CHECK(cudaGraphExecDestroy(exec));
  EX_CHECK(cudaGraphDestroy(graph));
}

// How a capture exercise's fixed mode ends: ends the capture on `stream` (it must succeed),
// instantiates the graph, replays it once, synchronizes after the replay, outside any capture, and
// returns *result as the replay left it; the graph is destroyed.
template <typename T>
T end_capture_and_replay(cudaStream_t stream, const T* result) {
  cudaGraph_t graph;
  const cudaGraphExec_t exec = end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const T value = read_back(result);
  destroy_graph(exec, graph);
  return value;
}

// Prints the one result line, "<id> <mode>: <what happened>", or "<id> <mode> UNEXPECTED: ..." when
// the program did not behave as documented; returns the exit code (0 when it did).
inline int report(const char* id, const Args& args, bool as_documented, const char* fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(text, sizeof(text), fmt, ap);
  va_end(ap);
  std::printf("%s %s%s: %s\n", id, args.mode_name(), as_documented ? "" : " UNEXPECTED", text);
  std::fflush(stdout);
  return as_documented ? 0 : 1;
}

// Mean milliseconds per call of `enqueue` on `stream`, after one warm-up call, timed with events.
template <typename F>
float time_ms(cudaStream_t stream, int iters, F enqueue) {
  enqueue();
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  EX_CHECK(cudaEventCreate(&start));
  EX_CHECK(cudaEventCreate(&stop));
  EX_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) enqueue();
  EX_CHECK(cudaEventRecord(stop, stream));
  EX_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  EX_CHECK(cudaEventElapsedTime(&ms, start, stop));
  EX_CHECK(cudaEventDestroy(start));
  EX_CHECK(cudaEventDestroy(stop));
  return ms / iters;
}

// Busy-waits about `cycles` SM clock cycles: a kernel of known duration (about 1 ms per 1.8e6).
__device__ __forceinline__ void spin_kernel_body(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void spin_kernel(long long cycles) {
  spin_kernel_body(cycles);
}

// How a child process ended.
struct ChildResult {
  bool timed_out = false;  // killed after the timeout (a hang)
  int signal = 0;          // killed by this signal (a crash), 0 when it exited
  int exit_code = 0;       // its exit status when it exited
  std::string last_line;   // the last line it printed (its failing check, if any)
  std::string describe() const {
    std::string text;
    if (timed_out)
      text = "hung (killed after the timeout)";
    else if (signal != 0)
      text = std::string("crashed with signal ") + std::to_string(signal) + " (" +
             strsignal(signal) + ", shell exit " + std::to_string(128 + signal) + ")";
    else
      text = "exited with status " + std::to_string(exit_code);
    return last_line.empty() ? text : text + " [" + last_line + "]";
  }
};

// The last non-empty line of a file, without the "CHECK FAILED: " prefix (the parent reports it).
inline std::string last_line_of(const char* path) {
  std::string line, last;
  if (FILE* f = std::fopen(path, "r")) {
    char buf[1024];
    while (std::fgets(buf, sizeof(buf), f)) {
      line = buf;
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
      if (!line.empty()) last = line;
    }
    std::fclose(f);
  }
  const std::string prefix = "CHECK FAILED: ";
  if (last.compare(0, prefix.size(), prefix) == 0) last.erase(0, prefix.size());
  return last;
}

// Runs this same program again as `<exe> --mode <mode> --child` in a fresh process (fork + exec, so
// the child gets its own CUDA context) and waits at most `timeout_s`; a crash or hang stays in the
// child. The child's output goes to a temporary file, so only the parent prints the result line.
inline ChildResult run_child(const Args& args, double timeout_s) {
  std::fflush(stdout);
  char log_path[] = "/tmp/replay-exercise-child-XXXXXX";
  const int log_fd = mkstemp(log_path);
  const pid_t pid = fork();
  if (pid == 0) {
    if (log_fd >= 0) {
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
    }
    execl("/proc/self/exe", "/proc/self/exe", "--mode", args.mode_name(), "--child",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  ChildResult result;
  if (pid < 0) {
    if (log_fd >= 0) {
      close(log_fd);
      unlink(log_path);
    }
    result.exit_code = 127;
    return result;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!result.timed_out && WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  if (!result.timed_out && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (log_fd >= 0) {
    close(log_fd);
    result.last_line = last_line_of(log_path);
    unlink(log_path);
  }
  return result;
}

}  // namespace ex
