// step_plan.cpp: StepPlan's runtime: neutral warm-up, capture in execution order, checked replay, shadow
// verification and in-place updates.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/check.h"
#include "graphs/step_plan.h"

namespace replay::graphs {

namespace {

// Pinned host memory for one set-up task, freed when it goes out of scope.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) {
    if (bytes > 0) REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&data_), bytes, cudaHostAllocDefault));
  }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* get() const { return data_; }

 private:
  char* data_ = nullptr;
};

}  // namespace

struct StepPlan::UnitState {
  std::unique_ptr<Graph> graph;                          // graphed units only
  std::vector<std::vector<ArgFingerprint>> captured;     // per region of the unit, at capture
};

StepPlan::StepPlan(std::string name, StepPlanOptions options)
    : name_(std::move(name)), options_(std::move(options)) {
  REPLAY_REQUIRE(!name_.empty(), "a step plan needs a name");
  const char* trace = std::getenv("REPLAY_TRACE_ENQUEUE");
  trace_enqueue_ = trace != nullptr && trace[0] != '\0' && std::strcmp(trace, "0") != 0;
}

StepPlan::~StepPlan() {
  if (verify_host_) cudaFreeHost(verify_host_);
}

void StepPlan::add_region(Region region) {
  REPLAY_REQUIRE(!prepared_, "region '" + region.name + "' added to step '" + name_ + "' after it was built");
  regions_.push_back(std::move(region));
}

void StepPlan::add_state(const std::string& name, void* device, size_t bytes) {
  REPLAY_REQUIRE(!prepared_, "state '" + name + "' added to step '" + name_ + "' after it was built");
  REPLAY_REQUIRE(device != nullptr || bytes == 0, "state '" + name + "' has no device memory");
  state_.push_back(Buffer{name, device, bytes, DType::kUINT8});
}

void StepPlan::add_state(const std::string& name, const TensorView& view) {
  REPLAY_REQUIRE(view.is_contiguous(), "state '" + name + "' must be a contiguous view");
  add_state(name, view.data, view.bytes());
  state_.back().dtype = view.dtype;
}

void StepPlan::set_rng(RngTracker* rng) {
  REPLAY_REQUIRE(!prepared_, "step '" + name_ + "': the RNG is set before the step is built");
  rng_ = rng;
}

const std::vector<StepUnit>& StepPlan::units() const {
  REPLAY_REQUIRE(prepared_, "step '" + name_ + "' has not been built yet (prepare or run_step)");
  return units_;
}

RegionArgs StepPlan::args_of(int region) const {
  const Region& r = regions_[static_cast<size_t>(region)];
  return r.args ? r.args() : RegionArgs{};
}

std::vector<RegionArgs> StepPlan::args_of(const StepUnit& unit) const {
  std::vector<RegionArgs> args;
  for (int i = unit.first; i <= unit.last; ++i) args.push_back(args_of(i));
  return args;
}

void StepPlan::enqueue_unit(const StepUnit& unit, const std::vector<RegionArgs>& args, cudaStream_t stream) {
  for (int i = unit.first; i <= unit.last; ++i)
    regions_[static_cast<size_t>(i)].enqueue(stream, args[static_cast<size_t>(i - unit.first)]);
  if (full_step() && rng_ != nullptr) rng_->advance(stream);
}

void StepPlan::run_eager_step(cudaStream_t stream) {
  for (int i = 0; i < static_cast<int>(regions_.size()); ++i)
    regions_[static_cast<size_t>(i)].enqueue(stream, args_of(i));
  if (rng_ != nullptr) rng_->advance(stream);
}

void StepPlan::prepare(cudaStream_t stream) {
  REPLAY_REQUIRE(!prepared_, "step '" + name_ + "' prepared twice");
  units_ = partition_step(name_, regions_, options_);
  unit_state_.clear();
  for (size_t u = 0; u < units_.size(); ++u) unit_state_.push_back(std::make_unique<UnitState>());

  // Neutral warm-up, in every mode so that all start from the same state: lazy initialization (library
  // handles, kernel modules, NCCL) happens here, outside any capture; then every byte that carries
  // between steps is put back, so step 0 is the same in every mode. With a warm-up hold, the optimizer
  // skips its update and only the registered (small) state is saved.
  if (options_.warmup_steps > 0) {
    size_t total = 0;
    for (const Buffer& b : state_) total += b.bytes;
    PinnedBuffer saved(total);
    size_t offset = 0;
    for (const Buffer& b : state_) {
      if (b.bytes) REPLAY_CUDA_CHECK(cudaMemcpyAsync(saved.get() + offset, b.device, b.bytes, cudaMemcpyDeviceToHost, stream));
      offset += b.bytes;
    }
    static const int32_t kOn = 1, kOff = 0;
    if (warmup_hold_ != nullptr)
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(warmup_hold_, &kOn, sizeof(kOn), cudaMemcpyHostToDevice, stream));
    if (rng_ != nullptr) rng_->snapshot(stream);
    for (int w = 0; w < options_.warmup_steps; ++w) run_eager_step(stream);
    offset = 0;
    for (const Buffer& b : state_) {
      if (b.bytes) REPLAY_CUDA_CHECK(cudaMemcpyAsync(b.device, saved.get() + offset, b.bytes, cudaMemcpyHostToDevice, stream));
      offset += b.bytes;
    }
    if (warmup_hold_ != nullptr)
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(warmup_hold_, &kOff, sizeof(kOff), cudaMemcpyHostToDevice, stream));
    if (rng_ != nullptr) rng_->restore(stream);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));  // `saved` is freed at scope exit
  }
  if (options_.mode == GraphMode::kNone) {
    prepared_ = true;
    return;
  }

  // Capture in execution order on the plan's own stream; instantiate and upload on the work stream.
  capture_stream_ = std::make_unique<CaptureStream>();
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (!unit.graphed) continue;
    UnitState& st = *unit_state_[u];
    const std::vector<RegionArgs> args = args_of(unit);
    st.captured.clear();
    for (const RegionArgs& a : args) st.captured.push_back(fingerprint(a));
    st.graph = std::make_unique<Graph>(unit.name);
    st.graph->build(capture_stream_->get(), [&](cudaStream_t s) { enqueue_unit(unit, args, s); }, stream,
                    options_.capture_mode);
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  prepared_ = true;
}

void StepPlan::check_arguments(size_t unit, const std::vector<RegionArgs>& args) const {
  const StepUnit& u = units_[unit];
  const UnitState& st = *unit_state_[unit];
  for (int i = u.first; i <= u.last; ++i) {
    const auto k = static_cast<size_t>(i - u.first);
    const std::string mismatch = fingerprint_mismatch(st.captured[k], fingerprint(args[k]));
    if (mismatch.empty()) continue;
    throw Error("replay", "graph argument mismatch",
                "step '" + name_ + "', graph '" + u.name + "', region '" + regions_[static_cast<size_t>(i)].name +
                    "': " + mismatch +
                    ". Replaying would use the captured arguments: keep the buffers in place, or call "
                    "StepPlan::update() after moving them");
  }
}

void StepPlan::run_unit(size_t unit, cudaStream_t stream) {
  const StepUnit& u = units_[unit];
  const std::vector<RegionArgs> args = args_of(u);
  if (u.graphed) {
    check_arguments(unit, args);
    unit_state_[unit]->graph->launch(stream);
  } else {
    enqueue_unit(u, args, stream);
  }
}

void StepPlan::run_step(cudaStream_t stream) {
  if (!prepared_) prepare(stream);
  if (trace_enqueue_) {
    run_step_traced(stream);
  } else {
    for (size_t u = 0; u < units_.size(); ++u) run_unit(u, stream);
  }
  if (!full_step() && rng_ != nullptr) rng_->advance(stream);
}

// The host clock around each unit's enqueue. A launch that finds the driver unable to take more work
// (its launch queues full, or too many launches pending of graphs holding cuDNN attention: README,
// "Looking inside a step") waits until the GPU has retired some; the line says where the host waited.
void StepPlan::run_step_traced(cudaStream_t stream) {
  using Clock = std::chrono::steady_clock;
  constexpr double kReportUs = 200.0;
  std::ostringstream slow;
  double total_us = 0.0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto t0 = Clock::now();
    run_unit(u, stream);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    total_us += us;
    if (us > kReportUs) slow << ' ' << units_[u].name << ' ' << static_cast<int64_t>(us);
  }
  const std::string units = slow.str();
  std::fprintf(stderr, "[replay graphs] step '%s' #%lld enqueued in %lld us; units over %.0f us:%s\n",
               name_.c_str(), static_cast<long long>(traced_steps_++), static_cast<long long>(total_us),
               kReportUs, units.empty() ? " none" : units.c_str());
}

std::vector<StepPlan::Buffer> StepPlan::outputs_of(size_t unit, const std::vector<RegionArgs>& args) const {
  const StepUnit& u = units_[unit];
  std::vector<Buffer> out;
  auto add = [&](Buffer b) {
    if (b.bytes == 0) return;
    for (const Buffer& o : out)
      if (o.device == b.device && o.bytes == b.bytes) return;  // the same memory listed twice
    out.push_back(std::move(b));
  };
  for (int i = u.first; i <= u.last; ++i) {
    const Region& r = regions_[static_cast<size_t>(i)];
    for (const RegionArg& a : args[static_cast<size_t>(i - u.first)].list()) {
      if (a.access == Access::kRead) continue;
      REPLAY_REQUIRE(a.view.is_contiguous(), "verify-graphs: output '" + a.name + "' of region '" + r.name +
                                                 "' is not contiguous");
      add(Buffer{r.name + ":" + a.name, a.view.data, a.view.bytes(), a.view.dtype});
    }
  }
  if (full_step()) {
    for (const Buffer& s : state_) add(Buffer{"state:" + s.name, s.device, s.bytes, s.dtype});
    if (rng_ != nullptr) add(Buffer{"rng.slots", rng_->slots(), rng_->slots_bytes(), DType::kINT64});
  }
  return out;
}

VerifyReport StepPlan::verify_step(cudaStream_t stream) {
  if (!prepared_) prepare(stream);
  VerifyReport report;
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (!unit.graphed) {
      run_unit(u, stream);
      continue;
    }
    const std::vector<RegionArgs> args = args_of(unit);
    check_arguments(u, args);
    const std::vector<Buffer> outputs = outputs_of(u, args);
    if (outputs.empty()) {  // nothing to compare; running it twice could apply undeclared writes twice
      unit_state_[u]->graph->launch(stream);
      continue;
    }
    size_t total = 0;
    for (const Buffer& b : outputs) total += b.bytes;
    if (3 * total > verify_host_bytes_) {
      // Earlier copies into the old buffer completed at the last synchronization below.
      if (verify_host_) REPLAY_CUDA_CHECK(cudaFreeHost(verify_host_));
      verify_host_ = nullptr;
      verify_host_bytes_ = 0;
      REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&verify_host_), 3 * total, cudaHostAllocDefault));
      verify_host_bytes_ = 3 * total;
    }
    char* saved = verify_host_;
    char* eager = verify_host_ + total;
    char* graphed = verify_host_ + 2 * total;
    auto copy_out = [&](char* host) {
      size_t off = 0;
      for (const Buffer& b : outputs) {
        REPLAY_CUDA_CHECK(cudaMemcpyAsync(host + off, b.device, b.bytes, cudaMemcpyDeviceToHost, stream));
        off += b.bytes;
      }
    };
    copy_out(saved);
    enqueue_unit(unit, args, stream);  // eagerly, the same launches the graph holds
    copy_out(eager);
    size_t off = 0;
    for (const Buffer& b : outputs) {
      REPLAY_CUDA_CHECK(cudaMemcpyAsync(b.device, saved + off, b.bytes, cudaMemcpyHostToDevice, stream));
      off += b.bytes;
    }
    unit_state_[u]->graph->launch(stream);
    copy_out(graphed);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));

    report.graphs_checked += 1;
    off = 0;
    for (const Buffer& b : outputs) {
      report.tensors_checked += 1;
      const int64_t index = first_difference(eager + off, graphed + off, b.bytes, b.dtype);
      if (index >= 0 && report.ok) {
        report.ok = false;
        report.graph = unit.name;
        report.tensor = b.name;
        report.index = index;
        report.eager_value = format_element(eager + off, b.dtype, index);
        report.graph_value = format_element(graphed + off, b.dtype, index);
      }
      off += b.bytes;
    }
  }
  if (!full_step() && rng_ != nullptr) rng_->advance(stream);
  return report;
}

std::vector<UpdateReport> StepPlan::update(cudaStream_t stream) {
  REPLAY_REQUIRE(prepared_, "step '" + name_ + "' updated before it was built");
  std::vector<UpdateReport> reports;
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (!unit.graphed) continue;
    UnitState& st = *unit_state_[u];
    const std::vector<RegionArgs> args = args_of(unit);
    std::vector<std::vector<ArgFingerprint>> now;
    bool changed = false;
    for (size_t k = 0; k < args.size(); ++k) {
      now.push_back(fingerprint(args[k]));
      changed = changed || !fingerprint_mismatch(st.captured[k], now.back()).empty();
    }
    if (!changed) continue;
    reports.push_back(st.graph->update(capture_stream_->get(), [&](cudaStream_t s) { enqueue_unit(unit, args, s); },
                                       stream, options_.capture_mode));
    st.captured = std::move(now);
  }
  return reports;
}

std::vector<GraphStats> StepPlan::graph_stats() const {
  std::vector<GraphStats> stats;
  for (size_t u = 0; u < unit_state_.size(); ++u)
    if (unit_state_[u]->graph) stats.push_back(unit_state_[u]->graph->stats());
  return stats;
}

std::string StepPlan::describe() const {
  std::ostringstream os;
  os << "step '" << name_ << "', graph mode " << graph_mode_name(options_.mode) << ", warm-up "
     << options_.warmup_steps << ", capture " << capture_mode_name(options_.capture_mode) << "\n";
  char line[256];
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (unit.graphed && unit_state_[u]->graph) {
      const GraphStats& s = unit_state_[u]->graph->stats();
      std::snprintf(line, sizeof(line), "  graph %-28s regions %d..%d  nodes %zu  capture %.2f ms  instantiate %.2f ms:",
                    unit.name.c_str(), unit.first, unit.last, s.nodes, s.capture_ms, s.instantiate_ms);
    } else {
      std::snprintf(line, sizeof(line), "  eager %-28s region %d:", unit.name.c_str(), unit.first);
    }
    os << line;
    for (int r = unit.first; r <= unit.last; ++r) os << " " << regions_[static_cast<size_t>(r)].name;
    os << "\n";
  }
  return os.str();
}

}  // namespace replay::graphs
