// nested-conditional-probe: an IF node inside a WHILE node, built two ways, launched three times
// with the IF's flag 1, 0, 1, checking the count the IF's body adds
// (lab/nested_conditional/README.md).
//
//   raw      the CUDA 13 graph API alone: the graph built node by node (cudaGraphAddNode), each
//            conditional handle created on the graph that holds its node; no replay code.
//   replay   the same through replay's graphs::Conditionals in a stream capture, as
//            tests/graphs/test_conditional_gpu.cu's Conditional.IfNestedInWhile does.
//
// A second argument `memset` puts a memset node (the count to 0) before the WHILE node, as the test
// does, instead of a cudaMemsetAsync before each launch.
//
// Exit 0 when every launch gave the expected count, 1 otherwise (a CUDA error included).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "common/check.h"
#include "graphs/conditional.h"
#include "graphs/graph.h"

namespace {

constexpr int kTrips = 4;

__global__ void while_begin_kernel(cudaGraphConditionalHandle h, int32_t* iteration) {
  *iteration = 0;
  cudaGraphSetConditional(h, kTrips > 0 ? 1u : 0u);
}

__global__ void while_next_kernel(cudaGraphConditionalHandle h, int32_t* iteration) {
  const int32_t next = *iteration + 1;
  *iteration = next;
  cudaGraphSetConditional(h, next < kTrips ? 1u : 0u);
}

__global__ void if_set_kernel(cudaGraphConditionalHandle h, const int32_t* flag) {
  cudaGraphSetConditional(h, *flag == 1 ? 1u : 0u);
}

__global__ void increment_kernel(int32_t* count) {
  *count += 1;
}

cudaGraphNode_t add_kernel(cudaGraph_t g, const cudaGraphNode_t* deps, size_t n, void* fn,
                           void** args) {
  cudaKernelNodeParams p{};
  p.func = fn;
  p.gridDim = dim3(1);
  p.blockDim = dim3(1);
  p.kernelParams = args;
  cudaGraphNode_t node = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphAddKernelNode(&node, g, deps, n, &p));
  return node;
}

// A conditional node of `type` on `g` after `dep`, its handle created on `g`; returns the body.
cudaGraph_t add_conditional(cudaGraph_t g, cudaGraphNode_t dep, cudaGraphConditionalNodeType type,
                            cudaGraphConditionalHandle handle, cudaGraphNode_t* node) {
  cudaGraphNodeParams p{};
  p.type = cudaGraphNodeTypeConditional;
  p.conditional.handle = handle;
  p.conditional.type = type;
  p.conditional.size = 1;
  REPLAY_CUDA_CHECK(cudaGraphAddNode(node, g, &dep, nullptr, 1, &p));
  return p.conditional.phGraph_out[0];
}

cudaGraphExec_t build_raw(int32_t* iteration, int32_t* flag, int32_t* count, bool memset) {
  cudaGraph_t g = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphCreate(&g, 0));
  cudaGraphNode_t zero = nullptr;
  if (memset) {
    cudaMemsetParams m{};
    m.dst = count;
    m.value = 0;
    m.elementSize = 4;
    m.width = 1;
    m.height = 1;
    REPLAY_CUDA_CHECK(cudaGraphAddMemsetNode(&zero, g, nullptr, 0, &m));
  }
  cudaGraphConditionalHandle outer{};
  REPLAY_CUDA_CHECK(cudaGraphConditionalHandleCreate(&outer, g, 0, cudaGraphCondAssignDefault));
  void* begin_args[] = {&outer, &iteration};
  cudaGraphNode_t begin = add_kernel(g, zero ? &zero : nullptr, zero ? 1 : 0,
                                     reinterpret_cast<void*>(while_begin_kernel), begin_args);
  cudaGraphNode_t while_node = nullptr;
  cudaGraph_t body = add_conditional(g, begin, cudaGraphCondTypeWhile, outer, &while_node);

  cudaGraphConditionalHandle inner{};
  REPLAY_CUDA_CHECK(cudaGraphConditionalHandleCreate(&inner, body, 0, cudaGraphCondAssignDefault));
  void* set_args[] = {&inner, &flag};
  cudaGraphNode_t set =
      add_kernel(body, nullptr, 0, reinterpret_cast<void*>(if_set_kernel), set_args);
  cudaGraphNode_t if_node = nullptr;
  cudaGraph_t if_body = add_conditional(body, set, cudaGraphCondTypeIf, inner, &if_node);
  void* inc_args[] = {&count};
  add_kernel(if_body, nullptr, 0, reinterpret_cast<void*>(increment_kernel), inc_args);
  void* next_args[] = {&outer, &iteration};
  add_kernel(body, &if_node, 1, reinterpret_cast<void*>(while_next_kernel), next_args);

  cudaGraphExec_t exec = nullptr;
  REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  REPLAY_CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}

int run(const std::string& which, bool memset) {
  int32_t *iteration = nullptr, *flag = nullptr, *count = nullptr, *trips = nullptr;
  REPLAY_CUDA_CHECK(cudaMalloc(&iteration, 4));
  REPLAY_CUDA_CHECK(cudaMalloc(&flag, 4));
  REPLAY_CUDA_CHECK(cudaMalloc(&count, 4));
  REPLAY_CUDA_CHECK(cudaMalloc(&trips, 4));
  const int32_t trip_count = kTrips;
  REPLAY_CUDA_CHECK(cudaMemcpy(trips, &trip_count, 4, cudaMemcpyHostToDevice));
  cudaStream_t s = nullptr;
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  cudaGraphExec_t raw = nullptr;
  replay::graphs::CaptureStream cap;
  replay::graphs::Conditionals cond;
  replay::graphs::Graph g("nested");
  if (which == "raw") {
    raw = build_raw(iteration, flag, count, memset);
  } else {
    g.build(
        cap.get(),
        [&](cudaStream_t c) {
          if (memset) REPLAY_CUDA_CHECK(cudaMemsetAsync(count, 0, 4, c));
          cond.repeat(c, "outer", trips, iteration, [&](cudaStream_t b) {
            cond.if_equal(b, "inner", flag, 1, [&](cudaStream_t bb) {
              increment_kernel<<<1, 1, 0, bb>>>(count);
              REPLAY_LAUNCH_CHECK();
            });
          });
        },
        s);
  }
  int bad = 0;
  for (int32_t e : {1, 0, 1}) {
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(flag, &e, 4, cudaMemcpyHostToDevice, s));
    if (!memset) REPLAY_CUDA_CHECK(cudaMemsetAsync(count, 0, 4, s));
    if (raw != nullptr)
      REPLAY_CUDA_CHECK(cudaGraphLaunch(raw, s));
    else
      g.launch(s);
    const cudaError_t sync = cudaStreamSynchronize(s);
    int32_t got = -1;
    if (sync == cudaSuccess) REPLAY_CUDA_CHECK(cudaMemcpy(&got, count, 4, cudaMemcpyDeviceToHost));
    const int32_t want = e ? kTrips : 0;
    std::printf("%s: flag %d: %s, count %d (want %d)\n", which.c_str(), e, cudaGetErrorName(sync),
                got, want);
    if (sync != cudaSuccess) return 1;  // the context is gone
    bad += got != want;
  }
  if (raw != nullptr) REPLAY_CUDA_CHECK(cudaGraphExecDestroy(raw));
  REPLAY_CUDA_CHECK(cudaStreamDestroy(s));
  for (int32_t* p : {iteration, flag, count, trips}) REPLAY_CUDA_CHECK(cudaFree(p));
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  const bool memset = argc > 2 && std::strcmp(argv[2], "memset") == 0;
  if ((which != "raw" && which != "replay") || (argc > 2 && !memset) || argc > 3) {
    std::fprintf(stderr, "usage: nested-conditional-probe raw|replay [memset]\n");
    return 2;
  }
  try {
    return run(which, memset);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nested-conditional-probe: %s\n", e.what());
    return 1;
  }
}
