// N7: a graph's input freed after capture and its address handed to a new buffer. The graph keeps
// the raw address it captured, so the replay reads whatever lives there now: no error, the new
// buffer's data. The stream-ordered allocator makes the reuse certain here: a buffer freed with
// cudaFreeAsync goes back to its pool, and the next allocation of the same size from that pool on
// the same stream gets the same address. Broken: input A (42) freed after capture, buffer B (99)
// allocated next; the replay reads 99. Fixed: A stays alive as long as the graph, B gets another
// address and the replay reads 42.
#include "common.h"

#include <cstdint>

constexpr size_t kInts = size_t(1) << 19;  // 2 MiB, one block of the pool's granularity
constexpr size_t kBytes = kInts * sizeof(int);

__global__ void fill(int* data, int value, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] = value;
  }
}

// The captured work: out = the input's first element.
__global__ void read_input(const int* in, int* out) {
  *out = in[0];
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N7");
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  int pools = 0;
  EX_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
  if (!pools) {
    std::printf("SKIPPED: device 0 has no stream-ordered memory pools\n");
    return 77;
  }
  const cudaStream_t stream = ex::nonblocking_stream();
  // A pool of the exercise's own (nothing else allocates from it) that keeps freed memory (release
  // threshold: never), so what the allocator hands out depends only on the calls below.
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  cudaMemPool_t pool;
  EX_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t never = UINT64_MAX;
  EX_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &never));

  // Input A holds 42; the graph is captured reading it.
  int* a = nullptr;
  EX_CHECK(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&a), kBytes, pool, stream));
  fill<<<256, 256, 0, stream>>>(a, 42, kInts);
  int* out = ex::device_zeros<int>();
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  read_input<<<1, 1, 0, stream>>>(a, out);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const int first = ex::read_back(out);  // 42: A is alive

  // Broken: A's owner is done with it and frees it (the graph still holds its address); the next
  // buffer of the same size, B, comes from the same pool on the same stream. Fixed: A is kept alive
  // for the graph's lifetime, so B is placed elsewhere.
  if (args.broken()) EX_CHECK(cudaFreeAsync(a, stream));
  int* b = nullptr;
  EX_CHECK(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&b), kBytes, pool, stream));
  fill<<<256, 256, 0, stream>>>(b, 99, kInts);
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const int second = ex::read_back(out);
  const bool same = a == b;

  ex::destroy_graph(exec, graph);  // the graph first, then the buffers it reads
  if (!args.broken()) EX_CHECK(cudaFreeAsync(a, stream));
  EX_CHECK(cudaFreeAsync(b, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  EX_CHECK(cudaMemPoolDestroy(pool));

  if (args.broken()) {
    // The symptom: B at A's address, and the replay reads B's 99. A new address would mean the
    // pool did not reuse the block: the exercise then shows nothing (and A's freed memory was
    // read).
    const bool ok = first == 42 && same && second == 99;
    return ex::report("N7", args, ok,
                      "input A (42) at %p freed after capture, new buffer B (99) allocated at %p "
                      "(%s): replay read %d (%s; first replay read %d)",
                      static_cast<void*>(a), static_cast<void*>(b),
                      same ? "the same address" : "a new address: the pool did not reuse A's block",
                      second, second == 99 ? "B's data, not A's 42" : "expected B's 99", first);
  }
  const bool ok = first == 42 && !same && second == 42;
  return ex::report(
      "N7", args, ok,
      "input A (42) at %p kept alive for the graph, new buffer B (99) allocated at %p (%s): "
      "replay read %d (expected 42; first replay read %d)",
      static_cast<void*>(a), static_cast<void*>(b), same ? "the same address" : "another address",
      second, first);
}
