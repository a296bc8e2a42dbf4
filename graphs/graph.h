// graph.h: Graph, RAII over one cudaGraph_t and its cudaGraphExec_t: capture on a non-blocking
// stream the caller owns (CaptureStream), instantiate and upload, launch, update in place with
// re-instantiation as the reported fallback, node count, capture and instantiate times, dot dump. A
// capture that fails throws replay::Error naming the graph and the fault class ("host
// synchronization during capture (cudaErrorStreamCaptureUnsupported)"), and leaves no capture open
// and no error pending.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <string_view>

namespace replay::graphs {

// Global: any capture-unsafe call in any thread fails the capture (the safe default). Thread-local:
// only this thread's unsafe calls do, so other threads (data loading, logging) can keep using CUDA.
enum class CaptureMode { kGlobal, kThreadLocal };

const char* capture_mode_name(CaptureMode mode);
cudaStreamCaptureMode to_cuda(CaptureMode mode);

// What enqueues the captured work; it launches everything on the stream it is given (or on side
// streams forked from it and joined back before it returns).
using Work = std::function<void(cudaStream_t)>;

// A non-blocking stream owned by the graph layer, used only for capture (never the legacy stream).
class CaptureStream {
 public:
  CaptureStream();
  ~CaptureStream();
  CaptureStream(const CaptureStream&) = delete;
  CaptureStream& operator=(const CaptureStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

struct GraphStats {
  std::string name;
  size_t nodes = 0;  // top-level nodes (a conditional node counts once, its bodies are not added)
  double capture_ms = 0;      // host time from begin to end of the last capture
  double instantiate_ms = 0;  // host time of the last instantiation, upload included
  int updates_in_place = 0;   // successful cudaGraphExecUpdate calls
  int reinstantiations = 0;   // updates that fell back to a new executable
};

struct UpdateReport {
  std::string graph;      // the graph's name
  bool in_place = false;  // true: cudaGraphExecUpdate kept the executable; false: re-instantiated
  std::string reason;  // why the update fell back, e.g. "cudaGraphExecUpdateErrorTopologyChanged at
                       // a kernel node"; empty when in place
  double ms = 0;       // host time of capture plus update (or re-instantiation)
};

class Graph {
 public:
  explicit Graph(std::string name);
  ~Graph();
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Captures what `work` enqueues on `stream` (a CaptureStream) into a new graph, replacing the
  // previous graph but not the executable. Throws Error on any capture fault; nothing is left
  // capturing.
  void capture(cudaStream_t stream, const Work& work, CaptureMode mode = CaptureMode::kGlobal);
  // Instantiates the captured graph and uploads it on `stream`. Writes <dir>/<name>.dot when the
  // environment variable REPLAY_GRAPH_DUMP=<dir> is set.
  void instantiate(cudaStream_t stream);
  // capture() then instantiate().
  void build(cudaStream_t capture_stream, const Work& work, cudaStream_t upload_stream,
             CaptureMode mode = CaptureMode::kGlobal);
  // Captures `work` again and updates the executable in place (cudaGraphExecUpdate); when the
  // update is refused (topology or node types changed) re-instantiates and says why in the report
  // (and on stderr).
  UpdateReport update(cudaStream_t capture_stream, const Work& work, cudaStream_t upload_stream,
                      CaptureMode mode = CaptureMode::kGlobal);

  void launch(cudaStream_t stream) const;

  bool captured() const { return graph_ != nullptr; }
  bool instantiated() const { return exec_ != nullptr; }
  const std::string& name() const { return stats_.name; }
  const GraphStats& stats() const { return stats_; }
  cudaGraph_t graph() const { return graph_; }
  cudaGraphExec_t exec() const { return exec_; }

  // Writes the graph in Graphviz format (cudaGraphDebugDotPrint); verbose adds node parameters.
  void dump_dot(const std::string& path, bool verbose = false) const;

 private:
  cudaGraph_t capture_raw(cudaStream_t stream, const Work& work, CaptureMode mode);
  void reset() noexcept;

  GraphStats stats_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The fault class of a CUDA error raised during capture, with its code name:
// "host synchronization during capture (cudaErrorStreamCaptureUnsupported)". `call` is the failing
// call's text when known (it separates synchronization, allocation and queries, which share error
// 900).
std::string capture_fault_class(cudaError_t code, std::string_view call = {});
// One line on how to fix that fault, from the troubleshooting catalogue; empty when there is none.
std::string capture_fault_fix(cudaError_t code, std::string_view call = {});
// The cudaError_t named at the start of a replay::Error status ("cudaErrorStreamCaptureUnsupported
// (...)"); cudaErrorUnknown when the status names no capture-related error.
cudaError_t capture_error_from_status(std::string_view status);

// A file name made from a graph name: characters other than [A-Za-z0-9._-] become '_'.
std::string dot_file_name(std::string_view graph_name);

}  // namespace replay::graphs
