// rnnt-one-graph-probe: the RNN-T evaluation's one-graph crash in isolation (issue 29).
//
// replay-rnnt's evaluation in `full` mode captured the cuDNN LSTM encoder and the WHILE-node greedy
// decoder (graphs/conditional.h; its body a one-step cuDNN LSTM and kernels) into one graph, and on
// an H100 (CUDA 13.0, cuDNN 9.14) the process aborted during set-up with a glibc mutex assertion,
// while each captured alone ran. This probe builds the same pieces from the project's code
// (LstmPlan, Conditionals, Graph) at a small size and captures them in one graph in several
// variants, one variant per process (an abort takes the process with it; run.sh runs each one
// alone and records its exit status):
//
//   encoder                     the encoder LSTM stack alone (inference), captured
//   while-kernel                a WHILE node whose body is a counter kernel alone
//   while-lstm                  a WHILE node whose body is a one-step LSTM and the counter
//   encoder+while-kernel        the encoder, then the WHILE node with the kernel body
//   encoder+while-lstm          the encoder, then the WHILE node with the LSTM body: the
//                               evaluation's shape
//   while-lstm+encoder          the same two, the other way round
//   encoder+while-lstm:two-handles  the body's LSTM on a second cuDNN handle (a second Context)
//   encoder+while-lstm:kernel-between  a plain kernel between the encoder and the node
//   encoder+while-lstm:eager-first  the same work run eagerly first (the WHILE node as a one-shot
//                               graph), as StepPlan's warm-up does before it captures
//   encoder+if-lstm             an IF node with the LSTM body instead of the WHILE node
//   two-graphs                  encoder and WHILE node as two graphs (what runs today)
//   timing                      not a crash variant: the decoder's loop alone (host loop, unrolled
//                               x4, WHILE node) over --iters steps of the one-step LSTM at MLPerf's
//                               size (run_timing)
//
// Each variant then launches its graph twice and checks the result: the body ran --iters times
// each launch (a device counter), the LSTM outputs are finite, and the one-graph result equals
// eager calls bitwise. Output: one line per variant, "probe <variant>: OK ..." or "FAILED: ...".
//
//   rnnt-one-graph-probe --list
//   rnnt-one-graph-probe --case encoder+while-lstm [--capture-mode global|thread-local]
#include <CLI/CLI.hpp>
#include <cuda_fp16.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/context.h"
#include "graphs/conditional.h"
#include "graphs/graph.h"
#include "workloads/rnnt/lstm.h"

namespace replay::rnnt {
namespace {

__global__ void count_down_kernel(int32_t* remaining, int32_t* flag, int32_t* runs) {
  *remaining -= 1;
  *runs += 1;
  *flag = *remaining > 0 ? 1 : 0;
}

__global__ void reset_kernel(int32_t* remaining, int32_t* flag, int32_t iters) {
  *remaining = iters;
  *flag = iters > 0 ? 1 : 0;
}

__global__ void touch_kernel(int32_t* x) {
  *x += 0;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { REPLAY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// The evaluation in small: an encoder LSTM stack over [B, T, I] and a one-step prediction LSTM
// whose state carries from step to step inside the loop.
struct Pieces {
  const Context& ctx;
  const Context& body_ctx;  // the body's cuDNN handle (ctx unless two-handles)
  int64_t B, T, I = 240, H, Hp;
  LstmPlan enc, step;
  DevBuf x, y, enc_w, enc_len, ws;
  DevBuf sx, sy, sh, sc, shy, scy, step_w, step_len;
  DevBuf ints;  // remaining, flag, runs, touch
  size_t ws_bytes;

  static LstmDesc enc_desc(int64_t B, int64_t T, int64_t h, int64_t layers) {
    LstmDesc d;
    d.input_size = 240, d.hidden_size = h, d.layers = layers, d.batch = B, d.max_seq = T;
    d.dtype = DType::kFP16, d.layout = LstmLayout::kBatchMajor;
    return d;
  }
  static LstmDesc step_desc(int64_t B, int64_t hp) {
    LstmDesc d;
    d.input_size = hp, d.hidden_size = hp, d.layers = 2, d.batch = B, d.max_seq = 1;
    d.dtype = DType::kFP16, d.layout = LstmLayout::kBatchMajor;
    return d;
  }

  Pieces(const Context& c, const Context& bc, int64_t b, int64_t t, int64_t hp = 128,
         int64_t eh = 256, int64_t el = 2)
      : ctx(c),
        body_ctx(bc),
        B(b),
        T(t),
        H(eh),
        Hp(hp),
        enc(c, enc_desc(b, t, eh, el)),
        step(bc, step_desc(b, hp)),
        x(static_cast<size_t>(b * t * 240) * 2),
        y(static_cast<size_t>(b * t * eh) * 2),
        enc_w(enc.weight_bytes()),
        enc_len(static_cast<size_t>(b) * 4),
        ws(std::max(enc.workspace_bytes(), step.workspace_bytes())),
        sx(static_cast<size_t>(b * hp) * 2),
        sy(static_cast<size_t>(b * hp) * 2),
        sh(static_cast<size_t>(2 * b * hp) * 2),
        sc(static_cast<size_t>(2 * b * hp) * 2),
        shy(static_cast<size_t>(2 * b * hp) * 2),
        scy(static_cast<size_t>(2 * b * hp) * 2),
        step_w(step.weight_bytes()),
        step_len(static_cast<size_t>(b) * 4),
        ints(4 * sizeof(int32_t)),
        ws_bytes(std::max(enc.workspace_bytes(), step.workspace_bytes())) {
    cudaStream_t s = ctx.stream();
    lstm_init_weights(enc.weights(), enc_w.p, 11, 0, LstmInit{}, s);
    lstm_init_weights(step.weights(), step_w.p, 12, 0, LstmInit{}, s);
    std::vector<__half> hx(static_cast<size_t>(B * T * I));
    for (size_t i = 0; i < hx.size(); ++i)
      hx[i] = __float2half(std::sin(0.01f * static_cast<float>(i % 9973)));
    REPLAY_CUDA_CHECK(cudaMemcpy(x.p, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    std::vector<int32_t> lt(static_cast<size_t>(B), static_cast<int32_t>(T)),
        l1(static_cast<size_t>(B), 1);
    REPLAY_CUDA_CHECK(cudaMemcpy(enc_len.p, lt.data(), lt.size() * 4, cudaMemcpyHostToDevice));
    REPLAY_CUDA_CHECK(cudaMemcpy(step_len.p, l1.data(), l1.size() * 4, cudaMemcpyHostToDevice));
    enc.set_lengths(lt.data(), T);
    step.set_lengths(l1.data(), 1);
    REPLAY_CUDA_CHECK(cudaMemset(sx.p, 0, static_cast<size_t>(B * Hp) * 2));
    REPLAY_CUDA_CHECK(cudaMemset(y.p, 0, static_cast<size_t>(B * T * H) * 2));
    REPLAY_CUDA_CHECK(cudaMemset(sh.p, 0, static_cast<size_t>(2 * B * Hp) * 2));
    REPLAY_CUDA_CHECK(cudaMemset(ints.p, 0, 4 * sizeof(int32_t)));
    REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void encoder(cudaStream_t s) const {
    LstmForwardArgs a;
    a.lengths = enc_len.as<int32_t>(), a.x = x.p, a.weights = enc_w.p, a.y = y.p;
    enc.forward(ctx, s, LstmMode::kInference, a, ws.p, ws_bytes, nullptr, 0);
  }
  // The state starts at zero for every launch; the loop's test counts down from iters.
  void init_loop(cudaStream_t s, int32_t iters) const {
    // The input as well as the state: the body feeds each step's output back as the next input.
    REPLAY_CUDA_CHECK(cudaMemsetAsync(sx.p, 0, static_cast<size_t>(B * Hp) * 2, s));
    REPLAY_CUDA_CHECK(cudaMemsetAsync(sh.p, 0, static_cast<size_t>(2 * B * Hp) * 2, s));
    REPLAY_CUDA_CHECK(cudaMemsetAsync(sc.p, 0, static_cast<size_t>(2 * B * Hp) * 2, s));
    reset_kernel<<<1, 1, 0, s>>>(ints.as<int32_t>(), ints.as<int32_t>() + 1, iters);
    REPLAY_LAUNCH_CHECK();
  }
  // One loop step: the one-step LSTM (its output state copied back as the next input state, as
  // the decoder commits it), then the counter.
  void body(cudaStream_t s, bool with_lstm) const {
    if (with_lstm) {
      LstmForwardArgs a;
      a.lengths = step_len.as<int32_t>(), a.x = sx.p, a.hx = sh.p, a.cx = sc.p;
      a.weights = step_w.p, a.y = sy.p, a.hy = shy.p, a.cy = scy.p;
      step.forward(body_ctx, s, LstmMode::kInference, a, ws.p, ws_bytes, nullptr, 0);
      const size_t n = static_cast<size_t>(2 * B * Hp) * 2;
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(sh.p, shy.p, n, cudaMemcpyDeviceToDevice, s));
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(sc.p, scy.p, n, cudaMemcpyDeviceToDevice, s));
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(sx.p, sy.p, static_cast<size_t>(B * Hp) * 2,
                                        cudaMemcpyDeviceToDevice, s));
    }
    count_down_kernel<<<1, 1, 0, s>>>(ints.as<int32_t>(), ints.as<int32_t>() + 1,
                                      ints.as<int32_t>() + 2);
    REPLAY_LAUNCH_CHECK();
  }
  int32_t runs() const {
    int32_t v[4];
    REPLAY_CUDA_CHECK(cudaMemcpy(v, ints.p, sizeof(v), cudaMemcpyDeviceToHost));
    return v[2];
  }
  void zero_runs() const { REPLAY_CUDA_CHECK(cudaMemset(ints.as<int32_t>() + 2, 0, 4)); }
  std::vector<uint16_t> read(const DevBuf& b, size_t n) const {
    std::vector<uint16_t> h(n);
    REPLAY_CUDA_CHECK(cudaMemcpy(h.data(), b.p, n * 2, cudaMemcpyDeviceToHost));
    return h;
  }
  std::vector<uint16_t> outputs() const {
    std::vector<uint16_t> a = read(y, static_cast<size_t>(B * T * H));
    const std::vector<uint16_t> b = read(sh, static_cast<size_t>(2 * B * Hp));
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
};

bool all_finite(const std::vector<uint16_t>& v) {
  for (uint16_t b : v) {
    __half_raw r;
    r.x = b;
    if (!std::isfinite(__half2float(__half(r)))) return false;
  }
  return true;
}

struct Variant {
  std::string name;
  bool encoder = false, loop = false, lstm_body = false, loop_first = false;
  bool two_handles = false, kernel_between = false, eager_first = false, if_node = false;
  bool two_graphs = false;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  auto add = [&](const std::string& n) {
    Variant x;
    x.name = n;
    x.encoder = n.find("encoder") != std::string::npos || n == "two-graphs";
    x.loop = n.find("while") != std::string::npos || n.find("if-") != std::string::npos ||
             n == "two-graphs";
    x.lstm_body = n.find("-lstm") != std::string::npos || n == "two-graphs";
    x.loop_first = n.rfind("while", 0) == 0;
    x.two_handles = n.find(":two-handles") != std::string::npos;
    x.kernel_between = n.find(":kernel-between") != std::string::npos;
    x.eager_first = n.find(":eager-first") != std::string::npos;
    x.if_node = n.find("if-lstm") != std::string::npos;
    x.two_graphs = n == "two-graphs";
    v.push_back(x);
  };
  for (const char* n :
       {"encoder", "while-kernel", "while-lstm", "encoder+while-kernel", "encoder+while-lstm",
        "while-lstm+encoder", "encoder+while-lstm:two-handles", "encoder+while-lstm:kernel-between",
        "encoder+while-lstm:eager-first", "encoder+if-lstm", "two-graphs"})
    add(n);
  return v;
}

int run_variant(const Variant& v, graphs::CaptureMode mode, int64_t B, int64_t T, int32_t iters,
                int64_t enc_hidden, int64_t enc_layers) {
  using Clock = std::chrono::steady_clock;
  Context ctx;
  std::unique_ptr<Context> second;
  if (v.two_handles) second = std::make_unique<Context>();
  Pieces p(ctx, second ? *second : ctx, B, T, 128, enc_hidden, enc_layers);
  graphs::Conditionals cond;
  cudaStream_t s = ctx.stream();
  const int32_t loop_iters = v.if_node ? 1 : iters;

  auto loop = [&](cudaStream_t st) {
    p.init_loop(st, loop_iters);
    if (v.if_node)
      cond.if_equal(st, "probe.if", p.ints.as<int32_t>() + 1, 1,
                    [&](cudaStream_t b) { p.body(b, v.lstm_body); });
    else
      cond.while_nonzero(st, "probe.while", p.ints.as<int32_t>() + 1,
                         [&](cudaStream_t b) { p.body(b, v.lstm_body); });
  };
  auto work = [&](cudaStream_t st) {
    if (v.loop_first && v.loop) loop(st);
    if (v.encoder) p.encoder(st);
    if (v.kernel_between) {
      touch_kernel<<<1, 1, 0, st>>>(p.ints.as<int32_t>() + 3);
      REPLAY_LAUNCH_CHECK();
    }
    if (!v.loop_first && v.loop) loop(st);
  };

  // The eager reference (the loop as a one-shot graph, as in `none` mode).
  std::printf("probe %s: eager reference\n", v.name.c_str());
  std::fflush(stdout);
  p.zero_runs();
  work(s);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<uint16_t> want = p.outputs();
  const int32_t want_runs = p.runs();
  if (v.eager_first) {  // StepPlan's warm-up runs the regions eagerly once more before capture
    work(s);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  std::printf("probe %s: capture (%s)\n", v.name.c_str(), graphs::capture_mode_name(mode));
  std::fflush(stdout);
  graphs::CaptureStream cs;
  std::vector<graphs::Graph> graphs;
  const auto t0 = Clock::now();
  if (v.two_graphs) {
    graphs.emplace_back("probe.encoder");
    graphs.back().build(
        cs.get(), [&](cudaStream_t st) { p.encoder(st); }, s, mode);
    graphs.emplace_back("probe.loop");
    graphs.back().build(cs.get(), loop, s, mode);
  } else {
    graphs.emplace_back("probe." + v.name);
    graphs.back().capture(cs.get(), work, mode);
    std::printf("probe %s: instantiate\n", v.name.c_str());
    std::fflush(stdout);
    graphs.back().instantiate(s);
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  const double build_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::printf("probe %s: launch\n", v.name.c_str());
  std::fflush(stdout);
  p.zero_runs();
  for (int k = 0; k < 2; ++k)
    for (const graphs::Graph& g : graphs) g.launch(s);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<uint16_t> got = p.outputs();
  const int32_t runs = p.runs();
  const bool same = got == want;
  const bool finite = all_finite(got);
  const bool counted = !v.loop || runs == 2 * want_runs;
  const bool ran = !v.loop || want_runs == loop_iters;
  const bool ok = same && finite && counted && ran;
  std::printf(
      "probe %s: %s (capture mode %s, B %lld, T %lld, encoder %lld x %lld, loop runs %d eager and "
      "%d in 2 launches, "
      "outputs %s eager bitwise, %s; built in %.1f ms)\n",
      v.name.c_str(), ok ? "OK" : "FAILED", graphs::capture_mode_name(mode),
      static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(p.enc.desc().layers), static_cast<long long>(p.H), want_runs, runs,
      same ? "equal to" : "DIFFERENT from", finite ? "finite" : "NOT FINITE", build_ms);
  return ok ? 0 : 1;
}

// The decoder loop's cost per step, the loop on the host (a step, then a 4-byte read: the host
// decoder), unrolled 4x in a graph replayed while the host reads the flag one replay late
// (NVIDIA's), and as one WHILE node (one launch): the body is the one-step prediction LSTM at
// MLPerf's size (2 x 512, batch B) and the counter. No model around it: what the three loops cost
// by themselves.
int run_timing(int64_t B, int32_t iters) {
  using Clock = std::chrono::steady_clock;
  Context ctx;
  Pieces p(ctx, ctx, B, 2, 512);
  graphs::Conditionals cond;
  cudaStream_t s = ctx.stream();
  int32_t* flag_host = nullptr;
  REPLAY_CUDA_CHECK(cudaMallocHost(&flag_host, sizeof(int32_t)));
  auto ms_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto check_runs = [&](const char* what, int32_t want) {
    const int32_t got = p.runs();
    if (got != want) {
      std::printf("probe timing: %s ran %d steps, %d expected: FAILED\n", what, got, want);
      return false;
    }
    return true;
  };
  bool ok = true;
  double host_ms = 0, unrolled_ms = 0, while_ms = 0, while_kernel_ms = 0;
  for (int rep = 0; rep < 2; ++rep) {  // the first round warms up; the second is reported
    // Host loop.
    p.zero_runs();
    p.init_loop(s, iters);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    auto t0 = Clock::now();
    for (int32_t i = 0; i < iters + 1; ++i) {
      p.body(s, true);
      REPLAY_CUDA_CHECK(
          cudaMemcpyAsync(flag_host, p.ints.as<int32_t>() + 1, 4, cudaMemcpyDeviceToHost, s));
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
      if (*flag_host == 0) break;
    }
    host_ms = ms_since(t0);
    ok = check_runs("the host loop", iters) && ok;
    // Unrolled x4, the flag read one replay late.
    graphs::CaptureStream cs;
    graphs::Graph g4("probe.unrolled_x4");
    g4.build(
        cs.get(),
        [&](cudaStream_t st) {
          for (int k = 0; k < 4; ++k) p.body(st, true);
          REPLAY_CUDA_CHECK(
              cudaMemcpyAsync(flag_host, p.ints.as<int32_t>() + 1, 4, cudaMemcpyDeviceToHost, st));
        },
        s);
    cudaEvent_t ev[2];
    for (cudaEvent_t& e : ev)
      REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    p.zero_runs();
    p.init_loop(s, iters);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    t0 = Clock::now();
    for (int32_t i = 0; i < iters / 4 + 3; ++i) {
      g4.launch(s);
      REPLAY_CUDA_CHECK(cudaEventRecord(ev[i % 2], s));
      if (i == 0) continue;
      REPLAY_CUDA_CHECK(cudaEventSynchronize(ev[(i - 1) % 2]));
      if (*flag_host == 0) break;
    }
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    unrolled_ms = ms_since(t0);
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    // The counter keeps counting past zero in the unrolled replays (the decoder's steps after the
    // last utterance change nothing; this counter does): at least iters steps ran.
    if (p.runs() < iters) ok = check_runs("the unrolled graph", iters) && ok;
    // WHILE node: one launch.
    graphs::Graph gw("probe.while");
    gw.build(
        cs.get(),
        [&](cudaStream_t st) {
          p.init_loop(st, iters);
          cond.while_nonzero(st, "probe.while", p.ints.as<int32_t>() + 1,
                             [&](cudaStream_t b) { p.body(b, true); });
        },
        s);
    p.zero_runs();
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    t0 = Clock::now();
    gw.launch(s);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    while_ms = ms_since(t0);
    ok = check_runs("the WHILE node", iters) && ok;
    // The WHILE node's own cost: the same loop with the counter kernel alone in its body.
    graphs::Graph gk("probe.while_kernel");
    gk.build(
        cs.get(),
        [&](cudaStream_t st) {
          p.init_loop(st, iters);
          cond.while_nonzero(st, "probe.while_kernel", p.ints.as<int32_t>() + 1,
                             [&](cudaStream_t b) { p.body(b, false); });
        },
        s);
    p.zero_runs();
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    t0 = Clock::now();
    gk.launch(s);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
    while_kernel_ms = ms_since(t0);
    ok = check_runs("the WHILE node (kernel body)", iters) && ok;
  }
  cudaFreeHost(flag_host);
  std::printf(
      "probe timing: %d steps of the one-step prediction LSTM (2 x 512, batch %lld): host loop "
      "%.3f ms (%.1f us a step), unrolled x4 %.3f ms (%.1f us), WHILE node %.3f ms (%.1f us); "
      "WHILE / host %.2fx faster, / unrolled %.2fx; a WHILE node with the counter kernel alone "
      "%.1f us a step: %s\n",
      iters, static_cast<long long>(B), host_ms, 1e3 * host_ms / iters, unrolled_ms,
      1e3 * unrolled_ms / iters, while_ms, 1e3 * while_ms / iters, host_ms / while_ms,
      unrolled_ms / while_ms, 1e3 * while_kernel_ms / iters, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace replay::rnnt

int main(int argc, char** argv) {
  using namespace replay;
  CLI::App app{"rnnt-one-graph-probe: the RNN-T one-graph evaluation crash in isolation"};
  std::string which, mode_flag = "global";
  bool list = false;
  int64_t batch = 64, frames = 48;
  int32_t iters = 5;
  int64_t enc_hidden = 256, enc_layers = 2;
  app.add_option("--case", which, "the variant to run (--list names them)");
  app.add_option("--capture-mode", mode_flag, "global (StepPlan's) or thread-local")
      ->check(CLI::IsMember({"global", "thread-local"}));
  app.add_option("--batch", batch, "utterances")->check(CLI::Range(1, 4096));
  app.add_option("--frames", frames, "encoder frames")->check(CLI::Range(1, 4096));
  app.add_option("--iters", iters, "loop iterations a launch")->check(CLI::Range(1, 1000));
  app.add_option("--enc-hidden", enc_hidden, "the encoder's hidden size")
      ->check(CLI::Range(8, 4096));
  app.add_option("--enc-layers", enc_layers, "the encoder's layers")->check(CLI::Range(1, 8));
  app.add_flag("--list", list, "list the variants");
  CLI11_PARSE(app, argc, argv);
  const std::vector<rnnt::Variant> vs = rnnt::variants();
  if (list) {
    for (const rnnt::Variant& v : vs) std::printf("%s\n", v.name.c_str());
    std::printf("timing\n");
    return 0;
  }
  if (which == "timing") {
    try {
      return rnnt::run_timing(batch, iters);
    } catch (const std::exception& e) {
      std::printf("probe timing: FAILED: %s\n", e.what());
      return 1;
    }
  }
  for (const rnnt::Variant& v : vs) {
    if (v.name != which) continue;
    try {
      return rnnt::run_variant(
          v,
          mode_flag == "global" ? graphs::CaptureMode::kGlobal : graphs::CaptureMode::kThreadLocal,
          batch, frames, iters, enc_hidden, enc_layers);
    } catch (const std::exception& e) {
      std::printf("probe %s: FAILED: %s\n", v.name.c_str(), e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "rnnt-one-graph-probe: --case '%s' is not a variant (--list)\n",
               which.c_str());
  return 2;
}
