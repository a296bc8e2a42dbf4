// harness.cpp: shared flags, the timed step loop, reports and main()'s error handling.
#include "common/bench/harness.h"

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "common/check.h"

namespace replay::bench {

// ---- main() -----------------------------------------------------------------------------------

int run_main(const char* tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 1;
  }
}

// ---- Seeds -------------------------------------------------------------------------------------

uint64_t seed_from_clock() {
  uint64_t z = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) +
               0x9e3779b97f4a7c15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z != 0 ? z : 1;
}

double decimal(float v) {
  if (!std::isfinite(v)) return static_cast<double>(v);
  char text[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, static_cast<double>(v));
    if (std::strtof(text, nullptr) == v) return std::strtod(text, nullptr);
  }
  return static_cast<double>(v);
}

// ---- Step loop --------------------------------------------------------------------------------

namespace {

// Timing events created before the loop and destroyed after it.
class EventList {
 public:
  explicit EventList(size_t n) : events_(n, nullptr) {
    for (cudaEvent_t& e : events_) REPLAY_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~EventList() {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
  }
  EventList(const EventList&) = delete;
  EventList& operator=(const EventList&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

double elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  REPLAY_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

}  // namespace

LoopResult run_steps(cudaStream_t stream, const LoopConfig& c, const LoopCallbacks& cb,
                     std::FILE* out) {
  REPLAY_REQUIRE(c.steps >= 1, "the step loop needs at least one step");
  REPLAY_REQUIRE(c.readback_lag >= 1 && c.log_interval >= 1,
                 "readback lag and log interval must be positive");
  REPLAY_REQUIRE(c.untimed_steps >= 0 && c.untimed_steps < c.steps,
                 "at least one step must be timed");
  REPLAY_REQUIRE(cb.enqueue && cb.read, "the step loop needs enqueue and read callbacks");
  const auto steps = static_cast<size_t>(c.steps);
  // Step k takes from its start event to the next step's, so a host that keeps the GPU waiting
  // between steps counts; where work ran after the step (an evaluation), to its own end event.
  EventList start(steps), end(steps);
  std::vector<char> worked_after(steps, 0);
  auto step_ms = [&](size_t k) {
    return k + 1 < steps && !worked_after[k] ? elapsed_ms(start[k], start[k + 1])
                                             : elapsed_ms(start[k], end[k]);
  };
  LoopResult r;
  r.losses.assign(steps, NAN);
  std::vector<double> host_us(steps);

  int64_t last = c.steps;  // the step count the loop ends at (fewer when after_step stops it)
  int64_t next_read = 0;   // steps [0, next_read) have been read back
  int64_t line_start = 0;  // first step of the current progress window
  auto read_until = [&](int64_t stop) {
    for (; next_read < stop; ++next_read) {
      const int64_t s = next_read;
      const StepSample sample = cb.read(s);
      r.losses[static_cast<size_t>(s)] = static_cast<float>(sample.loss);
      if ((s + 1) % c.log_interval != 0 && s + 1 != last) continue;
      // Step s was read, so the events after it (recorded right after it) are done or about to be.
      const size_t last = static_cast<size_t>(s);
      REPLAY_CUDA_CHECK(cudaEventSynchronize(
          last + 1 < steps && !worked_after[last] ? start[last + 1] : end[last]));
      double total = 0;
      for (int64_t k = line_start; k <= s; ++k) total += step_ms(static_cast<size_t>(k));
      const double ms = total / static_cast<double>(s + 1 - line_start);
      line_start = s + 1;
      const double units_per_s = c.units_per_step / (ms * 1e-3);
      const double tflops = c.flops_per_step / (ms * 1e-3) / 1e12;
      std::fprintf(out,
                   "step %6" PRId64 "/%" PRId64
                   "  loss %8.4f  lr %.3e  gnorm %8.4f  %9.3f ms  %11.0f %s/s  %7.1f TFLOP/s",
                   c.first_step + s + 1, c.first_step + c.steps, sample.loss, sample.lr,
                   sample.grad_norm, ms, units_per_s, c.unit_short.c_str(), tflops);
      if (c.peak_tflops > 0) std::fprintf(out, "  MFU %5.1f%%", 100.0 * tflops / c.peak_tflops);
      if (std::isfinite(sample.loss_scale)) std::fprintf(out, "  scale %g", sample.loss_scale);
      std::fprintf(out, "\n");
      std::fflush(out);
      if (cb.on_progress) cb.on_progress(s, units_per_s, sample);
    }
  };

  char range[32];
  REPLAY_CUDA_CHECK(cudaEventRecord(start[0], stream));
  size_t run = steps;  // steps executed
  for (size_t k = 0; k < steps; ++k) {
    std::snprintf(range, sizeof(range), "step %zu", k);
    nvtxRangePushA(range);
    const auto t0 = std::chrono::steady_clock::now();
    cb.enqueue(static_cast<int64_t>(k));
    const auto t1 = std::chrono::steady_clock::now();
    nvtxRangePop();
    REPLAY_CUDA_CHECK(cudaEventRecord(end[k], stream));
    host_us[k] = std::chrono::duration<double, std::micro>(t1 - t0).count();
    const LoopCallbacks::After after =
        cb.after_step ? cb.after_step(static_cast<int64_t>(k)) : LoopCallbacks::After::kNothing;
    worked_after[k] = after != LoopCallbacks::After::kNothing ? 1 : 0;
    if (after == LoopCallbacks::After::kStop) {
      run = k + 1;
      last = static_cast<int64_t>(run);
      break;
    }
    read_until(static_cast<int64_t>(k) + 1 - c.readback_lag);
    if (k + 1 < steps) REPLAY_CUDA_CHECK(cudaEventRecord(start[k + 1], stream));
  }
  read_until(static_cast<int64_t>(run));
  REPLAY_CUDA_CHECK(cudaEventSynchronize(end[run - 1]));
  r.steps_run = static_cast<int64_t>(run);
  r.losses.resize(run);

  for (size_t k = std::min(static_cast<size_t>(c.untimed_steps), run - 1); k < run; ++k) {
    r.step_ms.push_back(step_ms(k));
    r.host_enqueue_us.push_back(host_us[k]);
  }
  r.step_stats = summarize(r.step_ms);
  r.host_stats = summarize(r.host_enqueue_us);
  return r;
}

// ---- Hashes and memory ------------------------------------------------------------------------

std::string loss_hash(const std::vector<float>& losses) {
  Hasher h;
  h.update(losses.data(), losses.size() * sizeof(float));
  return h.hex();
}

std::string device_hash(const void* device, size_t bytes) {
  constexpr size_t kPiece = size_t{64} << 20;
  std::vector<unsigned char> host(std::min(bytes, kPiece));
  Hasher h;
  for (size_t off = 0; off < bytes; off += kPiece) {
    const size_t n = std::min(kPiece, bytes - off);
    REPLAY_CUDA_CHECK(
        cudaMemcpy(host.data(), static_cast<const char*>(device) + off, n, cudaMemcpyDeviceToHost));
    h.update(host.data(), n);
  }
  return h.hex();
}

size_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  REPLAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

// ---- Reports ----------------------------------------------------------------------------------

double WorkloadReport::units_per_s() const {
  return step_ms.median > 0 ? units_per_step / (step_ms.median * 1e-3) : 0.0;
}

double WorkloadReport::model_tflops() const {
  return step_ms.median > 0 ? flops_per_step / (step_ms.median * 1e-3) / 1e12 : 0.0;
}

nlohmann::ordered_json to_json(const EnvironmentReport& environment) {
  nlohmann::ordered_json env = nlohmann::ordered_json::object();
  for (const auto& [k, v] : environment.fields) env[k] = v;
  return env;
}

nlohmann::ordered_json to_json(const WorkloadReport& r) {
  using nlohmann::ordered_json;
  const ordered_json env = to_json(r.environment);
  const double median_s = r.step_ms.median * 1e-3;
  auto or_null = [](bool known, double v) {
    return known ? ordered_json(v) : ordered_json(nullptr);
  };
  ordered_json losses = ordered_json::array();
  for (float l : r.losses)
    losses.push_back(std::isfinite(l) ? ordered_json(l) : ordered_json(nullptr));
  ordered_json j;
  j["tool"] = r.tool;
  j["version"] = r.version;
  j["workload"] = r.workload;
  j["preset"] = r.preset;
  j["graphs"] = r.graphs;
  j["environment"] = env;
  j["config"] = r.config;
  j["tensor_parallel_collectives"] = r.tensor_parallel_collectives;
  j["step_ms"] = {{"median", r.step_ms.median},
                  {"p10", r.step_ms.p10},
                  {"p90", r.step_ms.p90},
                  {"mean", r.step_ms.mean},
                  {"count", r.step_ms.count}};
  j["host_enqueue_us"] = {{"median", r.host_enqueue_us.median}, {"p90", r.host_enqueue_us.p90}};
  j["throughput"] = {{r.unit + "_per_s", r.units_per_s()},
                     {"samples_per_s", median_s > 0 ? r.samples_per_step / median_s : 0.0}};
  j["model_tflops"] = r.model_tflops();
  j["flops_per_step"] = r.flops_per_step;
  j["flops_formula"] = r.flops_formula;
  j["mfu"] = or_null(r.peak_tflops > 0, r.peak_tflops > 0 ? r.model_tflops() / r.peak_tflops : 0.0);
  j["peaks"] = {{"bf16_gemm_tflops", or_null(r.peak_tflops > 0, r.peak_tflops)}};
  j["memory"] = {{"peak_bytes", r.peak_bytes},
                 {"arena_bytes", r.arena_bytes},
                 {"graph_extra_bytes", r.peak_bytes - r.arena_bytes}};
  j["graphs_info"] = {{"count", r.graph_count},
                      {"nodes", r.graph_nodes},
                      {"capture_ms", r.capture_ms},
                      {"instantiate_ms", r.instantiate_ms}};
  j["losses"] = losses;
  j["loss_hash"] = loss_hash(r.losses);
  j["weights_hash"] = r.weights_hash ? ordered_json(*r.weights_hash) : ordered_json(nullptr);
  j["loss_floor"] = r.loss_floor && std::isfinite(*r.loss_floor) ? ordered_json(*r.loss_floor)
                                                                 : ordered_json(nullptr);
  auto or_null_opt = [](const auto& v) { return v ? ordered_json(*v) : ordered_json(nullptr); };
  if (r.eval_metric.empty()) {
    j["evaluation"] = nullptr;
  } else {
    ordered_json results = ordered_json::array();
    for (const EvalResult& e : r.evals)
      results.push_back(
          {{"step", e.step},
           {"samples", e.samples},
           {"value", std::isfinite(e.value) ? ordered_json(e.value) : ordered_json(nullptr)},
           {"seconds", e.seconds}});
    j["evaluation"] = {{"metric", r.eval_metric}, {"results", results}};
  }
  j["target_quality"] = or_null_opt(r.target_quality);
  j["steps_to_target"] = or_null_opt(r.steps_to_target);
  j["time_to_train_s"] = or_null_opt(r.time_to_train_s);
  j["resumed_from"] = r.resumed_from.empty()
                          ? ordered_json(nullptr)
                          : ordered_json{{"path", r.resumed_from}, {"step", r.first_step}};
  ordered_json saved = ordered_json::array();
  for (const CheckpointRecord& c : r.checkpoints)
    saved.push_back(
        {{"step", c.step}, {"path", c.path}, {"bytes", c.bytes}, {"seconds", c.seconds}});
  j["checkpoints"] = saved;
  size_t slowest = 0;
  for (size_t i = 1; i < r.rank_step_ms.size(); ++i)
    if (r.rank_step_ms[i] > r.rank_step_ms[slowest]) slowest = i;
  j["parallel"] = {
      {"world_size", r.world_size},
      {"tensor_parallel", r.tensor_parallel},
      {"data_parallel", r.data_parallel},
      {"grad_buckets", r.grad_buckets},
      {"rank_step_ms", r.rank_step_ms},
      {"slowest_rank", r.rank_step_ms.empty() ? ordered_json(nullptr) : ordered_json(slowest)},
      {"collectives_per_step",
       r.collectives_per_step < 0 ? ordered_json(nullptr) : ordered_json(r.collectives_per_step)},
      {"comm_bytes_per_step",
       r.comm_bytes_per_step < 0 ? ordered_json(nullptr) : ordered_json(r.comm_bytes_per_step)}};
  ordered_json collectives = ordered_json::array();
  for (const WorkloadReport::CollectiveStat& c : r.collectives)
    collectives.push_back({{"comm", c.comm},
                           {"collective", c.collective},
                           {"dtype", c.dtype},
                           {"bytes", c.bytes},
                           {"calls_per_step", c.calls_per_step},
                           {"median_us", c.median_us},
                           {"busbw_gbps", c.busbw_gbps},
                           {"overlapped", c.overlapped}});
  j["parallel"]["collectives"] = collectives;
  return j;
}

void write_json(const std::string& path, const nlohmann::ordered_json& doc) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << doc.dump(2) << "\n";
    f.close();
    if (!f) {
      std::remove(tmp.c_str());
      throw Error("replay", "cannot write", "cannot write the JSON summary '" + path + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("replay", "cannot write", "cannot rename '" + tmp + "' to '" + path + "'");
  }
}

namespace {
std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB",
                static_cast<double>(bytes) / double(int64_t{1} << 30));
  return buf;
}
}  // namespace

std::string summary(const WorkloadReport& r) {
  std::ostringstream os;
  char line[256];
  auto add = [&](const char* fmt, auto... args) {
    std::snprintf(line, sizeof(line), fmt, args...);
    os << line;
  };
  add("# ---- %s %s, graphs %s ----\n", r.tool.c_str(), r.preset.c_str(), r.graphs.c_str());
  add("%-22s median %.3f ms  p10 %.3f  p90 %.3f  mean %.3f  (%d steps)\n", "step time",
      r.step_ms.median, r.step_ms.p10, r.step_ms.p90, r.step_ms.mean, r.step_ms.count);
  add("%-22s median %.1f us  p90 %.1f us\n", "host enqueue per step", r.host_enqueue_us.median,
      r.host_enqueue_us.p90);
  add("%-22s %.0f %s/s  %.3f samples/s\n", "throughput", r.units_per_s(), r.unit.c_str(),
      r.step_ms.median > 0 ? r.samples_per_step / (r.step_ms.median * 1e-3) : 0.0);
  if (r.peak_tflops > 0)
    add("%-22s %.1f TFLOP/s  MFU %.1f%% of %.1f TFLOP/s measured bf16 GEMM peak\n", "model FLOPs",
        r.model_tflops(), 100.0 * r.model_tflops() / r.peak_tflops, r.peak_tflops);
  else
    add("%-22s %.1f TFLOP/s\n", "model FLOPs", r.model_tflops());
  add("%-22s peak %s  arena %s  beyond the arena %+.1f MiB\n", "device memory",
      gib(r.peak_bytes).c_str(), gib(r.arena_bytes).c_str(),
      static_cast<double>(r.peak_bytes - r.arena_bytes) / double(1 << 20));
  add("%-22s %d graphs  %" PRId64 " nodes  capture %.1f ms  instantiate %.1f ms\n", "graphs",
      r.graph_count, r.graph_nodes, r.capture_ms, r.instantiate_ms);
  if (!r.losses.empty())
    add("%-22s first %.4f  last %.4f  floor %s  hash %s\n", "loss",
        static_cast<double>(r.losses.front()), static_cast<double>(r.losses.back()),
        r.loss_floor && std::isfinite(*r.loss_floor) ? std::to_string(*r.loss_floor).c_str()
                                                     : "unknown",
        loss_hash(r.losses).c_str());
  add("%-22s %s\n", "weights hash", r.weights_hash ? r.weights_hash->c_str() : "-");
  for (const EvalResult& e : r.evals)
    add("%-22s %s %.6g after step %" PRId64 " (%" PRId64 " samples)\n", "evaluation",
        r.eval_metric.c_str(), e.value, e.step, e.samples);
  if (r.target_quality) {
    if (r.steps_to_target)
      add("%-22s %s %.6g reached after %" PRId64 " steps, %.3f s (run_start to run_stop)\n",
          "time to train", r.eval_metric.c_str(), *r.target_quality, *r.steps_to_target,
          r.time_to_train_s.value_or(NAN));
    else
      add("%-22s %s %.6g not reached in %d steps (status aborted)\n", "time to train",
          r.eval_metric.c_str(), *r.target_quality, static_cast<int>(r.losses.size()));
  }
  add("%-22s %s\n", "tensor parallelism", r.tensor_parallel_collectives.c_str());
  return os.str();
}

}  // namespace replay::bench
