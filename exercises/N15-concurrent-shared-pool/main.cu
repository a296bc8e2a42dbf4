// N15: two graphs that share memory replayed at the same time on two streams. Both take their
// scratch from one caching pool (a framework's shared graph pool): A's scratch is released when A's
// capture ends, so B's capture gets the same block, which is right only while the graphs run one
// after the other. Graph A writes its intermediate (42) into the scratch, computes for a while
// (40 units of a spin kernel) and then reads it back; graph B computes for 10 units, writes its own
// intermediate (7) into the same scratch and reads it. Launched together on two streams, B's write
// lands inside A's window and A reads 7. A start gate (both streams wait on one event) makes them
// start together; the spin times fix the interleaving, so the race goes the same way every run.
// Broken: concurrent on the shared pool, A gives 7; and CUDA's own rule for graph memory: an
// executable whose graph allocation from an earlier launch is still unfreed is refused a second
// launch (cudaErrorInvalidValue), so one executable cannot even be relaunched over live scratch.
// Fixed: B's stream waits on an event recorded after A (A 42, B 7); and the same two graphs with
// their scratch from graph memory nodes (cudaMallocAsync/cudaFreeAsync in each capture), launched
// concurrently: CUDA keeps concurrently running graphs on distinct physical memory (or orders
// them), A 42, B 7.
#include "caching_pool.h"
#include "common.h"

#include <cstdlib>
#include <vector>

constexpr long long kUnit = 1800000;  // spin cycles: about 1 ms (common.h)
constexpr int kA = 42, kB = 7;

__global__ void produce(int* scratch, int value) {
  *scratch = value;
}
__global__ void consume(const int* scratch, int* out) {
  *out = *scratch;
}

enum class Scratch { kSharedPool, kGraphMemory };

struct Pair {
  cudaGraph_t graph[2];
  cudaGraphExec_t exec[2];
  void* scratch[2];
};

// Captures graph A (on s[0]) and graph B (on s[1]) with their scratch from `pool`, or from graph
// memory nodes (cudaMallocAsync in the capture, freed inside it).
static Pair capture_pair(const cudaStream_t s[2], Scratch kind, CachingPool& pool, int* out[2]) {
  Pair pair;
  for (int g = 0; g < 2; ++g) {
    int* scratch = nullptr;
    EX_CHECK(cudaStreamBeginCapture(s[g], cudaStreamCaptureModeGlobal));
    if (kind == Scratch::kSharedPool)
      scratch = static_cast<int*>(pool.allocate(sizeof(int)));
    else
      EX_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), sizeof(int), s[g]));
    if (g == 0) {  // A: write, long compute, read
      produce<<<1, 1, 0, s[g]>>>(scratch, kA);
      ex::spin_kernel<<<1, 1, 0, s[g]>>>(40 * kUnit);
      consume<<<1, 1, 0, s[g]>>>(scratch, out[g]);
    } else {  // B: short compute, write, read
      ex::spin_kernel<<<1, 1, 0, s[g]>>>(10 * kUnit);
      produce<<<1, 1, 0, s[g]>>>(scratch, kB);
      consume<<<1, 1, 0, s[g]>>>(scratch, out[g]);
    }
    if (kind == Scratch::kGraphMemory) EX_CHECK(cudaFreeAsync(scratch, s[g]));
    pair.exec[g] = ex::end_capture_and_instantiate(s[g], &pair.graph[g]);
    // The captured code is done with its scratch: back to the pool for the next capture.
    if (kind == Scratch::kSharedPool) pool.release(scratch);
    pair.scratch[g] = scratch;
    EX_CHECK(cudaGraphUpload(pair.exec[g], s[g]));  // map graph memory now, on its stream
  }
  return pair;
}

// One step: both streams wait on a gate (a 20-unit spin on a third stream, during which both
// graphs are launched), then A on s[0] and B on s[1]; with `serialize`, B's stream also waits on an
// event recorded after A. Returns the two outputs and the milliseconds from the gate to both done.
static float run_step(const cudaStream_t s[2], cudaStream_t gate_stream, const Pair& pair,
                      bool serialize, int* out[2], int host[2]) {
  cudaEvent_t go, a_done, done[2];
  EX_CHECK(cudaEventCreate(&go));
  EX_CHECK(cudaEventCreate(&done[0]));
  EX_CHECK(cudaEventCreate(&done[1]));
  a_done = ex::untimed_event();
  EX_CHECK(cudaMemsetAsync(out[0], 0, sizeof(int), gate_stream));
  EX_CHECK(cudaMemsetAsync(out[1], 0, sizeof(int), gate_stream));
  ex::spin_kernel<<<1, 1, 0, gate_stream>>>(20 * kUnit);
  EX_CHECK(cudaEventRecord(go, gate_stream));
  for (int g = 0; g < 2; ++g) EX_CHECK(cudaStreamWaitEvent(s[g], go, 0));
  EX_CHECK(cudaGraphLaunch(pair.exec[0], s[0]));
  if (serialize) {
    EX_CHECK(cudaEventRecord(a_done, s[0]));
    EX_CHECK(cudaStreamWaitEvent(s[1], a_done, 0));
  }
  EX_CHECK(cudaGraphLaunch(pair.exec[1], s[1]));
  for (int g = 0; g < 2; ++g) EX_CHECK(cudaEventRecord(done[g], s[g]));
  for (int g = 0; g < 2; ++g) EX_CHECK(cudaStreamSynchronize(s[g]));
  float ms[2] = {0, 0};
  for (int g = 0; g < 2; ++g) {
    EX_CHECK(cudaEventElapsedTime(&ms[g], go, done[g]));
    host[g] = ex::read_back(out[g]);
  }
  EX_CHECK(cudaEventDestroy(go));
  EX_CHECK(cudaEventDestroy(a_done));
  EX_CHECK(cudaEventDestroy(done[0]));
  EX_CHECK(cudaEventDestroy(done[1]));
  return ms[0] > ms[1] ? ms[0] : ms[1];
}

static void destroy_pair(Pair& pair) {
  for (int g = 0; g < 2; ++g) ex::destroy_graph(pair.exec[g], pair.graph[g]);
}

// CUDA's rule for one executable: a graph that leaves its allocation unfreed, launched again (here
// on the other stream) before that allocation is freed. Returns the second launch's error.
static cudaError_t relaunch_with_live_allocation(const cudaStream_t s[2]) {
  cudaGraph_t graph;
  int* kept = nullptr;
  EX_CHECK(cudaStreamBeginCapture(s[0], cudaStreamCaptureModeGlobal));
  EX_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&kept), sizeof(int), s[0]));
  produce<<<1, 1, 0, s[0]>>>(kept, kA);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(s[0], &graph);
  EX_CHECK(cudaGraphLaunch(exec, s[0]));
  const cudaError_t second = EX_TRY(cudaGraphLaunch(exec, s[1]));
  EX_CHECK(cudaStreamSynchronize(s[1]));
  EX_CHECK(cudaStreamSynchronize(s[0]));
  EX_CHECK(cudaFreeAsync(kept, s[0]));
  EX_CHECK(cudaStreamSynchronize(s[0]));
  ex::destroy_graph(exec, graph);
  return second;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N15");
  // Two streams must reach the GPU through separate hardware queues for the graphs to overlap; with
  // CUDA_DEVICE_MAX_CONNECTIONS=1 (common in Megatron-style setups) they would queue behind each
  // other and the race would not happen. Set before the first CUDA call.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1);
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  const cudaStream_t s[2] = {ex::nonblocking_stream(), ex::nonblocking_stream()};
  const cudaStream_t gate = ex::nonblocking_stream();
  int* out[2] = {ex::device_zeros<int>(), ex::device_zeros<int>()};
  CachingPool pool(1 << 20);

  Pair shared = capture_pair(s, Scratch::kSharedPool, pool, out);
  const bool same = shared.scratch[0] == shared.scratch[1];
  int host[2] = {0, 0};
  const float ms = run_step(s, gate, shared, !args.broken(), out, host);
  destroy_pair(shared);

  if (args.broken()) {
    const cudaError_t relaunch = relaunch_with_live_allocation(s);
    const bool ok = same && host[0] == kB && host[1] == kB && relaunch == cudaErrorInvalidValue;
    return ex::report(
        "N15", args, ok,
        "shared pool, A and B launched together on two streams: scratch %p and %p (%s), A gave "
        "%d, B gave %d (expected 42 and 7) in %.0f ms; one graph relaunched while its graph "
        "allocation is unfreed: cudaGraphLaunch -> %s",
        shared.scratch[0], shared.scratch[1], same ? "one block" : "separate blocks", host[0],
        host[1], ms, ex::name(relaunch).c_str());
  }
  // The fixes: the same pool with B ordered after A; then graph memory nodes, launched together.
  Pair own = capture_pair(s, Scratch::kGraphMemory, pool, out);
  int own_host[2] = {0, 0};
  const float own_ms = run_step(s, gate, own, false, out, own_host);
  destroy_pair(own);
  EX_CHECK(cudaDeviceGraphMemTrim(0));
  const bool ok = same && host[0] == kA && host[1] == kB && own_host[0] == kA && own_host[1] == kB;
  return ex::report(
      "N15", args, ok,
      "shared pool, B's stream waits on an event after A: A gave %d, B gave %d (expected 42 and "
      "7) in %.0f ms; graph memory nodes, launched together: scratch %p and %p, A gave %d, B gave "
      "%d (expected 42 and 7) in %.0f ms",
      host[0], host[1], ms, own.scratch[0], own.scratch[1], own_host[0], own_host[1], own_ms);
}
