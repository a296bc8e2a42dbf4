// M4: a temporary reallocated after capture. An op keeps a workspace that it grows on demand, as
// libraries and framework ops do: when a bigger shape needs more, it frees the old workspace and
// allocates a bigger one. A graph captured before the growth keeps the old workspace's address, so
// every replay writes its temporaries into memory that now belongs to someone else. Here a caching
// (stream-ordered) pool hands the freed block to the next buffer of its size, the long batch's
// output, and the next replay silently overwrites it; the replay's own result stays right.
// Broken: the workspace grows after capture (2 MiB -> 4 MiB) for one long batch run eagerly.
// Fixed: the workspace is planned before capture for the largest shape and never moves.
#include "common.h"

#include <cmath>
#include <cstdint>
#include <vector>

constexpr int kThreads = 256;
constexpr int kSmall = 1 << 16;               // the captured shape: 256 KiB of floats
constexpr int kLong = 1 << 19;                // the rare long batch, run eagerly: 2 MiB of floats
constexpr size_t kGranule = size_t(2) << 20;  // workspace sizes round up to 2 MiB, as allocators do

// The op: y = x / sqrt(sum(x^2)), L2 normalization. Its workspace holds e = x^2, the per-block
// partial sums and the total.
__global__ void square(const float* x, int n, float* e) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) e[i] = x[i] * x[i];
}
__global__ void block_sums(const float* e, int n, float* partials) {
  __shared__ float s[kThreads];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  s[threadIdx.x] = i < n ? e[i] : 0.0f;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = s[0];
}
__global__ void total(const float* partials, int blocks, float* sum) {
  __shared__ float s[kThreads];
  float v = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) v += partials[b];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) *sum = s[0];
}
__global__ void normalize(const float* x, int n, const float* sum, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] / sqrtf(*sum);
}

static int blocks_for(int n) {
  return (n + kThreads - 1) / kThreads;
}
static size_t workspace_bytes(int n) {
  const size_t need = (size_t(n) + blocks_for(n) + 1) * sizeof(float);
  return (need + kGranule - 1) / kGranule * kGranule;
}

// A workspace that grows on demand: a bigger request allocates a new block and frees the old one
// (stream-ordered, from the program's pool).
struct LazyWorkspace {
  cudaMemPool_t pool;
  float* ptr = nullptr;
  size_t bytes = 0;
  void ensure(size_t need, cudaStream_t stream) {
    if (need <= bytes) return;
    float* old = ptr;
    EX_CHECK(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&ptr), need, pool, stream));
    if (old != nullptr) EX_CHECK(cudaFreeAsync(old, stream));
    bytes = need;
  }
};

static void op(const float* x, int n, float* y, LazyWorkspace& ws, cudaStream_t stream) {
  ws.ensure(workspace_bytes(n), stream);
  float* e = ws.ptr;
  float* partials = e + n;
  float* sum = partials + blocks_for(n);
  square<<<blocks_for(n), kThreads, 0, stream>>>(x, n, e);
  block_sums<<<blocks_for(n), kThreads, 0, stream>>>(e, n, partials);
  total<<<1, kThreads, 0, stream>>>(partials, blocks_for(n), sum);
  normalize<<<blocks_for(n), kThreads, 0, stream>>>(x, n, sum, y);
  EX_CHECK(cudaGetLastError());
}

static std::vector<float> batch(int n, int seed) {
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = float((i * 7 + seed * 3) % 5 - 2);
  return x;
}
// How many of y differ from the CPU's x / sqrt(sum(x^2)) by more than a rounding.
static int wrong_elements(const std::vector<float>& x, const std::vector<float>& y) {
  double sum = 0;
  for (float v : x) sum += double(v) * v;
  const double norm = std::sqrt(sum);
  int wrong = 0;
  for (size_t i = 0; i < x.size(); ++i) wrong += std::fabs(y[i] - x[i] / norm) > 1e-6;
  return wrong;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "M4");
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  int pools = 0;
  EX_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
  if (!pools) {
    std::printf("SKIPPED: device 0 has no stream-ordered memory pools\n");
    return 77;
  }
  const cudaStream_t stream = ex::nonblocking_stream();
  // The program's caching pool: keeps freed blocks (release threshold never) and hands a freed
  // block to the next request of its size on the same stream, as a framework's allocator does.
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  LazyWorkspace ws;
  EX_CHECK(cudaMemPoolCreate(&ws.pool, &props));
  uint64_t never = UINT64_MAX;
  EX_CHECK(cudaMemPoolSetAttribute(ws.pool, cudaMemPoolAttrReleaseThreshold, &never));

  // Fixed: the workspace planned before any capture for the largest shape the program runs.
  if (!args.broken()) ws.ensure(workspace_bytes(kLong), stream);

  // The small batches' static input and output; one eager warm-up sizes the workspace (broken: for
  // the small shape only), then the op is captured.
  float *x_small, *y_small, *x_long;
  EX_CHECK(cudaMalloc(&x_small, kSmall * sizeof(float)));
  EX_CHECK(cudaMalloc(&y_small, kSmall * sizeof(float)));
  EX_CHECK(cudaMalloc(&x_long, kLong * sizeof(float)));
  std::vector<float> xs = batch(kSmall, 1), ys(kSmall);
  EX_CHECK(cudaMemcpy(x_small, xs.data(), kSmall * sizeof(float), cudaMemcpyHostToDevice));
  op(x_small, kSmall, y_small, ws, stream);
  EX_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  op(x_small, kSmall, y_small, ws, stream);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  float* const captured_ws = ws.ptr;
  const size_t captured_bytes = ws.bytes;
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(
      cudaMemcpyAsync(ys.data(), y_small, kSmall * sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  int graph_wrong = wrong_elements(xs, ys);

  // A long batch, above the captured shape, runs eagerly. The op grows its workspace (broken) and
  // returns a new output, allocated from the same pool.
  std::vector<float> xl = batch(kLong, 2), yl(kLong), yl_after(kLong);
  EX_CHECK(cudaMemcpy(x_long, xl.data(), kLong * sizeof(float), cudaMemcpyHostToDevice));
  ws.ensure(workspace_bytes(kLong), stream);
  float* y_long = nullptr;
  EX_CHECK(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&y_long), kLong * sizeof(float),
                                   ws.pool, stream));
  op(x_long, kLong, y_long, ws, stream);
  EX_CHECK(
      cudaMemcpyAsync(yl.data(), y_long, kLong * sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  const int long_wrong_before = wrong_elements(xl, yl);

  // The next small batch: a replay. The long batch's output is still held (the loss, a log).
  xs = batch(kSmall, 3);
  EX_CHECK(cudaMemcpy(x_small, xs.data(), kSmall * sizeof(float), cudaMemcpyHostToDevice));
  EX_CHECK(cudaGraphLaunch(exec, stream));
  EX_CHECK(
      cudaMemcpyAsync(ys.data(), y_small, kSmall * sizeof(float), cudaMemcpyDeviceToHost, stream));
  EX_CHECK(cudaMemcpyAsync(yl_after.data(), y_long, kLong * sizeof(float), cudaMemcpyDeviceToHost,
                           stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  graph_wrong += wrong_elements(xs, ys);
  int overwritten = 0;
  for (int i = 0; i < kLong; ++i) overwritten += yl_after[i] != yl[i];

  ex::destroy_graph(exec, graph);  // the graph first, then what it may refer to
  EX_CHECK(cudaFreeAsync(y_long, stream));
  EX_CHECK(cudaFreeAsync(ws.ptr, stream));
  EX_CHECK(cudaStreamSynchronize(stream));
  EX_CHECK(cudaMemPoolDestroy(ws.pool));
  const bool moved = ws.ptr != captured_ws;
  const bool on_old = static_cast<void*>(y_long) == static_cast<void*>(captured_ws);
  const double mib = 1.0 / (1 << 20);

  if (args.broken()) {
    // The symptom: the workspace moved, the long batch's output sits on the captured workspace and
    // the replay overwrote part of it, while every result computed looked right when computed.
    const bool ok =
        moved && on_old && overwritten > 0 && graph_wrong == 0 && long_wrong_before == 0;
    return ex::report(
        "M4", args, ok,
        "workspace grown after capture (%.0f -> %.0f MiB, %p -> %p); the long batch's output at "
        "%p (%s), right when computed; the next replay overwrote %d of its %d elements (its own "
        "result %s)",
        captured_bytes * mib, ws.bytes * mib, static_cast<void*>(captured_ws),
        static_cast<void*>(ws.ptr), static_cast<void*>(y_long),
        on_old ? "the captured workspace" : "elsewhere", overwritten, kLong,
        graph_wrong == 0 ? "right" : "wrong");
  }
  const bool ok =
      !moved && !on_old && overwritten == 0 && graph_wrong == 0 && long_wrong_before == 0;
  return ex::report("M4", args, ok,
                    "workspace planned before capture (%.0f MiB at %p, never moved); the long "
                    "batch's output at %p (%s), right when computed; the next replay overwrote %d "
                    "of its %d elements (its own result %s)",
                    captured_bytes * mib, static_cast<void*>(captured_ws),
                    static_cast<void*>(y_long), on_old ? "the captured workspace" : "elsewhere",
                    overwritten, kLong, graph_wrong == 0 ? "right" : "wrong");
}
