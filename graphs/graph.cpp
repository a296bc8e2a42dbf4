// graph.cpp: capture with fault classification, instantiate/upload, update in place or
// re-instantiate.
#include "graphs/graph.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <utility>

#include "common/check.h"

namespace replay::graphs {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

const char* update_result_name(cudaGraphExecUpdateResult r) {
  switch (r) {
    case cudaGraphExecUpdateSuccess:
      return "cudaGraphExecUpdateSuccess";
    case cudaGraphExecUpdateError:
      return "cudaGraphExecUpdateError";
    case cudaGraphExecUpdateErrorTopologyChanged:
      return "cudaGraphExecUpdateErrorTopologyChanged";
    case cudaGraphExecUpdateErrorNodeTypeChanged:
      return "cudaGraphExecUpdateErrorNodeTypeChanged";
    case cudaGraphExecUpdateErrorFunctionChanged:
      return "cudaGraphExecUpdateErrorFunctionChanged";
    case cudaGraphExecUpdateErrorParametersChanged:
      return "cudaGraphExecUpdateErrorParametersChanged";
    case cudaGraphExecUpdateErrorNotSupported:
      return "cudaGraphExecUpdateErrorNotSupported";
    case cudaGraphExecUpdateErrorUnsupportedFunctionChange:
      return "cudaGraphExecUpdateErrorUnsupportedFunctionChange";
    case cudaGraphExecUpdateErrorAttributesChanged:
      return "cudaGraphExecUpdateErrorAttributesChanged";
  }
  return "cudaGraphExecUpdateResult(unknown)";
}

const char* node_type_name(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel:
      return "kernel";
    case cudaGraphNodeTypeMemcpy:
      return "memcpy";
    case cudaGraphNodeTypeMemset:
      return "memset";
    case cudaGraphNodeTypeHost:
      return "host";
    case cudaGraphNodeTypeGraph:
      return "child graph";
    case cudaGraphNodeTypeEmpty:
      return "empty";
    case cudaGraphNodeTypeWaitEvent:
      return "event wait";
    case cudaGraphNodeTypeEventRecord:
      return "event record";
    case cudaGraphNodeTypeMemAlloc:
      return "memory allocation";
    case cudaGraphNodeTypeMemFree:
      return "memory free";
    case cudaGraphNodeTypeConditional:
      return "conditional";
    default:
      return "other";
  }
}

// Throws the capture failure of graph `name`; `cause` is the original error's message when there is
// one.
[[noreturn]] void throw_capture_failure(const std::string& name, cudaError_t code,
                                        const std::string& cause, cudaError_t end_status) {
  std::string msg = "graph '" + name + "': capture failed: " + capture_fault_class(code, cause);
  if (!cause.empty()) msg += "; cause: " + cause;
  if (end_status != cudaSuccess && end_status != code)
    msg += std::string("; cudaStreamEndCapture returned ") + cudaGetErrorName(end_status);
  const std::string fix = capture_fault_fix(code, cause);
  if (!fix.empty()) msg += ". Fix: " + fix;
  throw Error("CUDA graph", cudaGetErrorName(code), msg);
}

}  // namespace

const char* capture_mode_name(CaptureMode mode) {
  return mode == CaptureMode::kGlobal ? "global" : "thread-local";
}

cudaStreamCaptureMode to_cuda(CaptureMode mode) {
  return mode == CaptureMode::kGlobal ? cudaStreamCaptureModeGlobal
                                      : cudaStreamCaptureModeThreadLocal;
}

std::string capture_fault_class(cudaError_t code, std::string_view call) {
  std::string what;
  switch (code) {
    case cudaErrorStreamCaptureUnsupported:
      if (contains(call, "Synchronize") || contains(call, "cudaMemcpy(") ||
          contains(call, "cudaMemset("))
        what = "host synchronization during capture";
      else if (contains(call, "Malloc") || contains(call, "Free") || contains(call, "HostAlloc") ||
               contains(call, "HostRegister"))
        what = "memory allocation or free during capture";
      else if (contains(call, "Query"))
        what = "stream or event query during capture";
      else
        what = "operation not permitted during capture (host synchronization, allocation or query)";
      break;
    case cudaErrorStreamCaptureInvalidated:
      what =
          "capture invalidated by an earlier forbidden call (in global mode possibly from another "
          "thread)";
      break;
    case cudaErrorStreamCaptureMerge:
      what = "two separate captures were merged";
      break;
    case cudaErrorStreamCaptureUnmatched:
      what = "capture was not begun on this stream";
      break;
    case cudaErrorStreamCaptureUnjoined:
      what = "a stream forked from the capture stream was not joined back before the capture ended";
      break;
    case cudaErrorStreamCaptureIsolation:
      what =
          "dependency on work outside the capture (an event recorded before capture or on an "
          "uncaptured "
          "stream)";
      break;
    case cudaErrorStreamCaptureImplicit:
      what = "implicit dependency on the legacy default stream";
      break;
    case cudaErrorCapturedEvent:
      what = "synchronization on or query of an event recorded in the capture";
      break;
    case cudaErrorStreamCaptureWrongThread:
      what = "capture ended from a thread other than the one that began it";
      break;
    default:
      what = "CUDA error during capture";
      break;
  }
  return what + " (" + cudaGetErrorName(code) + ")";
}

std::string capture_fault_fix(cudaError_t code, std::string_view call) {
  switch (code) {
    case cudaErrorStreamCaptureUnsupported:
      if (contains(call, "Malloc") || contains(call, "Free") || contains(call, "HostAlloc") ||
          contains(call, "HostRegister"))
        return "plan every buffer before capture (Arena) and pin host memory at setup";
      if (contains(call, "Query")) return "query streams and events outside the captured region";
      return "move the host read after the replay, or keep the logic on the device (device "
             "scalars, "
             "conditional nodes)";
    case cudaErrorStreamCaptureInvalidated:
      return "find the first forbidden call (it failed with error 900); use thread-local capture "
             "when other "
             "threads must keep using CUDA";
    case cudaErrorStreamCaptureUnjoined:
      return "record an event on every side stream and make the capture stream wait on it before "
             "the region "
             "ends";
    case cudaErrorStreamCaptureIsolation:
      return "fork side streams from the capture stream (they wait on an event recorded on it) and "
             "wait on "
             "earlier work before the capture begins";
    case cudaErrorStreamCaptureImplicit:
      return "launch on explicit non-blocking streams, never on stream 0";
    case cudaErrorCapturedEvent:
      return "query or synchronize events outside the captured region";
    default:
      return {};
  }
}

cudaError_t capture_error_from_status(std::string_view status) {
  const cudaError_t codes[] = {cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated,
                               cudaErrorStreamCaptureMerge,       cudaErrorStreamCaptureUnmatched,
                               cudaErrorStreamCaptureUnjoined,    cudaErrorStreamCaptureIsolation,
                               cudaErrorStreamCaptureImplicit,    cudaErrorCapturedEvent,
                               cudaErrorStreamCaptureWrongThread};
  for (cudaError_t c : codes) {
    const std::string_view name = cudaGetErrorName(c);
    // The name must be followed by a non-identifier character, so that no name matches a longer
    // one.
    if (status.substr(0, name.size()) == name &&
        (status.size() == name.size() || status[name.size()] == ' '))
      return c;
  }
  return cudaErrorUnknown;
}

std::string dot_file_name(std::string_view graph_name) {
  std::string s(graph_name);
  for (char& c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  return (s.empty() ? "graph" : s) + ".dot";
}

CaptureStream::CaptureStream() {
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CaptureStream::~CaptureStream() {
  if (stream_) cudaStreamDestroy(stream_);
}

Graph::Graph(std::string name) {
  stats_.name = std::move(name);
}

Graph::~Graph() {
  reset();
}

Graph::Graph(Graph&& other) noexcept
    : stats_(std::move(other.stats_)),
      graph_(std::exchange(other.graph_, nullptr)),
      exec_(std::exchange(other.exec_, nullptr)) {}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    reset();
    stats_ = std::move(other.stats_);
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void Graph::reset() noexcept {
  // An executable still running is freed by the driver when it completes.
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}

cudaGraph_t Graph::capture_raw(cudaStream_t stream, const Work& work, CaptureMode mode) {
  const std::string& name = stats_.name;
  REPLAY_REQUIRE(
      stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread,
      "graph '" + name + "': capture needs an explicit stream (CaptureStream), not stream 0");
  unsigned flags = 0;
  REPLAY_CUDA_CHECK(cudaStreamGetFlags(stream, &flags));
  REPLAY_REQUIRE((flags & cudaStreamNonBlocking) != 0,
                 "graph '" + name + "': the capture stream must be non-blocking (CaptureStream)");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  REPLAY_REQUIRE(status == cudaStreamCaptureStatusNone,
                 "graph '" + name + "': the stream is already capturing (nested capture)");
  // An error left pending by earlier code would otherwise be blamed on this capture.
  if (const cudaError_t before = cudaGetLastError(); before != cudaSuccess) {
    throw Error("CUDA", cudaGetErrorName(before),
                "graph '" + name + "': an unchecked CUDA call failed before the capture began (" +
                    cudaGetErrorName(before) + ": " + cudaGetErrorString(before) + ")");
  }

  const auto t0 = Clock::now();
  REPLAY_CUDA_CHECK(cudaStreamBeginCapture(stream, to_cuda(mode)));

  // Ends the capture whatever state it is in; returns EndCapture's status and destroys a partial
  // graph.
  auto abandon = [&]() -> cudaError_t {
    cudaGraph_t partial = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
    (void)
        cudaGetLastError();  // expected failure: clear it so no later check blames an innocent call
    return end;
  };

  try {
    work(stream);
  } catch (const Error& e) {
    const cudaError_t pending = cudaGetLastError();
    const cudaError_t end = abandon();
    cudaError_t code = capture_error_from_status(e.status());
    if (code == cudaErrorUnknown && e.library() == "CUDA")
      code = pending != cudaSuccess ? pending : end;
    if (code == cudaErrorUnknown || code == cudaSuccess) {
      // Not a CUDA failure (a precondition in the region, say): rethrow it as is, capture closed.
      throw;
    }
    throw_capture_failure(name, code, e.what(), end);
  } catch (...) {
    abandon();
    throw;
  }

  // An unchecked forbidden call inside the region leaves its error pending: that is the first
  // fault.
  const cudaError_t pending = cudaGetLastError();
  REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status == cudaStreamCaptureStatusNone) {
    throw Error("CUDA graph", "capture ended early",
                "graph '" + name +
                    "': the region ended the capture itself (cudaStreamEndCapture inside the "
                    "captured work)");
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (end != cudaSuccess || pending != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    const cudaError_t code = pending != cudaSuccess ? pending : end;
    throw_capture_failure(name, code, "", end);
  }
  REPLAY_REQUIRE(graph != nullptr, "graph '" + name + "': cudaStreamEndCapture returned no graph");
  stats_.capture_ms = ms_since(t0);
  return graph;
}

void Graph::capture(cudaStream_t stream, const Work& work, CaptureMode mode) {
  cudaGraph_t fresh = capture_raw(stream, work, mode);
  if (graph_) cudaGraphDestroy(graph_);
  graph_ = fresh;
  size_t n = 0;
  REPLAY_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
  stats_.nodes = n;
}

void Graph::instantiate(cudaStream_t stream) {
  REPLAY_REQUIRE(graph_ != nullptr, "graph '" + stats_.name + "' instantiated before capture");
  const auto t0 = Clock::now();
  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph_, 0));
  if (exec_) cudaGraphExecDestroy(exec_);
  exec_ = exec;
  REPLAY_CUDA_CHECK(cudaGraphUpload(exec_, stream));
  stats_.instantiate_ms = ms_since(t0);
  if (const char* dir = std::getenv("REPLAY_GRAPH_DUMP"); dir != nullptr && dir[0] != '\0') {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    REPLAY_REQUIRE(!ec, std::string("REPLAY_GRAPH_DUMP: cannot create directory ") + dir + ": " +
                            ec.message());
    dump_dot((std::filesystem::path(dir) / dot_file_name(stats_.name)).string());
  }
}

void Graph::build(cudaStream_t capture_stream, const Work& work, cudaStream_t upload_stream,
                  CaptureMode mode) {
  capture(capture_stream, work, mode);
  instantiate(upload_stream);
}

UpdateReport Graph::update(cudaStream_t capture_stream, const Work& work,
                           cudaStream_t upload_stream, CaptureMode mode) {
  REPLAY_REQUIRE(exec_ != nullptr,
                 "graph '" + stats_.name + "' updated before it was instantiated");
  const auto t0 = Clock::now();
  cudaGraph_t fresh = capture_raw(capture_stream, work, mode);
  cudaGraphExecUpdateResultInfo info{};
  const cudaError_t status = cudaGraphExecUpdate(exec_, fresh, &info);
  UpdateReport report;
  report.graph = stats_.name;
  if (status == cudaSuccess) {
    cudaGraphDestroy(graph_);
    graph_ = fresh;
    stats_.updates_in_place += 1;
    report.in_place = true;
  } else {
    (void)cudaGetLastError();  // the refusal is expected; do not leave it for the next check
    report.reason = update_result_name(info.result);
    if (info.errorNode != nullptr) {
      cudaGraphNodeType type{};
      if (cudaGraphNodeGetType(info.errorNode, &type) == cudaSuccess)
        report.reason += std::string(" at a ") + node_type_name(type) + " node";
      (void)cudaGetLastError();
    }
    cudaGraphDestroy(graph_);
    graph_ = fresh;
    instantiate(upload_stream);
    stats_.reinstantiations += 1;
  }
  size_t n = 0;
  REPLAY_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
  stats_.nodes = n;
  report.ms = ms_since(t0);
  if (!report.in_place) {
    std::fprintf(
        stderr,
        "[replay graphs] graph '%s': in-place update refused (%s); re-instantiated in %.2f ms\n",
        stats_.name.c_str(), report.reason.c_str(), report.ms);
  }
  return report;
}

void Graph::launch(cudaStream_t stream) const {
  REPLAY_REQUIRE(exec_ != nullptr,
                 "graph '" + stats_.name + "' launched before it was instantiated");
  REPLAY_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

void Graph::dump_dot(const std::string& path, bool verbose) const {
  REPLAY_REQUIRE(graph_ != nullptr, "graph '" + stats_.name + "' dumped before capture");
  REPLAY_CUDA_CHECK(cudaGraphDebugDotPrint(
      graph_, path.c_str(),
      verbose ? cudaGraphDebugDotFlagsVerbose : cudaGraphDebugDotFlagsKernelNodeParams));
}

}  // namespace replay::graphs
