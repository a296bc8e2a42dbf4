// M2/M3: graphs holding private memory. Each of 4 graphs (one per model stage) owns its own static
// input and output buffers, and stage k's output is copied into stage k+1's input: memory grows
// with the number of graphs. Planned instead, the stages chain through one shared arena that all
// graphs use in turn.
#include "common.h"

#include <vector>

constexpr int kGraphs = 4;
constexpr size_t kFloats = size_t(32) << 20;  // 128 MiB per buffer

__global__ void stage(const float* in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = in[i] + 1.0f;
  }
}

static size_t used_bytes() {
  size_t free = 0, total = 0;
  EX_CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "M2/M3");
  ex::require_gpu();
  constexpr size_t kBytes = kFloats * sizeof(float);
  const cudaStream_t stream = ex::nonblocking_stream();
  EX_CHECK(cudaStreamSynchronize(stream));
  const size_t before = used_bytes();

  // Broken: every graph gets a private input and output. Fixed: one arena of two buffers,
  // ping-ponged.
  std::vector<float*> in(kGraphs), out(kGraphs);
  if (args.broken()) {
    for (int g = 0; g < kGraphs; ++g) {
      EX_CHECK(cudaMalloc(&in[g], kBytes));
      EX_CHECK(cudaMalloc(&out[g], kBytes));
    }
  } else {
    char* arena;
    EX_CHECK(cudaMalloc(&arena, 2 * kBytes));
    float* ping = reinterpret_cast<float*>(arena);
    float* pong = reinterpret_cast<float*>(arena + kBytes);
    for (int g = 0; g < kGraphs; ++g) {
      in[g] =
          g % 2 == 0 ? ping : pong;  // stage g reads what stage g-1 wrote: no copy between graphs
      out[g] = g % 2 == 0 ? pong : ping;
    }
  }
  const size_t used = used_bytes() - before;

  std::vector<cudaGraphExec_t> graphs(kGraphs);
  for (int g = 0; g < kGraphs; ++g) {
    cudaGraph_t graph;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    stage<<<1024, 256, 0, stream>>>(in[g], out[g], kFloats);
    graphs[g] = ex::end_capture_and_instantiate(stream, &graph);
    EX_CHECK(cudaGraphDestroy(graph));
  }
  // One step: the input is 0; each stage adds 1, so the final output is 4 everywhere.
  EX_CHECK(cudaMemsetAsync(in[0], 0, kBytes, stream));
  for (int g = 0; g < kGraphs; ++g) {
    EX_CHECK(cudaGraphLaunch(graphs[g], stream));
    if (args.broken() && g + 1 < kGraphs) {
      EX_CHECK(cudaMemcpyAsync(in[g + 1], out[g], kBytes, cudaMemcpyDeviceToDevice, stream));
    }
  }
  float first = 0, last = 0;
  EX_CHECK(
      cudaMemcpyAsync(&first, out[kGraphs - 1], sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaMemcpyAsync(&last, out[kGraphs - 1] + kFloats - 1, sizeof(float),
                           cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  for (cudaGraphExec_t g : graphs) EX_CHECK(cudaGraphExecDestroy(g));

  const double mib = double(used) / (1 << 20), buffer_mib = double(kBytes) / (1 << 20);
  const bool correct = first == kGraphs && last == kGraphs;
  // Private: 2 buffers per graph (8 x 128 MiB); shared: 2 buffers in all.
  const bool ok = correct && (args.broken() ? mib >= 7.5 * buffer_mib : mib <= 2.5 * buffer_mib);
  return ex::report("M2/M3", args, ok,
                    "%d graphs with %s memory: %.0f MiB of device memory (%.0f MiB per buffer), "
                    "result %.0f (expected %d)",
                    kGraphs, args.broken() ? "private" : "shared", mib, buffer_mib, first, kGraphs);
}
