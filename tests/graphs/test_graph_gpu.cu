// Graph on the device: capture, launch and statistics; in-place update when only a pointer changes
// and the reported fallback when the topology changes; capture refused with the fault class for a
// host sync, an unchecked sync and an unjoined fork, leaving no capture open and no error pending;
// capture modes; dot files through REPLAY_GRAPH_DUMP.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/check.h"
#include "graphs/graph.h"
#include "tests/support/compare.h"

namespace replay::graphs {
namespace {

using test::DeviceBuffer;

__global__ void add_kernel(float* x, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += v;
}

__global__ void fill_kernel(float* x, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = v;
}

void add(float* x, float v, int n, cudaStream_t s) {
  add_kernel<<<(n + 255) / 256, 256, 0, s>>>(x, v, n);
  REPLAY_LAUNCH_CHECK();
}

void fill(float* x, float v, int n, cudaStream_t s) {
  fill_kernel<<<(n + 255) / 256, 256, 0, s>>>(x, v, n);
  REPLAY_LAUNCH_CHECK();
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// No capture open on `s` and no error pending: what every refused capture must leave behind.
void expect_clean(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

void expect_all(const DeviceBuffer<float>& buf, float v) {
  const std::vector<float> h = buf.download();
  for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i], v) << "element " << i;
}

TEST(Graph, CaptureLaunchAndStatistics) {
  CaptureStream work, cap;
  const int n = 1000;
  DeviceBuffer<float> x(n);
  fill(x.get(), 0.0f, n, work.get());
  Graph g("three.adds");
  g.build(
      cap.get(),
      [&](cudaStream_t s) {
        add(x.get(), 1.0f, n, s);
        add(x.get(), 2.0f, n, s);
        add(x.get(), 4.0f, n, s);
      },
      work.get());
  EXPECT_EQ(g.stats().nodes, 3u);
  EXPECT_GT(g.stats().capture_ms, 0.0);
  EXPECT_GT(g.stats().instantiate_ms, 0.0);
  expect_all(x, 0.0f);  // capture executes nothing
  for (int i = 0; i < 5; ++i) g.launch(work.get());
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  expect_all(x, 35.0f);

  Graph moved = std::move(g);  // RAII: the moved-from graph owns nothing
  EXPECT_FALSE(g.instantiated());
  moved.launch(work.get());
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  expect_all(x, 42.0f);
}

TEST(Graph, UpdatesInPlaceWhenOnlyAPointerChanges) {
  CaptureStream work, cap;
  const int n = 512;
  DeviceBuffer<float> a(n), b(n);
  fill(a.get(), 0.0f, n, work.get());
  fill(b.get(), 0.0f, n, work.get());
  Graph g("fill");
  g.build(
      cap.get(), [&](cudaStream_t s) { fill(a.get(), 1.0f, n, s); }, work.get());
  g.launch(work.get());

  const UpdateReport r = g.update(
      cap.get(), [&](cudaStream_t s) { fill(b.get(), 2.0f, n, s); }, work.get());
  EXPECT_TRUE(r.in_place) << r.reason;
  EXPECT_EQ(r.graph, "fill");
  EXPECT_TRUE(r.reason.empty());
  EXPECT_EQ(g.stats().updates_in_place, 1);
  EXPECT_EQ(g.stats().reinstantiations, 0);
  g.launch(work.get());
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  expect_all(a, 1.0f);
  expect_all(b, 2.0f);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Graph, FallsBackToReinstantiationAndSaysWhyWhenTopologyChanges) {
  CaptureStream work, cap;
  const int n = 512;
  DeviceBuffer<float> a(n);
  fill(a.get(), 0.0f, n, work.get());
  Graph g("grows");
  g.build(
      cap.get(), [&](cudaStream_t s) { add(a.get(), 1.0f, n, s); }, work.get());
  const UpdateReport r = g.update(
      cap.get(),
      [&](cudaStream_t s) {
        add(a.get(), 1.0f, n, s);
        add(a.get(), 10.0f, n, s);
      },
      work.get());
  EXPECT_FALSE(r.in_place);
  EXPECT_TRUE(has(r.reason, "cudaGraphExecUpdateError")) << r.reason;
  EXPECT_EQ(g.stats().reinstantiations, 1);
  EXPECT_EQ(g.stats().nodes, 2u);
  // The refused update left no error behind for the next check to misattribute.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  g.launch(work.get());
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  expect_all(a, 11.0f);
}

TEST(Graph, HostSynchronizationInsideCaptureIsRefusedWithItsFaultClass) {
  CaptureStream work, cap;
  const int n = 256;
  DeviceBuffer<float> x(n);
  Graph g("layer7.fwd");
  try {
    g.capture(cap.get(), [&](cudaStream_t s) {
      fill(x.get(), 1.0f, n, s);
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));  // the bug: a host sync inside the region
    });
    FAIL() << "capture accepted a host synchronization";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has(m, "graph 'layer7.fwd'")) << m;
    EXPECT_TRUE(has(m, "host synchronization during capture (cudaErrorStreamCaptureUnsupported)"))
        << m;
    EXPECT_TRUE(has(m, "cudaStreamSynchronize")) << m;
    EXPECT_TRUE(has(m, "Fix:")) << m;
  }
  EXPECT_FALSE(g.captured());
  expect_clean(cap.get());

  // An unchecked sync is found too: its error was left pending when the region returned.
  try {
    g.capture(cap.get(), [&](cudaStream_t s) {
      fill(x.get(), 1.0f, n, s);
      (void)cudaStreamSynchronize(s);
    });
    FAIL() << "capture accepted an unchecked host synchronization";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "(cudaErrorStreamCaptureUnsupported)")) << e.what();
  }
  expect_clean(cap.get());

  // The same stream captures a correct region afterwards.
  g.build(
      cap.get(), [&](cudaStream_t s) { fill(x.get(), 3.0f, n, s); }, work.get());
  g.launch(work.get());
  ASSERT_EQ(cudaStreamSynchronize(work.get()), cudaSuccess);
  expect_all(x, 3.0f);
}

TEST(Graph, UnjoinedForkIsReportedAsSuch) {
  CaptureStream cap;
  const int n = 256;
  DeviceBuffer<float> x(n), y(n);
  cudaEvent_t fork = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  {
    CaptureStream side;
    Graph g("attn.overlap");
    try {
      g.capture(cap.get(), [&](cudaStream_t s) {
        REPLAY_CUDA_CHECK(cudaEventRecord(fork, s));
        REPLAY_CUDA_CHECK(cudaStreamWaitEvent(side.get(), fork, 0));
        fill(y.get(), 2.0f, n, side.get());  // forked ...
        fill(x.get(), 1.0f, n, s);           // ... and never joined back
      });
      FAIL() << "capture accepted an unjoined fork";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_TRUE(has(m, "graph 'attn.overlap'")) << m;
      EXPECT_TRUE(has(m, "not joined back")) << m;
      EXPECT_TRUE(has(m, "cudaErrorStreamCaptureUnjoined")) << m;
    }
    expect_clean(cap.get());
  }
  (void)cudaGetLastError();  // whatever destroying the side stream reported
  ASSERT_EQ(cudaEventDestroy(fork), cudaSuccess);
}

// Another thread makes a capture-unsafe call (cudaMalloc) while this thread captures: refused in
// global mode, allowed in thread-local mode. Returns the other thread's status.
cudaError_t other_thread_malloc_during_capture(CaptureMode mode, bool* capture_failed) {
  CaptureStream cap;
  DeviceBuffer<float> x(64);
  Graph g("threads");
  cudaError_t other = cudaSuccess;
  *capture_failed = false;
  try {
    g.capture(
        cap.get(),
        [&](cudaStream_t s) {
          fill(x.get(), 1.0f, 64, s);
          std::thread t([&] {
            void* p = nullptr;
            other = cudaMalloc(&p, 1024);
            if (other == cudaSuccess) cudaFree(p);
            (void)cudaGetLastError();  // that thread's own error state
          });
          t.join();
        },
        mode);
  } catch (const Error& e) {
    *capture_failed = true;
    EXPECT_TRUE(has(e.what(), "graph 'threads'")) << e.what();
  }
  expect_clean(cap.get());
  return other;
}

TEST(Graph, ThreadLocalCaptureLetsOtherThreadsUseCuda) {
  bool failed = false;
  EXPECT_EQ(other_thread_malloc_during_capture(CaptureMode::kThreadLocal, &failed), cudaSuccess);
  EXPECT_FALSE(failed);
  EXPECT_EQ(other_thread_malloc_during_capture(CaptureMode::kGlobal, &failed),
            cudaErrorStreamCaptureUnsupported);
}

TEST(Graph, NeedsANonBlockingExplicitStream) {
  Graph g("legacy");
  EXPECT_THROW(g.capture(nullptr, [](cudaStream_t) {}), Error);
  cudaStream_t blocking = nullptr;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  EXPECT_THROW(g.capture(blocking, [](cudaStream_t) {}), Error);
  ASSERT_EQ(cudaStreamDestroy(blocking), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Graph, DumpsOneDotFilePerGraphWhenAsked) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("replay_graph_dump_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  ASSERT_EQ(setenv("REPLAY_GRAPH_DUMP", dir.c_str(), 1), 0);
  CaptureStream work, cap;
  DeviceBuffer<float> x(64);
  Graph g("layer0/fwd");
  g.build(
      cap.get(), [&](cudaStream_t s) { fill(x.get(), 1.0f, 64, s); }, work.get());
  unsetenv("REPLAY_GRAPH_DUMP");
  const std::filesystem::path file = dir / "layer0_fwd.dot";
  ASSERT_TRUE(std::filesystem::exists(file)) << file;
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_TRUE(has(text.str(), "digraph")) << text.str().substr(0, 200);
  EXPECT_TRUE(has(text.str(), "fill_kernel")) << "kernel names appear in the dump";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace replay::graphs
