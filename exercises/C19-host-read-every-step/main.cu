// C19: `.item()`-style host reads of step scalars (the loss for logging, found-inf to decide
// whether to step the optimizer, the loss scale) in every step. Each read is a device-to-host copy
// and a stream synchronization: eagerly the host waits for every step and the GPU idles while the
// host launches the next one; inside a capture the synchronization is refused, so the step cannot
// be graphed at all.
// The fix makes the step sync-free: dynamic loss scaling on the device (scale, found-inf and the
// growth counter are device scalars), the optimizer reads found-inf itself and returns early (a
// no-op flag), and a captured kernel copies the scalars the host wants into a pinned, mapped ring
// that the host reads two steps late, waiting only for that old step (replay's graphs/readback.h).
#include "common.h"

#include <sys/stat.h>

#include <cmath>
#include <vector>

namespace {

// With REPLAY_GRAPH_DUMP=<dir> set (as for the workloads), writes the graph as
// <dir>/c19.<name>.dot.
void dump_dot(cudaGraph_t graph, const char* name) {
  const char* dir = std::getenv("REPLAY_GRAPH_DUMP");
  if (dir == nullptr || dir[0] == '\0') return;
  mkdir(dir, 0755);
  const std::string path = std::string(dir) + "/c19." + name + ".dot";
  EX_CHECK(cudaGraphDebugDotPrint(graph, path.c_str(), cudaGraphDebugDotFlagsVerbose));
}

constexpr int kN = 256;                   // parameters (one block)
constexpr int kSteps = 64;                // steps run and checked
constexpr float kLr = 1.0f / 64;          // a power of two: lr * grad is exact
constexpr float kInitScale = 65536.0f;    // the first loss scale
constexpr int kGrowthInterval = 2;        // clean steps before the scale doubles
constexpr long long kWorkCycles = 20000;  // the step's "model" (a spin kernel, about 11 us)
constexpr int kSlots = 4, kLag = 2;       // the readback ring: 4 slots, read 2 steps late

bool overflows(int step) {
  return step % 4 == 3;  // every fourth step's gradients overflow (steps 3, 7, 11, ...)
}

// The device scalars of a step.
struct Scalars {
  float loss;
  float scale;
  int found_inf;
  int good_steps;
  long long iteration;
};

// One slot of the readback ring (pinned, mapped host memory written by the device).
struct Slot {
  long long iteration;
  float loss, scale;
  int found_inf, pad;
};

// loss = 0.5 * sum(p^2) (one thread, in order, like the CPU reference); scaled gradients
// g = scale * p; on an overflow step g[0] = inf, as an fp16 overflow would leave it.
__global__ void forward_backward(const float* p, float* g, Scalars* s, const int* overflow) {
  const int i = threadIdx.x;
  g[i] = s->scale * p[i];
  if (i == 0) {
    if (overflow[s->iteration]) g[0] = INFINITY;
    float sum = 0;
    for (int k = 0; k < kN; ++k) sum += __fmul_rn(p[k], p[k]);  // no FMA: as the CPU sums
    s->loss = 0.5f * sum;
  }
}
// Unscales the gradients and sets found_inf when any is not finite.
__global__ void unscale_check(float* g, Scalars* s) {
  const int i = threadIdx.x;
  const float v = g[i] / s->scale;
  g[i] = v;
  const int any = __syncthreads_or(!isfinite(v));
  if (i == 0) s->found_inf = any;
}
// SGD. With `noop_flag` the kernel reads found_inf and does nothing on an overflow step; without
// it the host decides whether to launch it.
__global__ void sgd_update(float* p, const float* g, const Scalars* s, bool noop_flag) {
  if (noop_flag && s->found_inf) return;
  const int i = threadIdx.x;
  p[i] -= kLr * g[i];
}
// Copies the step's scalars into ring slot iteration % kSlots, tagged with the iteration.
__global__ void ring_copy(Slot* ring, const Scalars* s) {
  volatile Slot* slot = ring + s->iteration % kSlots;
  slot->loss = s->loss;
  slot->scale = s->scale;
  slot->found_inf = s->found_inf;
  slot->iteration = s->iteration;
  __threadfence_system();
}
// Dynamic loss scaling on the device: halve on overflow, double after kGrowthInterval clean steps;
// then the next iteration.
__global__ void scaler_update(Scalars* s) {
  if (s->found_inf) {
    s->scale *= 0.5f;
    s->good_steps = 0;
  } else if (++s->good_steps == kGrowthInterval) {
    s->scale *= 2.0f;
    s->good_steps = 0;
  }
  s->iteration += 1;
}

struct StepValues {
  float loss, scale;
  int found_inf;
};

// The CPU reference of kSteps steps.
std::vector<StepValues> reference() {
  std::vector<float> p(kN, 1.0f);
  float scale = kInitScale;
  int good = 0;
  std::vector<StepValues> out;
  for (int step = 0; step < kSteps; ++step) {
    float sum = 0;
    for (float v : p) sum += v * v;
    const bool inf = overflows(step);
    out.push_back({0.5f * sum, scale, inf ? 1 : 0});
    if (!inf)
      for (float& v : p) v -= kLr * ((scale * v) / scale);
    if (inf) {
      scale *= 0.5f;
      good = 0;
    } else if (++good == kGrowthInterval) {
      scale *= 2.0f;
      good = 0;
    }
  }
  return out;
}

// How many steps differ from the reference (loss to 1e-5 relative; scale and found-inf exactly).
int mismatches(const std::vector<StepValues>& got, const std::vector<StepValues>& want) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = i < got.size() &&
                    std::fabs(got[i].loss - want[i].loss) <= 1e-5f * std::fabs(want[i].loss) &&
                    got[i].scale == want[i].scale && got[i].found_inf == want[i].found_inf;
    bad += ok ? 0 : 1;
  }
  return bad;
}

struct State {
  float *p, *g;
  Scalars* s;
  int* overflow;
};

void initialize(const State& st, cudaStream_t stream) {
  std::vector<float> ones(kN, 1.0f);
  EX_CHECK(cudaMemcpy(st.p, ones.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  const Scalars s0{0.0f, kInitScale, 0, 0, 0};
  EX_CHECK(cudaMemcpy(st.s, &s0, sizeof(Scalars), cudaMemcpyHostToDevice));
  EX_CHECK(cudaStreamSynchronize(stream));
}

double since_us(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
}

// `.item()`: copy one device scalar to pinned memory and wait for it. The host-blocked time (in
// the synchronization) is added to *blocked_us.
template <typename T>
T item(const T* device, T* pinned, cudaStream_t stream, double* blocked_us) {
  EX_CHECK(cudaMemcpyAsync(pinned, device, sizeof(T), cudaMemcpyDeviceToHost, stream));
  const auto start = std::chrono::steady_clock::now();
  EX_CHECK(cudaStreamSynchronize(stream));
  *blocked_us += since_us(start);
  return *pinned;
}

// The work of a step common to both modes: the model, the gradients, unscale and check.
void enqueue_model(const State& st, cudaStream_t stream) {
  ex::spin_kernel<<<1, 1, 0, stream>>>(kWorkCycles);
  forward_backward<<<1, kN, 0, stream>>>(st.p, st.g, st.s, st.overflow);
  unscale_check<<<1, kN, 0, stream>>>(st.g, st.s);
}

}  // namespace

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C19");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  State st{ex::device_zeros<float>(kN), ex::device_zeros<float>(kN), ex::device_zeros<Scalars>(),
           ex::device_zeros<int>(kSteps)};
  std::vector<int> schedule(kSteps);
  for (int i = 0; i < kSteps; ++i) schedule[i] = overflows(i) ? 1 : 0;
  EX_CHECK(cudaMemcpy(st.overflow, schedule.data(), kSteps * sizeof(int), cudaMemcpyHostToDevice));
  const std::vector<StepValues> want = reference();
  std::vector<StepValues> got;

  if (args.broken()) {
    float* pinned_f;
    int* pinned_i;
    EX_CHECK(cudaMallocHost(&pinned_f, sizeof(float)));
    EX_CHECK(cudaMallocHost(&pinned_i, sizeof(int)));
    // 1. The step as written for eager mode cannot be captured: its first `.item()` waits.
    initialize(st, stream);
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    enqueue_model(st, stream);
    const cudaError_t copy_err = EX_TRY(
        cudaMemcpyAsync(pinned_i, &st.s->found_inf, sizeof(int), cudaMemcpyDeviceToHost, stream));
    const cudaError_t sync_err = EX_TRY(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    const cudaError_t end_err = EX_TRY(cudaStreamEndCapture(stream, &graph));
    if (graph != nullptr) EX_CHECK(cudaGraphDestroy(graph));
    const bool refused =
        ex::is_capture_error(sync_err) && end_err != cudaSuccess && graph == nullptr;

    // 2. Eagerly it runs, with three reads and three synchronizations a step.
    initialize(st, stream);
    double blocked_us = 0;
    int reads = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < kSteps; ++step) {
      enqueue_model(st, stream);
      const float loss = item(&st.s->loss, pinned_f, stream, &blocked_us);          // logging
      const int found_inf = item(&st.s->found_inf, pinned_i, stream, &blocked_us);  // skip?
      if (!found_inf) sgd_update<<<1, kN, 0, stream>>>(st.p, st.g, st.s, false);
      const float scale = item(&st.s->scale, pinned_f, stream, &blocked_us);  // logging
      scaler_update<<<1, 1, 0, stream>>>(st.s);
      EX_CHECK(cudaGetLastError());
      reads += 3;
      got.push_back({loss, scale, found_inf});
    }
    EX_CHECK(cudaStreamSynchronize(stream));
    const double wall_us = since_us(start);
    const int bad = mismatches(got, want);
    return ex::report(
        "C19", args, refused && bad == 0,
        "capture of the step with its .item() reads: cudaMemcpyAsync -> %s, cudaStreamSynchronize "
        "-> %s, cudaStreamEndCapture -> %s (no graph); eagerly %d steps, %d host reads, %.1f us a "
        "step, host blocked in the reads %.1f us a step (%.0f%% of the wall time); %d of %d steps' "
        "values differ from the CPU reference",
        ex::name(copy_err).c_str(), ex::name(sync_err).c_str(), ex::name(end_err).c_str(), kSteps,
        reads, wall_us / kSteps, blocked_us / kSteps, 100.0 * blocked_us / wall_us, bad, kSteps);
  }

  // Fixed: the whole step captured, no host read inside it.
  Slot* ring_host;
  Slot* ring_device;
  EX_CHECK(cudaHostAlloc(&ring_host, kSlots * sizeof(Slot), cudaHostAllocMapped));
  EX_CHECK(cudaHostGetDevicePointer(&ring_device, ring_host, 0));
  std::memset(ring_host, 0xff, kSlots * sizeof(Slot));
  initialize(st, stream);
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue_model(st, stream);
  sgd_update<<<1, kN, 0, stream>>>(st.p, st.g, st.s, true);  // the no-op flag
  ring_copy<<<1, 1, 0, stream>>>(ring_device, st.s);
  scaler_update<<<1, 1, 0, stream>>>(st.s);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  const size_t nodes = ex::node_count(graph);
  dump_dot(graph, "sync-free-step");
  EX_CHECK(cudaGraphDestroy(graph));
  std::vector<cudaEvent_t> done(kSlots);
  for (auto& e : done) e = ex::untimed_event();

  int tag_errors = 0;
  double blocked_us = 0;
  // Step s's values, read once its event (recorded after its launch) has completed.
  const auto read = [&](int s) {
    const auto t0 = std::chrono::steady_clock::now();
    EX_CHECK(cudaEventSynchronize(done[s % kSlots]));
    blocked_us += since_us(t0);
    const volatile Slot* slot = ring_host + s % kSlots;
    if (slot->iteration != s) ++tag_errors;
    got.push_back({slot->loss, slot->scale, slot->found_inf});
  };
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < kSteps; ++step) {
    EX_CHECK(cudaGraphLaunch(exec, stream));
    EX_CHECK(cudaEventRecord(done[step % kSlots], stream));
    if (step >= kLag) read(step - kLag);  // waits for an old step only
  }
  for (int s = kSteps - kLag; s < kSteps; ++s) read(s);
  const double wall_us = since_us(start);
  EX_CHECK(cudaGraphExecDestroy(exec));
  const int bad = mismatches(got, want);
  // Spot values a reader can check by hand: step 3 overflowed at scale 131072, which step 4 halved.
  return ex::report(
      "C19", args, bad == 0 && tag_errors == 0,
      "sync-free step captured (%zu nodes), %d steps, no host read inside a step, ring read %d "
      "steps late: %.1f us a step, host blocked %.1f us a step (waiting for old steps only); "
      "step 3 found_inf %d scale %.0f, step 4 scale %.0f; %d of %d steps' values differ from the "
      "CPU reference, %d slots held another iteration",
      nodes, kSteps, kLag, wall_us / kSteps, blocked_us / kSteps, got[3].found_inf, got[3].scale,
      got[4].scale, bad, kSteps, tag_errors);
}
