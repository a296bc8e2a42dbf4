// conditional.cu: conditional nodes added to the capture in progress, their condition kernels, and
// the one-shot graph used when no capture is in progress.
#include "graphs/conditional.h"

#include <cuda_runtime.h>

#include "common/check.h"

#if CUDART_VERSION < 13000
#error \
    "graphs/conditional.cu uses the CUDA 13 graph API (edge data in cudaGraphAddNode and capture queries)"
#endif

namespace replay::graphs {

namespace {

__global__ void set_if_equal_kernel(cudaGraphConditionalHandle handle, const int32_t* flag,
                                    int32_t value) {
  cudaGraphSetConditional(handle, *flag == value ? 1u : 0u);
}

__global__ void set_if_nonzero_kernel(cudaGraphConditionalHandle handle, const int32_t* flag) {
  cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}

__global__ void repeat_begin_kernel(cudaGraphConditionalHandle handle, const int32_t* trip_count,
                                    int32_t* iteration) {
  *iteration = 0;
  cudaGraphSetConditional(handle, *trip_count > 0 ? 1u : 0u);
}

__global__ void repeat_next_kernel(cudaGraphConditionalHandle handle, const int32_t* trip_count,
                                   int32_t* iteration) {
  const int32_t next = *iteration + 1;
  *iteration = next;
  cudaGraphSetConditional(handle, next < *trip_count ? 1u : 0u);
}

}  // namespace

Conditionals::Conditionals() {
  for (int i = 0; i < kMaxDepth; ++i) {
    cudaStream_t s = nullptr;
    REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    body_streams_.push_back(s);
  }
}

Conditionals::~Conditionals() {
  for (cudaStream_t s : body_streams_) cudaStreamDestroy(s);
}

void Conditionals::add_to_capture(cudaStream_t stream, const std::string& name,
                                  cudaGraphConditionalNodeType type, const SetCondition& before,
                                  const Work& body, const SetCondition& after_body) {
  REPLAY_REQUIRE(depth_ < kMaxDepth, "conditional '" + name + "': more than " +
                                         std::to_string(kMaxDepth) + " nested conditional bodies");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  REPLAY_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr, nullptr));
  REPLAY_REQUIRE(status == cudaStreamCaptureStatusActive && graph != nullptr,
                 "conditional '" + name + "': the stream is not capturing");

  // The handle belongs to the graph that holds the node; its value resets to 0 at every launch and
  // the condition kernel, captured just before the node, sets it.
  cudaGraphConditionalHandle handle{};
  REPLAY_CUDA_CHECK(
      cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  before(stream, handle);

  // The node depends on whatever the stream's next node would depend on (the condition kernel), and
  // becomes the stream's only dependency, so later work runs after the whole conditional.
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t num_deps = 0;
  REPLAY_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, &edges, &num_deps));
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = type;
  params.conditional.size = 1;
  cudaGraphNode_t node = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, num_deps, &params));
  REPLAY_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                        cudaStreamSetCaptureDependencies));

  // Capture the body into the node's body graph (owned by the node) on this nesting level's stream.
  cudaStream_t body_stream = body_streams_[static_cast<size_t>(depth_)];
  REPLAY_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body_stream, params.conditional.phGraph_out[0],
                                                  nullptr, nullptr, 0,
                                                  cudaStreamCaptureModeThreadLocal));
  ++depth_;
  try {
    body(body_stream);
    if (after_body) after_body(body_stream, handle);
  } catch (...) {
    --depth_;
    cudaGraph_t unused = nullptr;
    (void)cudaStreamEndCapture(body_stream, &unused);
    (void)cudaGetLastError();  // the enclosing capture is abandoned by whoever began it
    throw;
  }
  --depth_;
  cudaGraph_t body_graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(body_stream, &body_graph);
  if (end != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("CUDA graph", cudaGetErrorName(end),
                "conditional '" + name +
                    "': capture of the body failed: " + capture_fault_class(end) +
                    " (bodies may hold kernels, memcpy, memset and conditionals only)");
  }
}

void Conditionals::add(cudaStream_t stream, const std::string& name,
                       cudaGraphConditionalNodeType type, const SetCondition& before,
                       const Work& body, const SetCondition& after_body) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  REPLAY_REQUIRE(status != cudaStreamCaptureStatusInvalidated,
                 "conditional '" + name + "': the capture on this stream was invalidated earlier");
  if (status == cudaStreamCaptureStatusActive) {
    add_to_capture(stream, name, type, before, body, after_body);
    return;
  }
  // Not capturing: a graph of its own, launched once. Its executable is released by the driver when
  // the launch completes, so nothing waits here.
  Graph one_shot("conditional." + name);
  one_shot.capture(
      one_shot_stream_.get(),
      [&](cudaStream_t s) { add_to_capture(s, name, type, before, body, after_body); },
      CaptureMode::kThreadLocal);
  one_shot.instantiate(stream);
  one_shot.launch(stream);
}

void Conditionals::if_equal(cudaStream_t stream, const std::string& name, const int32_t* flag,
                            int32_t value, const Work& body) {
  REPLAY_REQUIRE(flag != nullptr, "conditional '" + name + "' needs its device flag");
  add(
      stream, name, cudaGraphCondTypeIf,
      [&](cudaStream_t s, cudaGraphConditionalHandle h) {
        set_if_equal_kernel<<<1, 1, 0, s>>>(h, flag, value);
        REPLAY_LAUNCH_CHECK();
      },
      body, nullptr);
}

void Conditionals::while_nonzero(cudaStream_t stream, const std::string& name, const int32_t* flag,
                                 const Work& body) {
  REPLAY_REQUIRE(flag != nullptr, "conditional '" + name + "' needs its device flag");
  const SetCondition test = [&](cudaStream_t s, cudaGraphConditionalHandle h) {
    set_if_nonzero_kernel<<<1, 1, 0, s>>>(h, flag);
    REPLAY_LAUNCH_CHECK();
  };
  add(stream, name, cudaGraphCondTypeWhile, test, body, test);
}

void Conditionals::repeat(cudaStream_t stream, const std::string& name, const int32_t* trip_count,
                          int32_t* iteration, const Work& body) {
  REPLAY_REQUIRE(trip_count != nullptr && iteration != nullptr,
                 "conditional '" + name + "' needs its device trip count and iteration counter");
  add(
      stream, name, cudaGraphCondTypeWhile,
      [&](cudaStream_t s, cudaGraphConditionalHandle h) {
        repeat_begin_kernel<<<1, 1, 0, s>>>(h, trip_count, iteration);
        REPLAY_LAUNCH_CHECK();
      },
      body,
      [&](cudaStream_t s, cudaGraphConditionalHandle h) {
        repeat_next_kernel<<<1, 1, 0, s>>>(h, trip_count, iteration);
        REPLAY_LAUNCH_CHECK();
      });
}

}  // namespace replay::graphs
