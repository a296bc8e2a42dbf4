// replay-comm-probe: the bus bandwidth of NCCL's all-reduce, reduce-scatter and all-gather between
// the GPUs of a launch, measured as nccl-tests measures it, through the project's Communicator
// (common/comm.h): one process per GPU under mpiexec or srun, MPI only to bootstrap.
//
//   mpiexec -n 2 replay-comm-probe [--sizes 8K:1G] [--collectives
//   all_reduce,reduce_scatter,all_gather]
//       [--dtypes bf16,fp32] [--warmup 5] [--iters 20] [--graph] [--in-place] [--json FILE]
//
// Each point (collective, type, size): a correctness pass (every rank's send buffer holds a known
// pattern and a kernel counts the received elements that differ from the exact result), --warmup
// eager calls, then --iters calls between one pair of events (the time a call: their time / iters);
// with --graph the same --iters calls are also captured in one CUDA graph (after the capture check
// of common/comm.h) and replayed between events. The time reported is the slowest rank's; the
// bandwidths follow from it (probe.h): algorithm bandwidth bytes / time, bus bandwidth that times
// 2(n-1)/n for an all-reduce and (n-1)/n for a reduce-scatter or an all-gather. Out of place, the
// result of the last timed call is checked again. Exit status 1 when any element was wrong.
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/bench/harness.h"
#include "common/check.h"
#include "common/comm.h"
#include "common/context.h"
#include "common/version.h"
#include "workloads/comm/collectives.h"
#include "workloads/comm/probe.h"

extern char** environ;

namespace replay {
namespace {

using nlohmann::ordered_json;
using probe::DType;

struct Options {
  std::vector<uint64_t> sizes;
  std::vector<comm::Kind> kinds;
  std::vector<DType> dtypes;
  int warmup = 5, iters = 20;
  bool graph = false, in_place = false, check = true;
  double comm_timeout_s = 120;
  std::string json_path;
};

// One measured series: the time a call on this rank, in microseconds.
struct Series {
  double time_us = 0;
};

// The NCCL_* variables of this process's environment (the settings a bandwidth depends on).
ordered_json nccl_environment() {
  ordered_json out = ordered_json::object();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("NCCL_", 0) != 0) continue;
    const size_t eq = kv.find('=');
    out[kv.substr(0, eq)] = eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  return out;
}

class Probe {
 public:
  Probe(const comm::World& w, const Options& o, Context& ctx, comm::Communicator& c,
        comm::CollectiveLog& log, void* send, void* recv, unsigned long long* counter)
      : w_(w),
        o_(o),
        ctx_(ctx),
        comm_(c),
        log_(log),
        watchdog_(w, {&c}, &log, o.comm_timeout_s),
        send_(send),
        recv_(recv),
        counter_(counter) {
    REPLAY_CUDA_CHECK(cudaEventCreate(&start_));
    REPLAY_CUDA_CHECK(cudaEventCreate(&end_));
  }
  ~Probe() {
    cudaEventDestroy(start_);
    cudaEventDestroy(end_);
  }

  // Waits for everything enqueued on the stream so far, under the watchdog.
  void drain(const char* what) {
    REPLAY_CUDA_CHECK(cudaEventRecord(end_, ctx_.stream()));
    watchdog_.wait(what, [&] { return ready(end_); });
  }

  // The elements of the call's result that are wrong on this rank (0 when --no-check).
  uint64_t check(comm::Kind k, const probe::CallBuffers& b, uint64_t count, DType t,
                 bool refill_and_call) {
    cudaStream_t s = ctx_.stream();
    probe::clear_counter(counter_, s);
    if (refill_and_call) {
      probe::fill_pattern(b, k, count, t, comm_.rank(), comm_.size(), s);
      probe::enqueue(comm_, k, b, count, t, s);
    }
    probe::count_mismatches(b, k, count, t, comm_.rank(), comm_.size(), counter_, s);
    drain("the correctness pass");
    unsigned long long host[2] = {0, 0};
    REPLAY_CUDA_CHECK(cudaMemcpy(host, counter_, sizeof(host), cudaMemcpyDeviceToHost));
    if (host[0] != 0 && first_wrong_ < 0) first_wrong_ = static_cast<int64_t>(host[1]);
    return host[0];
  }

  Series eager(comm::Kind k, const probe::CallBuffers& b, uint64_t count, DType t) {
    cudaStream_t s = ctx_.stream();
    for (int i = 0; i < o_.warmup; ++i) probe::enqueue(comm_, k, b, count, t, s);
    drain("the warm-up calls");
    comm::barrier(w_);
    REPLAY_CUDA_CHECK(cudaEventRecord(start_, s));
    for (int i = 0; i < o_.iters; ++i) probe::enqueue(comm_, k, b, count, t, s);
    return timed("the timed eager calls");
  }

  Series graphed(comm::Kind k, const probe::CallBuffers& b, uint64_t count, DType t) {
    cudaStream_t s = ctx_.stream();
    // The communicator ran this collective eagerly first (eager()): the first call of a
    // communicator inside a capture fails. Thread-local capture: NCCL's own threads may call CUDA.
    cudaGraph_t graph = nullptr;
    REPLAY_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < o_.iters; ++i) probe::enqueue(comm_, k, b, count, t, s);
    REPLAY_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec = nullptr;
    REPLAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    REPLAY_CUDA_CHECK(cudaGraphDestroy(graph));
    comm::check_same_collectives(w_, log_);  // a mismatch fails on every rank instead of hanging
    log_.clear_captured();
    REPLAY_CUDA_CHECK(cudaGraphUpload(exec, s));
    REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s));  // one untimed replay
    drain("the warm-up replay");
    comm::barrier(w_);
    REPLAY_CUDA_CHECK(cudaEventRecord(start_, s));
    REPLAY_CUDA_CHECK(cudaGraphLaunch(exec, s));
    const Series out = timed("the timed graph replay");
    REPLAY_CUDA_CHECK(cudaGraphExecDestroy(exec));
    return out;
  }

  int64_t first_wrong() const { return first_wrong_; }

 private:
  static bool ready(cudaEvent_t e) {
    const cudaError_t r = cudaEventQuery(e);
    if (r == cudaErrorNotReady) return false;
    REPLAY_CUDA_CHECK(r);
    return true;
  }

  Series timed(const char* what) {
    REPLAY_CUDA_CHECK(cudaEventRecord(end_, ctx_.stream()));
    watchdog_.wait(what, [&] { return ready(end_); });
    float ms = 0;
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, end_));
    return {1e3 * static_cast<double>(ms) / o_.iters};
  }

  const comm::World& w_;
  const Options& o_;
  Context& ctx_;
  comm::Communicator& comm_;
  comm::CollectiveLog& log_;
  comm::Watchdog watchdog_;
  void* send_;
  void* recv_;
  unsigned long long* counter_;
  cudaEvent_t start_ = nullptr, end_ = nullptr;
  int64_t first_wrong_ = -1;
};

// --json's folder exists and the path is not a folder, before any work.
void check_output(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw bench::UsageError("--json " + path + ": folder " + dir.string() + " does not exist");
  if (fs::is_directory(p, ec))
    throw bench::UsageError("--json " + path + ": is a folder, not a file");
}

bool g_finished = false;  // run() reached its end on this rank (every rank agrees on the status)

int run(const comm::World& w, int argc, char** argv) {
  CLI::App app{
      "replay-comm-probe: NCCL all-reduce, reduce-scatter and all-gather bandwidth between the "
      "GPUs "
      "of an mpiexec or srun launch (one process per GPU), measured as nccl-tests measures it"};
  std::string sizes_text = "8K:1G", kinds_text = "all_reduce,reduce_scatter,all_gather",
              dtypes_text = "bf16,fp32";
  Options o;
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  app.add_option(
         "--sizes", sizes_text,
         "message sizes as nccl-tests counts them (the buffer reduced; the whole buffer "
         "gathered or scattered): a comma list of sizes in bytes with an optional K, M or G "
         "(binary), and ranges A:B (doubling) or A:B:F (factor F)")
      ->capture_default_str();
  app.add_option("--collectives", kinds_text, "which collectives, a comma list")
      ->capture_default_str();
  app.add_option("--dtypes", dtypes_text, "element types, a comma list (bf16, fp32)")
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed eager calls before each timed series")
      ->check(CLI::Range(1, kMaxInt))
      ->capture_default_str();
  app.add_option("--iters", o.iters, "calls in each timed series (the time a call is their mean)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_flag("--graph", o.graph,
               "also capture each series' --iters calls in one CUDA graph and time its replay");
  app.add_flag("--in-place", o.in_place,
               "run the collectives in place, as replay's step does (default: out of place, as "
               "nccl-tests)");
  bool no_check = false;
  app.add_flag("--no-check", no_check, "skip the correctness passes");
  app.add_option("--comm-timeout-s", o.comm_timeout_s,
                 "give up waiting for a collective after this long, naming the rank")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write the results here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  o.check = !no_check;
  o.sizes = probe::parse_sizes(sizes_text);
  o.kinds = probe::parse_collectives(kinds_text);
  o.dtypes = probe::parse_dtypes(dtypes_text);
  if (!o.json_path.empty()) check_output(o.json_path);

  if (w.size < 2)
    throw bench::UsageError(
        "needs 2 or more ranks, one process per GPU: launch it as `mpiexec -n 2 replay-comm-probe "
        "...` or with srun (this is a world of 1)");
  const int gpus = Context::device_count();
  if (gpus < w.local_size)
    throw bench::UsageError(std::to_string(w.local_size) + " ranks on host " + w.host + " but " +
                            std::to_string(gpus) +
                            " GPU(s) visible: launch one process per GPU (mpiexec -n <GPUs>)");

  Context ctx(w.local_rank);
  const EnvironmentReport env = ctx.environment();
  const uint64_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  ArenaPlan plan;
  const BufferId send_id = plan.add("probe.send", static_cast<size_t>(max_bytes), "probe");
  const BufferId recv_id = plan.add("probe.recv", static_cast<size_t>(max_bytes), "probe");
  const BufferId counter_id = plan.add("probe.mismatches", 2 * sizeof(unsigned long long), "probe");
  Arena& arena = ctx.create_arena(std::move(plan));

  comm::CollectiveLog log;
  comm::Communicator communicator(w, "probe", 0, &log);
  Probe p(w, o, ctx, communicator, log, arena.data(send_id), arena.data(recv_id),
          arena.as<unsigned long long>(counter_id));
  const bool one_host = w.local_size == w.size;

  const bool lead = w.rank == 0;
  if (lead) {
    std::printf("# replay-comm-probe %s\n%s", version(), env.to_text().c_str());
    std::printf("# ranks: %d (%s), %d per host; %s; warm-up %d, %d calls a series%s; %s\n", w.size,
                one_host ? "one host" : "several hosts", w.local_size,
                o.in_place ? "in place" : "out of place", o.warmup, o.iters,
                o.graph ? ", eager and one graph of them" : ", eager",
                o.check ? "every result checked" : "results not checked");
    std::printf(
        "# time: the slowest rank's, a call; busbw = algbw x 2(n-1)/n (all-reduce), "
        "x (n-1)/n (reduce-scatter, all-gather)\n");
    std::printf("%-15s %-5s %-6s %10s %12s %11s %11s %11s %11s %7s\n", "collective", "type", "mode",
                "size", "bytes", "count", "time_us", "algbw_GB/s", "busbw_GB/s", "wrong");
    std::fflush(stdout);
  }

  ordered_json results = ordered_json::array();
  uint64_t total_wrong = 0;
  for (DType t : o.dtypes) {
    for (comm::Kind k : o.kinds) {
      for (uint64_t size : o.sizes) {
        const probe::Message m = probe::message(k, size, t, w.size);
        if (m.count == 0) {
          if (lead)
            std::printf("%-15s %-5s %-6s %10s  (smaller than one element a rank: skipped)\n",
                        comm::kind_name(k), probe::dtype_name(t), "-",
                        probe::format_size(size).c_str());
          continue;
        }
        const probe::CallBuffers b =
            probe::call_buffers(k, arena.data(send_id), arena.data(recv_id), m.count, t,
                                communicator.rank(), o.in_place);
        const uint64_t wrong_before = o.check ? p.check(k, b, m.count, t, true) : 0;
        std::vector<std::pair<std::string, probe::CallBuffers>> modes = {{"eager", b}};
        if (o.graph) modes.push_back({"graph", b});
        for (const auto& [mode, buffers] : modes) {
          const Series s =
              mode == "eager" ? p.eager(k, buffers, m.count, t) : p.graphed(k, buffers, m.count, t);
          // In place, every call changes its own input; out of place, the last call's result
          // must still be exact.
          const uint64_t wrong_after =
              o.check && !o.in_place ? p.check(k, buffers, m.count, t, false) : 0;
          const uint64_t wrong_here = (mode == "eager" ? wrong_before : 0) + wrong_after;
          const std::vector<double> times = comm::all_gather_doubles(w, s.time_us);
          const std::vector<double> wrongs =
              comm::all_gather_doubles(w, static_cast<double>(wrong_here));
          const double slowest = *std::max_element(times.begin(), times.end());
          double wrong = 0;
          for (double v : wrongs) wrong += v;
          total_wrong += static_cast<uint64_t>(wrong);
          const double algbw = probe::algbw_gbps(m.bytes, slowest);
          const double busbw = probe::busbw_gbps(k, w.size, m.bytes, slowest);
          if (!lead) continue;
          std::printf("%-15s %-5s %-6s %10s %12llu %11llu %11.2f %11.2f %11.2f %7s\n",
                      comm::kind_name(k), probe::dtype_name(t), mode.c_str(),
                      probe::format_size(size).c_str(), static_cast<unsigned long long>(m.bytes),
                      static_cast<unsigned long long>(m.count), slowest, algbw, busbw,
                      o.check ? std::to_string(static_cast<uint64_t>(wrong)).c_str() : "-");
          std::fflush(stdout);
          ordered_json r;
          r["collective"] = comm::kind_name(k);
          r["dtype"] = probe::dtype_name(t);
          r["mode"] = mode;
          r["size"] = size;
          r["bytes"] = m.bytes;
          r["count"] = m.count;
          r["time_us"] = slowest;
          r["rank_time_us"] = times;
          r["algbw_gbps"] = algbw;
          r["busbw_gbps"] = busbw;
          r["bus_factor"] = probe::bus_factor(k, w.size);
          r["wrong_elements"] = o.check ? ordered_json(static_cast<uint64_t>(wrong)) : nullptr;
          results.push_back(std::move(r));
        }
      }
    }
  }

  if (lead && !o.json_path.empty()) {
    ordered_json out;
    out["tool"] = "replay-comm-probe";
    out["version"] = version();
    out["environment"] = bench::to_json(env);
    out["world"] = {{"size", w.size}, {"local_size", w.local_size}, {"one_host", one_host}};
    out["protocol"] = {
        {"warmup", o.warmup},
        {"iters", o.iters},
        {"in_place", o.in_place},
        {"check", o.check},
        {"graph", o.graph},
        {"timer",
         "cuda events around --iters calls (eager) or one replay of a graph of them; time_us is "
         "their time / iters on the slowest rank"},
        {"size", "nccl-tests' size: the buffer reduced, or the whole buffer gathered or scattered"},
        {"busbw", "algbw x 2(n-1)/n for all_reduce, x (n-1)/n for reduce_scatter and all_gather"},
        {"nccl_env", nccl_environment()}};
    out["results"] = results;
    bench::write_json(o.json_path, out);
    std::printf("# wrote %s\n", o.json_path.c_str());
  }
  if (lead && o.check)
    std::printf(total_wrong == 0 ? "# every result was exact\n"
                                 : "# WRONG RESULTS: %llu element(s) differed from the exact sums "
                                   "(first on this rank at element %lld)\n",
                static_cast<unsigned long long>(total_wrong),
                static_cast<long long>(p.first_wrong()));
  g_finished = true;
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace replay

int main(int argc, char** argv) {
  const replay::comm::World& w = replay::comm::init_world(&argc, &argv);
  const int rc =
      replay::bench::run_main("replay-comm-probe", [&] { return replay::run(w, argc, argv); });
  // An error on some ranks only (a CUDA or NCCL failure) would leave the others waiting in a
  // collective: end the job. Flag errors happen alike on every rank, before any collective.
  if (rc == 1 && !replay::g_finished && w.size > 1) replay::comm::abort_world(rc);
  replay::comm::finalize_world();
  return rc;
}
