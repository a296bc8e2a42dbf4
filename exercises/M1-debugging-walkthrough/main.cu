// M1, a debugging walk-through: a graph reading memory that was freed after the capture. A step of
// four regions (embed, scale, act, loss), each captured as its own graph as replay's layer mode
// does. After the capture the program rebuilds the scale table: it allocates a new one, fills it
// and frees the old one. The eager code uses the new table; the graph of region "scale" still holds
// the old address. What happens then depends on the allocator:
//   --mode broken             the old block goes back to a caching pool and the next buffer of its
//                             size gets it: the replay silently reads that buffer (a wrong loss);
//   --mode broken --unmapped  the old table was a cudaMalloc and cudaFree returns it: the replay of
//                             "scale" faults (an illegal address).
//   --mode fixed              the table is rebuilt in place (the new values copied into the buffer
//                             the graph holds): graphs and eager agree.
// The program carries the diagnostics the README walks through: the captured pointer argument of
// the scale kernel read back from the graph (cudaGraphKernelNodeGetParams) next to the live table,
// `--dot PREFIX` (each region's graph as PREFIX<region>.dot, cudaGraphDebugDotPrint), the replay
// region by region with a synchronization and an error check after each (which region faults), and
// an eager-versus-graph bisection (each region replayed on the eager inputs, until the first output
// that differs).
#include "common.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

constexpr int kN = 1 << 20;      // elements of the activations
constexpr size_t kT = 1u << 23;  // entries of the scale table: 32 MiB
constexpr int kThreads = 256;
constexpr int kRegions = 4;
const char* const kRegionNames[kRegions] = {"embed", "scale", "act", "loss"};

__global__ void embed(const float* x, float* h0, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h0[i] = 2.0f * x[i];
}
__global__ void apply_scale(const float* h0, const float* table, float* h1, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h1[i] = h0[i] * table[size_t(i) * 7];
}
__global__ void act(const float* h1, float* h2, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h2[i] = fmaxf(h1[i], 0.0f) + 1.0f;
}
__global__ void sum_loss(const float* h2, double* loss, int n) {
  __shared__ double s[kThreads];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  s[threadIdx.x] = i < n ? h2[i] : 0.0;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(loss, s[0]);
}
__global__ void fill(float* data, size_t n, float base, int period) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] = base + float(i % period);
  }
}

struct Step {
  float *x, *h0, *h1, *h2;
  double* loss;
};
constexpr int kBlocks = (kN + kThreads - 1) / kThreads;

// Region r of the step on `stream`, reading the scale table at `table`.
static void enqueue_region(int r, const Step& s, const float* table, cudaStream_t stream) {
  switch (r) {
    case 0:
      embed<<<kBlocks, kThreads, 0, stream>>>(s.x, s.h0, kN);
      break;
    case 1:
      apply_scale<<<kBlocks, kThreads, 0, stream>>>(s.h0, table, s.h1, kN);
      break;
    case 2:
      act<<<kBlocks, kThreads, 0, stream>>>(s.h1, s.h2, kN);
      break;
    default:
      EX_CHECK(cudaMemsetAsync(s.loss, 0, sizeof(double), stream));
      sum_loss<<<kBlocks, kThreads, 0, stream>>>(s.h2, s.loss, kN);
  }
  EX_CHECK(cudaGetLastError());
}

// Region r's output, copied to the host (the loss as one value).
static std::vector<double> region_output(int r, const Step& s) {
  std::vector<double> out;
  if (r == kRegions - 1) {
    out.push_back(ex::read_back(s.loss));
    return out;
  }
  std::vector<float> host(kN);
  const float* src = r == 0 ? s.h0 : r == 1 ? s.h1 : s.h2;
  EX_CHECK(cudaMemcpy(host.data(), src, kN * sizeof(float), cudaMemcpyDeviceToHost));
  out.assign(host.begin(), host.end());
  return out;
}

// The table pointer the scale region's kernel node captured: its second argument.
static const float* captured_table(cudaGraph_t graph) {
  size_t count = 0;
  EX_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  EX_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    EX_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeParams params = {};
    EX_CHECK(cudaGraphKernelNodeGetParams(node, &params));
    if (params.func == reinterpret_cast<void*>(apply_scale))
      return *static_cast<const float* const*>(params.kernelParams[1]);
  }
  return nullptr;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "M1");
  bool unmapped = false;
  std::string dot_prefix;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--unmapped") == 0) unmapped = true;
    if (std::strcmp(argv[i], "--dot") == 0 && i + 1 < argc) dot_prefix = argv[++i];
  }
  if (unmapped && !args.broken()) {
    std::fprintf(stderr, "exercise-m1: --unmapped is a variant of --mode broken\n");
    return 2;
  }
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  const cudaStream_t stream = ex::nonblocking_stream();
  // The program's caching pool (keeps freed blocks, hands them to the next request of their size).
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  cudaMemPool_t pool;
  EX_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t never = UINT64_MAX;
  EX_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &never));
  auto table_alloc = [&](float** p) {
    if (unmapped)
      EX_CHECK(cudaMalloc(p, kT * sizeof(float)));
    else
      EX_CHECK(
          cudaMallocFromPoolAsync(reinterpret_cast<void**>(p), kT * sizeof(float), pool, stream));
  };

  Step s;
  EX_CHECK(cudaMalloc(&s.x, kN * sizeof(float)));
  EX_CHECK(cudaMalloc(&s.h0, kN * sizeof(float)));
  EX_CHECK(cudaMalloc(&s.h1, kN * sizeof(float)));
  EX_CHECK(cudaMalloc(&s.h2, kN * sizeof(float)));
  s.loss = ex::device_zeros<double>();
  fill<<<256, 256, 0, stream>>>(s.x, kN, -2.0f, 5);  // x in -2..2
  float* table = nullptr;
  table_alloc(&table);
  fill<<<256, 256, 0, stream>>>(table, kT, 1.0f, 3);  // the first scales: 1, 2, 3
  EX_CHECK(cudaStreamSynchronize(stream));

  // One eager step (the warm-up), then each region captured as its own graph.
  for (int r = 0; r < kRegions; ++r) enqueue_region(r, s, table, stream);
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graphs[kRegions];
  cudaGraphExec_t execs[kRegions];
  for (int r = 0; r < kRegions; ++r) {
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    enqueue_region(r, s, table, stream);
    execs[r] = ex::end_capture_and_instantiate(stream, &graphs[r]);
    if (!dot_prefix.empty()) {
      const std::string path = dot_prefix + kRegionNames[r] + ".dot";
      EX_CHECK(cudaGraphDebugDotPrint(graphs[r], path.c_str(), cudaGraphDebugDotFlagsVerbose));
      std::printf("wrote %s\n", path.c_str());
    }
  }
  const float* const old_table = table;

  // The table is rebuilt with new scales (2, 3, 4): a config reload, a checkpoint load.
  void* other = nullptr;  // broken: the next buffer of the table's size, after the rebuild
  if (args.broken()) {
    float* fresh = nullptr;
    table_alloc(&fresh);
    fill<<<256, 256, 0, stream>>>(fresh, kT, 2.0f, 3);
    if (unmapped) {
      EX_CHECK(cudaStreamSynchronize(stream));
      EX_CHECK(cudaFree(table));
    } else {
      EX_CHECK(cudaFreeAsync(table, stream));
      // Another part of the program allocates a buffer of the same size (optimizer state, a
      // gradient bucket) and fills it: 100 everywhere.
      EX_CHECK(cudaMallocFromPoolAsync(&other, kT * sizeof(float), pool, stream));
      fill<<<256, 256, 0, stream>>>(static_cast<float*>(other), kT, 100.0f, 1);
    }
    table = fresh;
  } else {
    fill<<<256, 256, 0, stream>>>(table, kT, 2.0f, 3);  // in place: the graph's buffer
  }
  EX_CHECK(cudaStreamSynchronize(stream));
  const float* const graph_table = captured_table(graphs[1]);
  std::printf(
      "M1 %s: region scale's kernel apply_scale reads the table at %p (captured); the "
      "live table is at %p%s\n",
      args.mode_name(), static_cast<const void*>(graph_table), static_cast<const void*>(table),
      other == old_table ? "; the old address now belongs to another buffer" : "");
  std::fflush(stdout);

  // Replay the step region by region, each followed by a synchronization and an error check.
  for (int r = 0; r < kRegions; ++r) {
    cudaError_t err = EX_TRY(cudaGraphLaunch(execs[r], stream));
    if (err == cudaSuccess) err = EX_TRY(cudaStreamSynchronize(stream));
    if (err != cudaSuccess) {
      // The context is lost (a sticky error): report and end without more CUDA calls.
      const bool ok = unmapped && r == 1 && err == cudaErrorIllegalAddress;
      return ex::report("M1", args, ok,
                        "scale table rebuilt after capture, the old one freed with cudaFree (32 "
                        "MiB): replay region by region: %s -> %s at region %d (%s)",
                        kRegionNames[r], ex::name(err).c_str(), r,
                        r == 1 ? "the graph read the freed table" : "unexpected region");
    }
  }
  const double graph_loss = ex::read_back(s.loss);
  for (int r = 0; r < kRegions; ++r) enqueue_region(r, s, table, stream);
  EX_CHECK(cudaStreamSynchronize(stream));
  const double eager_loss = ex::read_back(s.loss);
  // The CPU's loss with the new scales.
  double cpu_loss = 0;
  for (int i = 0; i < kN; ++i) {
    const float x = -2.0f + float(i % 5);
    const float scale = 2.0f + float((size_t(i) * 7) % 3);
    cpu_loss += std::max(2.0f * x * scale, 0.0f) + 1.0f;
  }

  // Bisection: region r replayed on the eager inputs (eager regions 0..r-1 first), its output
  // compared with the eager region's, until the first that differs.
  std::string trail;
  int first_bad = -1;
  char detail[160] = "";
  for (int r = 0; r < kRegions && first_bad < 0; ++r) {
    for (int q = 0; q < r; ++q) enqueue_region(q, s, table, stream);
    EX_CHECK(cudaGraphLaunch(execs[r], stream));
    EX_CHECK(cudaStreamSynchronize(stream));
    const std::vector<double> graph_out = region_output(r, s);
    enqueue_region(r, s, table, stream);  // region r does not write its own input
    EX_CHECK(cudaStreamSynchronize(stream));
    const std::vector<double> eager_out = region_output(r, s);
    size_t i = 0;
    while (i < eager_out.size() && eager_out[i] == graph_out[i]) ++i;
    if (i < eager_out.size()) {
      first_bad = r;
      std::snprintf(detail, sizeof(detail), "%s differs (element %zu: eager %g, graph %g)",
                    kRegionNames[r], i, eager_out[i], graph_out[i]);
      trail += detail;
    } else {
      trail += std::string(kRegionNames[r]) + " equal" + (r + 1 < kRegions ? ", " : "");
    }
  }
  for (int r = 0; r < kRegions; ++r) ex::destroy_graph(execs[r], graphs[r]);

  if (args.broken() && !unmapped) {
    const bool ok = other == old_table && graph_table == old_table && eager_loss == cpu_loss &&
                    graph_loss != eager_loss && first_bad == 1;
    return ex::report(
        "M1", args, ok,
        "scale table rebuilt after capture, the old block handed to another buffer "
        "(%s): loss eager %.0f (CPU %.0f), graph %.0f; bisection: %s; first differing "
        "region: %d (%s)",
        other == old_table ? "same address" : "another address", eager_loss, cpu_loss, graph_loss,
        trail.c_str(), first_bad, first_bad >= 0 ? kRegionNames[first_bad] : "none");
  }
  if (args.broken()) {
    return ex::report("M1", args, false,
                      "scale table freed with cudaFree, but the replay did not fault: loss eager "
                      "%.0f, graph %.0f; bisection: %s",
                      eager_loss, graph_loss, trail.c_str());
  }
  const bool ok =
      graph_table == table && eager_loss == cpu_loss && graph_loss == eager_loss && first_bad < 0;
  return ex::report("M1", args, ok,
                    "scale table rebuilt in place (the captured address): loss eager %.0f (CPU "
                    "%.0f), graph %.0f; bisection: %s; no region differs",
                    eager_loss, cpu_loss, graph_loss, trail.c_str());
}
