// N16: control flow that depends on a device value, kept on the host. Two cases:
//  - IF: "skip the optimizer step when the gradients overflowed" written as a host `if` on a
//    found-inf flag read before the capture. The graph keeps the branch taken at capture: captured
//    after a clean step it applies the update on an overflow step too (the weights turn into inf),
//    captured after an overflow step it skips every update.
//  - WHILE: a decode loop that runs until the device says stop. Eagerly the host polls a stop flag
//    after every token (a copy and a synchronization per token); captured, the host loop becomes a
//    fixed number of copies of its body, the trip count seen at capture.
// The fix keeps the decision on the device: a conditional node (CUDA 12.4+, API of CUDA 13) whose
// handle a one-thread kernel sets with cudaGraphSetConditional from the device flag, at every
// launch. graphs/conditional.cu does the same for the workloads; this file mirrors it standalone.
#include "common.h"

#include <sys/stat.h>

#include <cmath>
#include <vector>

#if CUDART_VERSION < 13000
#error "N16 uses the CUDA 13 graph API (cudaGraphAddNode with edge data, conditional nodes)"
#endif

namespace {

// With REPLAY_GRAPH_DUMP=<dir> set (as for the workloads), writes the graph as
// <dir>/n16.<name>.dot.
void dump_dot(cudaGraph_t graph, const char* name) {
  const char* dir = std::getenv("REPLAY_GRAPH_DUMP");
  if (dir == nullptr || dir[0] == '\0') return;
  mkdir(dir, 0755);
  const std::string path = std::string(dir) + "/n16." + name + ".dot";
  EX_CHECK(cudaGraphDebugDotPrint(graph, path.c_str(), cudaGraphDebugDotFlagsVerbose));
}

constexpr int kN = 256;         // parameters
constexpr float kLr = 0.25f;    // SGD learning rate; every gradient is 1 (or inf on overflow)
constexpr int kMaxTokens = 32;  // decode: at most this many tokens
constexpr int kEos = 0;         // decode: the stop token
constexpr int kInfIndex = 7;    // the overflowing gradient element

// ---- the optimizer step ----

// found_inf = 1 when any gradient is not finite (found_inf is zeroed before, by a memset node).
__global__ void check_finite(const float* grad, int* found_inf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kN && !isfinite(grad[i])) atomicExch(found_inf, 1);
}
__global__ void sgd_update(float* param, const float* grad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kN) param[i] -= kLr * grad[i];
}
// The condition of the IF node: run the body (the update) when no gradient overflowed.
__global__ void set_if_finite(cudaGraphConditionalHandle handle, const int* found_inf) {
  cudaGraphSetConditional(handle, *found_inf == 0 ? 1u : 0u);
}

// ---- the decode loop ----

// One token: next = (3 * prev + 1) mod 31; the loop goes on while the token is not EOS and there
// is room. The same kernel runs eagerly (the host polls *keep_going) and inside the WHILE body.
__global__ void decode_step(int* token, int* length, int* out, int* keep_going) {
  const int next = (3 * *token + 1) % 31;
  out[*length] = next;
  *token = next;
  *length += 1;
  *keep_going = next != kEos && *length < kMaxTokens;
}
// The condition of the WHILE node, tested before the first iteration and after every body.
__global__ void set_while_nonzero(cudaGraphConditionalHandle handle, const int* keep_going) {
  cudaGraphSetConditional(handle, *keep_going != 0 ? 1u : 0u);
}

std::vector<int> decode_reference(int prompt) {
  std::vector<int> tokens;
  int token = prompt;
  do {
    token = (3 * token + 1) % 31;
    tokens.push_back(token);
  } while (token != kEos && static_cast<int>(tokens.size()) < kMaxTokens);
  return tokens;
}

// Adds a conditional node of `type` to the capture in progress on `stream`: the handle is created
// in the capture's graph, `set_condition` (captured before the node) sets it, the node becomes the
// stream's dependency, and `body` (plus `after_body` for WHILE) is captured into the node's body
// graph on `body_stream` with cudaStreamBeginCaptureToGraph.
template <typename SetCondition, typename Body>
void add_conditional(cudaStream_t stream, cudaStream_t body_stream,
                     cudaGraphConditionalNodeType type, SetCondition set_condition, Body body,
                     bool test_after_body) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr, nullptr));
  cudaGraphConditionalHandle handle;
  // Default value 0 at every launch: the condition kernel must set it.
  EX_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  set_condition(stream, handle);
  EX_CHECK(cudaGetLastError());

  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t num_deps = 0;
  EX_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, &edges, &num_deps));
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = type;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  EX_CHECK(cudaGraphAddNode(&node, graph, deps, edges, num_deps, &params));
  EX_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                               cudaStreamSetCaptureDependencies));

  EX_CHECK(cudaStreamBeginCaptureToGraph(body_stream, params.conditional.phGraph_out[0], nullptr,
                                         nullptr, 0, cudaStreamCaptureModeThreadLocal));
  body(body_stream);
  if (test_after_body) set_condition(body_stream, handle);
  EX_CHECK(cudaGetLastError());
  cudaGraph_t body_graph;
  EX_CHECK(cudaStreamEndCapture(body_stream, &body_graph));
}

struct Optimizer {
  float *param, *grad;
  int* found_inf;
};

// Sets every gradient to 1, and element kInfIndex to inf on an overflow step.
void load_step(const Optimizer& o, cudaStream_t stream, bool overflow) {
  std::vector<float> grad(kN, 1.0f);
  if (overflow) grad[kInfIndex] = INFINITY;
  EX_CHECK(
      cudaMemcpyAsync(o.grad, grad.data(), kN * sizeof(float), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaStreamSynchronize(stream));  // the pageable source goes out of scope
}
void reset_params(const Optimizer& o, cudaStream_t stream) {
  std::vector<float> ones(kN, 1.0f);
  EX_CHECK(
      cudaMemcpyAsync(o.param, ones.data(), kN * sizeof(float), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
}

// The three steps every variant replays: clean, overflow, clean. Returns the parameters after
// each step (index 0: after step 1, ...).
std::vector<std::vector<float>> run_steps(const Optimizer& o, cudaStream_t stream,
                                          cudaGraphExec_t exec) {
  std::vector<std::vector<float>> after;
  reset_params(o, stream);
  for (bool overflow : {false, true, false}) {
    load_step(o, stream, overflow);
    EX_CHECK(cudaGraphLaunch(exec, stream));
    std::vector<float> p(kN);
    EX_CHECK(
        cudaMemcpyAsync(p.data(), o.param, kN * sizeof(float), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));
    after.push_back(p);
  }
  return after;
}

// Every parameter equals `value` (exactly: 1 - k * 0.25 is exact in float).
bool all_equal(const std::vector<float>& p, float value) {
  for (float x : p)
    if (x != value) return false;
  return true;
}

// The host-branch step, captured: found_inf is read on the host before the capture (the eager
// `if (!found_inf.item())`), so the update is in the graph or not, for good.
cudaGraphExec_t capture_host_branch(const Optimizer& o, cudaStream_t stream, bool warmup_overflow,
                                    int* seen) {
  // One eager step of the warm-up, whose flag the host reads.
  load_step(o, stream, warmup_overflow);
  EX_CHECK(cudaMemsetAsync(o.found_inf, 0, sizeof(int), stream));
  check_finite<<<1, kN, 0, stream>>>(o.grad, o.found_inf);
  EX_CHECK(cudaGetLastError());
  EX_CHECK(cudaStreamSynchronize(stream));
  const int found_inf = ex::read_back(o.found_inf);
  *seen = found_inf;
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EX_CHECK(cudaMemsetAsync(o.found_inf, 0, sizeof(int), stream));
  check_finite<<<1, kN, 0, stream>>>(o.grad, o.found_inf);
  if (!found_inf) sgd_update<<<1, kN, 0, stream>>>(o.param, o.grad);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  dump_dot(graph, warmup_overflow ? "if-host-branch-after-overflow" : "if-host-branch-after-clean");
  EX_CHECK(cudaGraphDestroy(graph));
  return exec;
}

struct Decoder {
  int *token, *length, *out, *keep_going;
};

void start_sequence(const Decoder& d, cudaStream_t stream, int prompt) {
  const int init[3] = {prompt, 0, 1};  // token, length, keep_going
  EX_CHECK(cudaMemcpyAsync(d.token, &init[0], sizeof(int), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaMemcpyAsync(d.length, &init[1], sizeof(int), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaMemcpyAsync(d.keep_going, &init[2], sizeof(int), cudaMemcpyHostToDevice, stream));
  EX_CHECK(cudaMemsetAsync(d.out, 0xff, kMaxTokens * sizeof(int), stream));  // -1: no token
  EX_CHECK(cudaStreamSynchronize(stream));
}

std::vector<int> sequence(const Decoder& d, cudaStream_t stream) {
  int length = 0;
  EX_CHECK(cudaMemcpyAsync(&length, d.length, sizeof(int), cudaMemcpyDeviceToHost, stream));
  std::vector<int> out(kMaxTokens);
  EX_CHECK(
      cudaMemcpyAsync(out.data(), d.out, kMaxTokens * sizeof(int), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  out.resize(static_cast<size_t>(length < kMaxTokens ? length : kMaxTokens));
  return out;
}

// The eager host polling loop: one launch, one copy of the flag and one synchronization per token.
// Returns the tokens; *syncs counts the synchronizations, *us_per_token the host time per token.
std::vector<int> polling_loop(const Decoder& d, cudaStream_t stream, int prompt, int* syncs,
                              double* us_per_token) {
  start_sequence(d, stream, prompt);
  int* keep_host;
  EX_CHECK(cudaMallocHost(&keep_host, sizeof(int)));
  *syncs = 0;
  const auto start = std::chrono::steady_clock::now();
  int tokens = 0;
  do {
    decode_step<<<1, 1, 0, stream>>>(d.token, d.length, d.out, d.keep_going);
    EX_CHECK(cudaGetLastError());
    EX_CHECK(cudaMemcpyAsync(keep_host, d.keep_going, sizeof(int), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));  // the per-token stall
    ++*syncs;
    ++tokens;
  } while (*keep_host);
  *us_per_token =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
      tokens;
  EX_CHECK(cudaFreeHost(keep_host));
  return sequence(d, stream);
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N16");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  const cudaStream_t body_stream = ex::nonblocking_stream();
  Optimizer o{ex::device_zeros<float>(kN), ex::device_zeros<float>(kN), ex::device_zeros<int>()};
  Decoder d{ex::device_zeros<int>(), ex::device_zeros<int>(), ex::device_zeros<int>(kMaxTokens),
            ex::device_zeros<int>()};
  // Prompts whose sequences stop on EOS after 5, 12 and 3 tokens.
  const int capture_prompt = 18, long_prompt = 17, short_prompt = 11;

  char if_text[512], while_text[512];
  bool if_ok = false, while_ok = false;
  if (args.broken()) {
    // IF, broken: the host branch, captured once after a clean warm-up step and once after an
    // overflowing one (dynamic loss scaling often overflows in its first steps).
    int seen_clean = -1, seen_overflow = -1;
    const cudaGraphExec_t after_clean = capture_host_branch(o, stream, false, &seen_clean);
    const cudaGraphExec_t after_overflow = capture_host_branch(o, stream, true, &seen_overflow);
    const auto a = run_steps(o, stream, after_clean);
    const auto b = run_steps(o, stream, after_overflow);
    EX_CHECK(cudaGraphExecDestroy(after_clean));
    EX_CHECK(cudaGraphExecDestroy(after_overflow));
    // Captured after a clean step: the overflow step (step 2) updated with the inf gradient.
    const bool applied = std::isinf(a[1][kInfIndex]) && a[1][0] == 0.5f;
    // Captured after an overflow step: no step updated anything.
    const bool skipped = all_equal(b[0], 1.0f) && all_equal(b[2], 1.0f);
    if_ok = seen_clean == 0 && seen_overflow == 1 && applied && skipped;
    std::snprintf(if_text, sizeof(if_text),
                  "IF: host branch captured after a clean step: the overflow step updated, "
                  "param[%d] = %g, param[0] = %.2f (expected 0.75 and 0.75); captured after an "
                  "overflow step: param %.2f after 3 steps (expected 0.50, every update skipped)",
                  kInfIndex, a[1][kInfIndex], a[1][0], b[2][0]);

    // WHILE, broken: (1) the eager polling loop, correct but one synchronization per token.
    int syncs = 0;
    double us_per_token = 0;
    const std::vector<int> polled = polling_loop(d, stream, long_prompt, &syncs, &us_per_token);
    const std::vector<int> long_ref = decode_reference(long_prompt);
    // (2) The host loop captured: the body repeated as often as the capture-time prompt needed.
    int capture_trips = 0;
    double unused;
    polling_loop(d, stream, capture_prompt, &capture_trips, &unused);
    start_sequence(d, stream, capture_prompt);
    cudaGraph_t graph;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < capture_trips; ++i)
      decode_step<<<1, 1, 0, stream>>>(d.token, d.length, d.out, d.keep_going);
    const cudaGraphExec_t frozen = ex::end_capture_and_instantiate(stream, &graph);
    dump_dot(graph, "while-host-loop-captured");
    EX_CHECK(cudaGraphDestroy(graph));
    start_sequence(d, stream, long_prompt);
    EX_CHECK(cudaGraphLaunch(frozen, stream));
    const std::vector<int> long_frozen = sequence(d, stream);
    start_sequence(d, stream, short_prompt);
    EX_CHECK(cudaGraphLaunch(frozen, stream));
    const std::vector<int> short_frozen = sequence(d, stream);
    EX_CHECK(cudaGraphExecDestroy(frozen));
    const std::vector<int> short_ref = decode_reference(short_prompt);
    while_ok = polled == long_ref && syncs == static_cast<int>(long_ref.size()) &&
               capture_trips == 5 && long_frozen.size() == 5 && short_frozen.size() == 5 &&
               long_ref.size() == 12 && short_ref.size() == 3;
    std::snprintf(while_text, sizeof(while_text),
                  "WHILE: host polling loop: %zu tokens (expected %zu), %d synchronizations, "
                  "%.1f us a token; host loop captured with the capture-time trip count %d: %zu "
                  "tokens where %zu were due, and %zu (%s) where %zu were due (past EOS)",
                  polled.size(), long_ref.size(), syncs, us_per_token, capture_trips,
                  long_frozen.size(), long_ref.size(), short_frozen.size(),
                  join(short_frozen).c_str(), short_ref.size());
  } else {
    // IF, fixed: memset, check, condition kernel, IF node whose body is the update.
    cudaGraph_t graph;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    EX_CHECK(cudaMemsetAsync(o.found_inf, 0, sizeof(int), stream));
    check_finite<<<1, kN, 0, stream>>>(o.grad, o.found_inf);
    add_conditional(
        stream, body_stream, cudaGraphCondTypeIf,
        [&](cudaStream_t s, cudaGraphConditionalHandle h) {
          set_if_finite<<<1, 1, 0, s>>>(h, o.found_inf);
        },
        [&](cudaStream_t s) { sgd_update<<<1, kN, 0, s>>>(o.param, o.grad); }, false);
    const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
    dump_dot(graph, "if-conditional-node");
    EX_CHECK(cudaGraphDestroy(graph));
    const auto a = run_steps(o, stream, exec);
    EX_CHECK(cudaGraphExecDestroy(exec));
    if_ok = all_equal(a[0], 0.75f) && all_equal(a[1], 0.75f) && all_equal(a[2], 0.5f);
    std::snprintf(if_text, sizeof(if_text),
                  "IF: conditional node on the device found-inf flag: param %.2f, %.2f, %.2f after "
                  "clean, overflow, clean steps (expected 0.75, 0.75, 0.50; param[%d] %g)",
                  a[0][0], a[1][0], a[2][0], kInfIndex, a[1][kInfIndex]);

    // WHILE, fixed: one graph, one launch per sequence, the loop decided on the device.
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const auto test = [&](cudaStream_t s, cudaGraphConditionalHandle h) {
      set_while_nonzero<<<1, 1, 0, s>>>(h, d.keep_going);
    };
    add_conditional(
        stream, body_stream, cudaGraphCondTypeWhile, test,
        [&](cudaStream_t s) {
          decode_step<<<1, 1, 0, s>>>(d.token, d.length, d.out, d.keep_going);
        },
        true);
    const cudaGraphExec_t loop = ex::end_capture_and_instantiate(stream, &graph);
    const size_t nodes = ex::node_count(graph);
    dump_dot(graph, "while-conditional-node");
    EX_CHECK(cudaGraphDestroy(graph));
    std::vector<size_t> lengths;
    bool tokens_ok = true;
    double us_per_token = 0;
    for (int prompt : {capture_prompt, long_prompt, short_prompt}) {
      start_sequence(d, stream, prompt);
      const auto start = std::chrono::steady_clock::now();
      EX_CHECK(cudaGraphLaunch(loop, stream));
      EX_CHECK(cudaStreamSynchronize(stream));  // one synchronization per sequence
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      const std::vector<int> got = sequence(d, stream);
      if (prompt == long_prompt) us_per_token = us / static_cast<double>(got.size());
      tokens_ok = tokens_ok && got == decode_reference(prompt);
      lengths.push_back(got.size());
    }
    EX_CHECK(cudaGraphExecDestroy(loop));
    while_ok = tokens_ok && lengths[0] == 5 && lengths[1] == 12 && lengths[2] == 3;
    std::snprintf(while_text, sizeof(while_text),
                  "WHILE: conditional node on the device stop flag (graph of %zu nodes), one "
                  "launch and one synchronization per sequence: %zu, %zu, %zu tokens (expected 5, "
                  "12, 3; %s), %.1f us a token",
                  nodes, lengths[0], lengths[1], lengths[2],
                  tokens_ok ? "tokens match the CPU reference" : "tokens DIFFER from the reference",
                  us_per_token);
  }
  return ex::report("N16", args, if_ok && while_ok, "%s; %s", if_text, while_text);
}
