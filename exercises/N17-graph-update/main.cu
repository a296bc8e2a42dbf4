// N17: a change made after instantiation that never reaches the executable graph. The executable
// (cudaGraphExec_t) is a snapshot of the graph at cudaGraphInstantiate: editing the graph
// afterwards (cudaGraphKernelNodeSetParams on its nodes) changes nothing that replays, and
// cudaGraphExecUpdate, which does carry a new graph's parameters into the executable, refuses a
// graph whose topology changed; a caller that ignores its result keeps replaying the old graph. No
// error at replay. Three cases, broken and fixed:
//  1. new kernel parameters (a scale factor 2 -> 3): the graph's node edited (broken) against
//     cudaGraphExecUpdate with the re-captured graph (fixed);
//  2. a new topology (an extra node): cudaGraphExecUpdate fails, its result ignored (broken)
//     against checked, with re-instantiation as the fallback (fixed);
//  3. the input re-pointed to the next batch's buffer (exercise N3): the
//     graph's node edited (broken) against the executable's node re-pointed with
//     cudaGraphExecKernelNodeSetParams (fixed).
#include "common.h"

#include <sys/stat.h>

namespace {

// With REPLAY_GRAPH_DUMP=<dir> set (as for the workloads), writes the graph as
// <dir>/n17.<name>.dot.
void dump_dot(cudaGraph_t graph, const char* name) {
  const char* dir = std::getenv("REPLAY_GRAPH_DUMP");
  if (dir == nullptr || dir[0] == '\0') return;
  mkdir(dir, 0755);
  const std::string path = std::string(dir) + "/n17." + name + ".dot";
  EX_CHECK(cudaGraphDebugDotPrint(graph, path.c_str(), cudaGraphDebugDotFlagsVerbose));
}

__global__ void scale(const float* in, float* out, float a) {
  *out = a * *in;
}
__global__ void add_one(float* out) {
  *out += 1.0f;
}
__global__ void square(const float* in, float* out) {
  *out = *in * *in;
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
  return "unknown cudaGraphExecUpdateResult";
}

// Captures `enqueue` on `stream` into a new graph.
template <typename F>
cudaGraph_t capture(cudaStream_t stream, F enqueue) {
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue();
  EX_CHECK(cudaGetLastError());
  EX_CHECK(cudaStreamEndCapture(stream, &graph));
  return graph;
}

// The only node of a one-node graph.
cudaGraphNode_t only_node(cudaGraph_t graph) {
  size_t n = 1;
  cudaGraphNode_t node;
  EX_CHECK(cudaGraphGetNodes(graph, &node, &n));
  return node;
}

// Replays `exec` once and returns *out.
float replay(cudaGraphExec_t exec, cudaStream_t stream, const float* out) {
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  return ex::read_back(out);
}

}  // namespace

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N17");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* in = ex::device_zeros<float>();
  float* out = ex::device_zeros<float>();
  const float two = 2.0f, three = 3.0f;
  EX_CHECK(cudaMemcpy(in, &two, sizeof(float), cudaMemcpyHostToDevice));

  // 1. New parameters: captured with a = 2 (2 * 2 = 4); the step now wants a = 3 (expect 6).
  cudaGraph_t g_two = capture(stream, [&] { scale<<<1, 1, 0, stream>>>(in, out, 2.0f); });
  cudaGraphExec_t exec = ex::instantiate(g_two);
  const float first = replay(exec, stream, out);
  float params_result = 0;
  cudaError_t params_err = cudaSuccess;
  cudaGraphExecUpdateResultInfo params_info{};
  if (args.broken()) {
    // The graph's node gets a = 3; the executable was instantiated before and keeps a = 2.
    cudaKernelNodeParams p;
    const cudaGraphNode_t node = only_node(g_two);
    EX_CHECK(cudaGraphKernelNodeGetParams(node, &p));
    float a = 3.0f;
    float* out_arg = out;
    void* new_args[] = {&in, &out_arg, &a};
    p.kernelParams = new_args;
    p.extra = nullptr;
    EX_CHECK(cudaGraphKernelNodeSetParams(node, &p));
  } else {
    // Re-capture with a = 3 and carry its parameters into the executable.
    cudaGraph_t g_three = capture(stream, [&] { scale<<<1, 1, 0, stream>>>(in, out, 3.0f); });
    params_err = EX_TRY(cudaGraphExecUpdate(exec, g_three, &params_info));
    EX_CHECK(cudaGraphDestroy(g_three));
  }
  params_result = replay(exec, stream, out);
  ex::destroy_graph(exec, g_two);

  // 2. A new topology: a = 3 then add 1 (expect 7), against an executable of the one-node graph.
  g_two = capture(stream, [&] { scale<<<1, 1, 0, stream>>>(in, out, 2.0f); });
  exec = ex::instantiate(g_two);
  cudaGraph_t g_two_nodes = capture(stream, [&] {
    scale<<<1, 1, 0, stream>>>(in, out, 3.0f);
    add_one<<<1, 1, 0, stream>>>(out);
  });
  dump_dot(g_two, "captured");
  dump_dot(g_two_nodes, "topology-changed");
  cudaGraphExecUpdateResultInfo topo_info{};
  const cudaError_t topo_err = EX_TRY(cudaGraphExecUpdate(exec, g_two_nodes, &topo_info));
  bool reinstantiated = false;
  if (!args.broken() && topo_err != cudaSuccess) {
    // The fallback: a new executable of the new graph.
    EX_CHECK(cudaGraphExecDestroy(exec));
    exec = ex::instantiate(g_two_nodes);
    reinstantiated = true;
  }
  const float topo_result = replay(exec, stream, out);
  EX_CHECK(cudaGraphExecDestroy(exec));
  EX_CHECK(cudaGraphDestroy(g_two));
  EX_CHECK(cudaGraphDestroy(g_two_nodes));

  // 3. The input re-pointed (N3): captured on `in` (2, squared 4); the next batch (3) arrives in a
  // new buffer `next` (expect 9).
  cudaGraph_t g_square = capture(stream, [&] { square<<<1, 1, 0, stream>>>(in, out); });
  exec = ex::instantiate(g_square);
  float* next = ex::device_zeros<float>();
  EX_CHECK(cudaMemcpy(next, &three, sizeof(float), cudaMemcpyHostToDevice));
  const cudaGraphNode_t square_node = only_node(g_square);
  cudaKernelNodeParams p;
  EX_CHECK(cudaGraphKernelNodeGetParams(square_node, &p));
  float* out_arg = out;
  void* new_args[] = {&next, &out_arg};
  p.kernelParams = new_args;
  p.extra = nullptr;
  if (args.broken())
    EX_CHECK(cudaGraphKernelNodeSetParams(square_node, &p));  // the graph, not the executable
  else
    EX_CHECK(cudaGraphExecKernelNodeSetParams(exec, square_node, &p));
  const float repoint_result = replay(exec, stream, out);
  ex::destroy_graph(exec, g_square);

  const char* topo_name = update_result_name(topo_info.result);
  if (args.broken()) {
    const bool ok = first == 4.0f && params_result == 4.0f && topo_err != cudaSuccess &&
                    topo_info.result != cudaGraphExecUpdateSuccess && topo_result == 4.0f &&
                    repoint_result == 4.0f;
    return ex::report(
        "N17", args, ok,
        "new parameter a 2 -> 3 set on the graph's node after instantiation: replay gave %.0f "
        "(expected 6; the executable kept a = 2); new topology (an extra node): "
        "cudaGraphExecUpdate -> %s, result %s, ignored: replay gave %.0f (expected 7; the old "
        "graph ran); input re-pointed on the graph's node: replay gave %.0f (expected 9; squared "
        "the stale batch 2)",
        params_result, ex::name(topo_err).c_str(), topo_name, topo_result, repoint_result);
  }
  const bool ok = first == 4.0f && params_err == cudaSuccess &&
                  params_info.result == cudaGraphExecUpdateSuccess && params_result == 6.0f &&
                  topo_err != cudaSuccess && topo_info.result != cudaGraphExecUpdateSuccess &&
                  reinstantiated && topo_result == 7.0f && repoint_result == 9.0f;
  return ex::report(
      "N17", args, ok,
      "new parameter a 2 -> 3: cudaGraphExecUpdate -> %s, result %s: replay gave %.0f (expected "
      "6); new topology (an extra node): cudaGraphExecUpdate -> %s, result %s, re-instantiated: "
      "replay gave %.0f (expected 7); input re-pointed with cudaGraphExecKernelNodeSetParams: "
      "replay gave %.0f (expected 9)",
      ex::name(params_err).c_str(), update_result_name(params_info.result), params_result,
      ex::name(topo_err).c_str(), topo_name, topo_result, repoint_result);
}
