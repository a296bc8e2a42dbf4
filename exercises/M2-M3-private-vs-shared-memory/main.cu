// M2/M3: graphs holding memory of their own instead of sharing one pool. Four graphs (one per
// model stage) each need a 128 MiB temporary, allocated inside the capture with cudaMallocAsync, so
// it is a graph allocation (a memory node) from CUDA's graph memory pool. Broken: each graph keeps
// its temporary alive after it ends (allocated in the graph, freed by the program after the whole
// step): the four allocations are live together and each holds its own physical memory, 512 MiB,
// which cudaDeviceGraphMemTrim cannot give back while they live. Fixed: each graph frees its
// temporary before it ends (cudaFreeAsync in the capture); launched in order into one stream, the
// four graphs share the pool's physical memory, 128 MiB in all. The graph memory attributes
// (used and reserved, current and high-water) say what each held.
#include "common.h"

#include <vector>

constexpr int kGraphs = 4;
constexpr size_t kFloats = size_t(32) << 20;  // 128 MiB per temporary
constexpr size_t kBytes = kFloats * sizeof(float);

__global__ void add_one(const float* in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = in[i] + 1.0f;
  }
}

__global__ void copy(const float* in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
}

// One graph memory attribute of device 0, in MiB.
static double graph_mem_mib(cudaGraphMemAttributeType attr) {
  unsigned long long bytes = 0;
  EX_CHECK(cudaDeviceGetGraphMemAttribute(0, attr, &bytes));
  return double(bytes) / (1 << 20);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "M2/M3");
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  const cudaStream_t stream = ex::nonblocking_stream();
  // The activations the stages pass on: ordinary memory, planned before any capture.
  float* io = ex::device_zeros<float>(kFloats);
  const double buffer_mib = double(kBytes) / (1 << 20);

  // Stage g: tmp = io + 1 (tmp a graph allocation), io = tmp. Broken: tmp outlives the graph.
  std::vector<float*> kept(kGraphs, nullptr);
  std::vector<cudaGraphExec_t> graphs(kGraphs);
  for (int g = 0; g < kGraphs; ++g) {
    cudaGraph_t graph;
    float* tmp = nullptr;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    EX_CHECK(cudaMallocAsync(&tmp, kBytes, stream));
    add_one<<<1024, 256, 0, stream>>>(io, tmp, kFloats);
    copy<<<1024, 256, 0, stream>>>(tmp, io, kFloats);
    if (args.broken())
      kept[g] = tmp;  // freed by the program after the step
    else
      EX_CHECK(cudaFreeAsync(tmp, stream));  // freed inside the graph
    graphs[g] = ex::end_capture_and_instantiate(stream, &graph);
    EX_CHECK(cudaGraphDestroy(graph));
  }

  // One step: the four graphs in order, on one stream.
  for (cudaGraphExec_t g : graphs) EX_CHECK(cudaGraphLaunch(g, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const double used_high = graph_mem_mib(cudaGraphMemAttrUsedMemHigh);
  const double reserved_high = graph_mem_mib(cudaGraphMemAttrReservedMemHigh);
  // Trimming gives back only the physical memory that no live allocation holds.
  EX_CHECK(cudaDeviceGraphMemTrim(0));
  const double reserved_trimmed = graph_mem_mib(cudaGraphMemAttrReservedMemCurrent);
  float first = 0, last = 0;
  EX_CHECK(cudaMemcpy(&first, io, sizeof(float), cudaMemcpyDeviceToHost));
  EX_CHECK(cudaMemcpy(&last, io + kFloats - 1, sizeof(float), cudaMemcpyDeviceToHost));
  // The end of the run: the graphs go, the kept temporaries (broken) are freed, a last trim.
  for (cudaGraphExec_t g : graphs) EX_CHECK(cudaGraphExecDestroy(g));
  for (float* p : kept) {
    if (p != nullptr) EX_CHECK(cudaFreeAsync(p, stream));
  }
  EX_CHECK(cudaStreamSynchronize(stream));
  EX_CHECK(cudaDeviceGraphMemTrim(0));
  const double reserved_end = graph_mem_mib(cudaGraphMemAttrReservedMemCurrent);

  const bool correct = first == kGraphs && last == kGraphs;
  if (args.broken()) {
    // The symptom: the graphs hold four temporaries' worth (at least 3.5), and a trim while they
    // live gives none of it back.
    const bool ok = correct && used_high >= 3.5 * buffer_mib && reserved_high >= 3.5 * buffer_mib &&
                    reserved_trimmed >= 3.5 * buffer_mib && reserved_end < 0.5 * buffer_mib;
    return ex::report(
        "M2/M3", args, ok,
        "%d graphs keeping their %.0f MiB temporaries: graph memory used high %.0f MiB, reserved "
        "high %.0f MiB; reserved after a trim while they live %.0f MiB, after freeing them and a "
        "trim %.0f MiB; result %.0f (expected %d)",
        kGraphs, buffer_mib, used_high, reserved_high, reserved_trimmed, reserved_end, first,
        kGraphs);
  }
  // The fix: the four graphs share one temporary's worth (at most 1.5), and trimming gives it back.
  const bool ok = correct && used_high <= 1.5 * buffer_mib && reserved_high <= 1.5 * buffer_mib &&
                  reserved_end < 0.5 * buffer_mib;
  return ex::report(
      "M2/M3", args, ok,
      "%d graphs freeing their %.0f MiB temporaries inside: graph memory used high %.0f MiB, "
      "reserved high %.0f MiB; reserved after a trim %.0f MiB, after the graphs are destroyed "
      "and a trim %.0f MiB; result %.0f (expected %d)",
      kGraphs, buffer_mib, used_high, reserved_high, reserved_trimmed, reserved_end, first,
      kGraphs);
}
