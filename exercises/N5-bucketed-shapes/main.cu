// N5 (bucketing): dynamic shapes under CUDA graphs. A graph freezes its grid and its by-value size
// arguments, so one graph captured at one sequence length and replayed for others silently computes
// something else (N5). The pattern that works: a ladder of buckets (maximum lengths 128 .. 2048),
// one executable per bucket captured at the bucket's size, each request padded to the smallest
// bucket that fits (the live length in device memory masks the padding, the host trims the output),
// an eager fallback for the rare request above the top bucket, and the graph memory each bucket
// needs measured (cudaGraphMemAttrUsedMemHigh, reset before each bucket's first replay). Broken:
// one graph captured at length 512, replayed for eight lengths: only 512 comes out right. Fixed:
// the buckets: all eight right, one of them (3000 > 2048) by the eager fallback.
#include "common.h"

#include <cmath>
#include <vector>

constexpr int kH = 1024;          // features per token
constexpr int kMaxRows = 4096;    // capacity of the static input and output buffers
constexpr int kCapturedAt = 512;  // broken: the one length the graph was captured at
constexpr int kBuckets[] = {128, 256, 512, 1024, 2048};
constexpr int kNumBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);
constexpr int kLengths[] = {100, 1000, 512, 130, 2048, 3000, 517, 1};
constexpr int kNumLengths = sizeof(kLengths) / sizeof(kLengths[0]);
constexpr int kThreads = 256;

// t = 2x + 1 on the live rows, 0 on the padding. `rows` is the grid's extent (the bucket), `len`
// the live length read on the device at every replay.
__global__ void affine_masked(const float* x, float* t, const int* len, int rows) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= size_t(rows) * kH) return;
  t[i] = int(i / kH) < *len ? 2.0f * x[i] + 1.0f : 0.0f;
}
// Broken: the length is a by-value argument, frozen at capture; there is no mask.
__global__ void affine_n(const float* x, float* t, int rows) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < size_t(rows) * kH) t[i] = 2.0f * x[i] + 1.0f;
}
// y = t on the live rows (the host reads back only those: the trim); sum += t over the grid.
__global__ void copy_and_sum(const float* t, float* y, const int* len, int rows, double* sum) {
  __shared__ double partial[kThreads];
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  double v = 0;
  if (i < size_t(rows) * kH) {
    v = t[i];
    if (len == nullptr || int(i / kH) < *len) y[i] = t[i];
  }
  partial[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum, partial[0]);
}
// loss = sum / (len * H): the mean over the live elements.
__global__ void finish_mean(const double* sum, const int* len, double* loss) {
  *loss = *sum / (double(*len) * kH);
}
__global__ void finish_mean_n(const double* sum, int rows, double* loss) {
  *loss = *sum / (double(rows) * kH);
}

struct Buffers {
  float* x;     // static input, padded
  float* y;     // static output, trimmed by the host
  int* len;     // live length
  double* sum;  // reduction scratch
  double* loss;
};

static int blocks_for(int rows) {
  return int((size_t(rows) * kH + kThreads - 1) / kThreads);
}

// The step for `rows` rows (the grid), masked by the device length when `masked`. The temporary t
// comes from cudaMallocAsync on the stream: inside a capture it is a graph allocation (a memory
// node), freed inside the graph; eagerly it is a stream-ordered allocation.
static void enqueue_step(cudaStream_t stream, const Buffers& b, int rows, bool masked) {
  float* t = nullptr;
  EX_CHECK(cudaMallocAsync(&t, size_t(rows) * kH * sizeof(float), stream));
  EX_CHECK(cudaMemsetAsync(b.sum, 0, sizeof(double), stream));
  if (masked) {
    affine_masked<<<blocks_for(rows), kThreads, 0, stream>>>(b.x, t, b.len, rows);
    copy_and_sum<<<blocks_for(rows), kThreads, 0, stream>>>(t, b.y, b.len, rows, b.sum);
    finish_mean<<<1, 1, 0, stream>>>(b.sum, b.len, b.loss);
  } else {
    affine_n<<<blocks_for(rows), kThreads, 0, stream>>>(b.x, t, rows);
    copy_and_sum<<<blocks_for(rows), kThreads, 0, stream>>>(t, b.y, nullptr, rows, b.sum);
    finish_mean_n<<<1, 1, 0, stream>>>(b.sum, rows, b.loss);
  }
  EX_CHECK(cudaGetLastError());
  EX_CHECK(cudaFreeAsync(t, stream));
}

// Captures the step for `rows` rows; *alloc_bytes: what the graph's memory-allocation nodes ask
// for.
static cudaGraphExec_t capture_step(cudaStream_t stream, const Buffers& b, int rows, bool masked,
                                    size_t* alloc_bytes) {
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue_step(stream, b, rows, masked);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  size_t count = 0;
  EX_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  EX_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  *alloc_bytes = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    EX_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeMemAlloc) continue;
    cudaMemAllocNodeParams params = {};
    EX_CHECK(cudaGraphMemAllocNodeGetParams(node, &params));
    *alloc_bytes += params.bytesize;
  }
  EX_CHECK(cudaGraphDestroy(graph));
  return exec;
}

// Request r's input: small integers, so every sum is exact. Every fourth row (shifted per request)
// is raised by 1, so that the mean of any run of rows depends on where it starts: with the balanced
// pattern alone (mean exactly 0 over every 5 rows) the broken graph's unmasked mean over 512 rows
// equalled the right one for length 100 on an H100, by accident.
static float input_value(int r, int row, int h) {
  return float((row * 7 + h * 3 + r * 11) % 5 - 2 + ((row + r) % 4 == 0 ? 1 : 0));
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N5-buckets");
  ex::require_gpu();
  EX_CHECK(cudaSetDevice(0));
  const cudaStream_t stream = ex::nonblocking_stream();
  Buffers b;
  EX_CHECK(cudaMalloc(&b.x, size_t(kMaxRows) * kH * sizeof(float)));
  EX_CHECK(cudaMalloc(&b.y, size_t(kMaxRows) * kH * sizeof(float)));
  EX_CHECK(cudaMemset(b.x, 0, size_t(kMaxRows) * kH * sizeof(float)));
  EX_CHECK(cudaMemset(b.y, 0xff, size_t(kMaxRows) * kH * sizeof(float)));  // NaN until written
  b.len = ex::device_zeros<int>();
  b.sum = ex::device_zeros<double>();
  b.loss = ex::device_zeros<double>();

  // Capture before any request: broken, one graph at 512; fixed, one per bucket, and the graph
  // memory each needs (the used high-water reset to 0 before its first replay).
  std::vector<cudaGraphExec_t> execs;
  double bucket_mib[kNumBuckets] = {};
  size_t alloc_bytes[kNumBuckets] = {};
  if (args.broken()) {
    execs.push_back(capture_step(stream, b, kCapturedAt, false, &alloc_bytes[0]));
  } else {
    for (int k = 0; k < kNumBuckets; ++k)
      execs.push_back(capture_step(stream, b, kBuckets[k], true, &alloc_bytes[k]));
    for (int k = 0; k < kNumBuckets; ++k) {
      unsigned long long zero = 0, used = 0;
      EX_CHECK(cudaStreamSynchronize(stream));
      EX_CHECK(cudaDeviceSetGraphMemAttribute(0, cudaGraphMemAttrUsedMemHigh, &zero));
      EX_CHECK(cudaGraphLaunch(execs[k], stream));
      EX_CHECK(cudaStreamSynchronize(stream));
      EX_CHECK(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrUsedMemHigh, &used));
      bucket_mib[k] = double(used) / (1 << 20);
    }
  }

  std::vector<float> host_x(size_t(kMaxRows) * kH), host_y(size_t(kMaxRows) * kH);
  int correct = 0, fallbacks = 0, replays = 0;
  bool only_captured_right = true;
  for (int r = 0; r < kNumLengths; ++r) {
    const int len = kLengths[r];
    double want_sum = 0;
    for (int row = 0; row < len; ++row) {
      for (int h = 0; h < kH; ++h) {
        host_x[size_t(row) * kH + h] = input_value(r, row, h);
        want_sum += 2.0 * input_value(r, row, h) + 1.0;
      }
    }
    const double want_loss = want_sum / (double(len) * kH);
    EX_CHECK(cudaMemcpyAsync(b.x, host_x.data(), size_t(len) * kH * sizeof(float),
                             cudaMemcpyHostToDevice, stream));
    EX_CHECK(cudaMemcpyAsync(b.len, &len, sizeof(int), cudaMemcpyHostToDevice, stream));
    if (args.broken()) {
      EX_CHECK(cudaGraphLaunch(execs[0], stream));  // whatever the length
      ++replays;
    } else {
      int k = 0;
      while (k < kNumBuckets && kBuckets[k] < len) ++k;
      if (k < kNumBuckets) {
        // Pad: the rows between the request and its bucket are zeroed (the mask ignores them).
        if (kBuckets[k] > len) {
          EX_CHECK(cudaMemsetAsync(b.x + size_t(len) * kH, 0,
                                   size_t(kBuckets[k] - len) * kH * sizeof(float), stream));
        }
        EX_CHECK(cudaGraphLaunch(execs[k], stream));
        ++replays;
      } else {
        enqueue_step(stream, b, len, true);  // above the top bucket: eager, sized to the request
        ++fallbacks;
      }
    }
    // Trim: only the live rows come back.
    EX_CHECK(cudaMemcpyAsync(host_y.data(), b.y, size_t(len) * kH * sizeof(float),
                             cudaMemcpyDeviceToHost, stream));
    double loss = 0;
    EX_CHECK(cudaMemcpyAsync(&loss, b.loss, sizeof(double), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));
    bool right = std::fabs(loss - want_loss) <= 1e-9 * std::fabs(want_loss) + 1e-12;
    for (size_t i = 0; right && i < size_t(len) * kH; ++i)
      right = host_y[i] == 2.0f * host_x[i] + 1.0f;
    correct += right;
    if (right != (len == kCapturedAt)) only_captured_right = false;
  }
  for (cudaGraphExec_t e : execs) EX_CHECK(cudaGraphExecDestroy(e));

  if (args.broken()) {
    // The symptom: every length but the captured one comes out wrong.
    const bool ok = only_captured_right && correct == 1;
    return ex::report("N5-buckets", args, ok,
                      "one graph captured at length %d, replayed for %d lengths: %d of %d wrong "
                      "(%s)",
                      kCapturedAt, kNumLengths, kNumLengths - correct, kNumLengths,
                      only_captured_right ? "only length 512 right" : "not only length 512 right");
  }
  // Each bucket's graph asks for exactly its temporary; the memory mapped for it holds at least
  // that, and a bigger bucket never less (CUDA maps graph memory in large steps: 32 MiB on an
  // H100).
  bool memory_ok = true;
  char alloc_text[128] = "", mem_text[128] = "";
  for (int k = 0; k < kNumBuckets; ++k) {
    const size_t need = size_t(kBuckets[k]) * kH * sizeof(float);
    memory_ok = memory_ok && alloc_bytes[k] == need && bucket_mib[k] >= double(need) / (1 << 20) &&
                (k == 0 || bucket_mib[k] >= bucket_mib[k - 1]);
    std::snprintf(alloc_text + std::strlen(alloc_text),
                  sizeof(alloc_text) - std::strlen(alloc_text), "%s%g", k ? "/" : "",
                  double(alloc_bytes[k]) / (1 << 20));
    std::snprintf(mem_text + std::strlen(mem_text), sizeof(mem_text) - std::strlen(mem_text),
                  "%s%g", k ? "/" : "", bucket_mib[k]);
  }
  const bool ok = correct == kNumLengths && fallbacks == 1 && memory_ok;
  return ex::report("N5-buckets", args, ok,
                    "%d lengths on buckets 128/256/512/1024/2048, padded and trimmed: %d of %d "
                    "correct (%d replays, %d eager fallback above 2048); graph allocations per "
                    "bucket %s MiB, mapped (used high-water) %s MiB",
                    kNumLengths, correct, kNumLengths, replays, fallbacks, alloc_text, mem_text);
}
