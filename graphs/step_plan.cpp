// step_plan.cpp: StepPlan's runtime: neutral warm-up, capture in execution order, checked replay,
// shadow verification and in-place updates.
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
    if (bytes > 0)
      REPLAY_CUDA_CHECK(
          cudaHostAlloc(reinterpret_cast<void**>(&data_), bytes, cudaHostAllocDefault));
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
  struct Keyed {
    std::unique_ptr<Graph> graph;                       // graphed units only
    std::vector<std::vector<ArgFingerprint>> captured;  // per region of the unit, at capture
  };
  std::vector<Keyed> keys;  // one per shape key
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
  REPLAY_REQUIRE(!prepared_,
                 "region '" + region.name + "' added to step '" + name_ + "' after it was built");
  regions_.push_back(std::move(region));
}

void StepPlan::add_state(const std::string& name, void* device, size_t bytes) {
  REPLAY_REQUIRE(!prepared_,
                 "state '" + name + "' added to step '" + name_ + "' after it was built");
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

void StepPlan::set_shape_keys(std::vector<std::string> names, std::function<void(int key)> select) {
  REPLAY_REQUIRE(!prepared_, "step '" + name_ + "': shape keys are set before the step is built");
  REPLAY_REQUIRE(!names.empty(), "step '" + name_ + "': at least one shape key");
  REPLAY_REQUIRE(select != nullptr, "step '" + name_ + "': shape keys need a select function");
  for (size_t i = 0; i < names.size(); ++i) {
    REPLAY_REQUIRE(!names[i].empty(), "step '" + name_ + "': shape keys need names");
    for (size_t j = 0; j < i; ++j)
      REPLAY_REQUIRE(names[i] != names[j],
                     "step '" + name_ + "': shape key '" + names[i] + "' named twice");
  }
  key_names_ = std::move(names);
  select_key_ = std::move(select);
}

void StepPlan::check_key(int key) const {
  REPLAY_REQUIRE(key >= 0 && key < shape_keys(), "step '" + name_ + "': shape key " +
                                                     std::to_string(key) + " out of range (" +
                                                     std::to_string(shape_keys()) + " keys)");
}

std::string StepPlan::graph_name(const StepUnit& unit, int key) const {
  return key_names_.size() > 1 ? unit.name + "@" + key_names_[static_cast<size_t>(key)] : unit.name;
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

void StepPlan::enqueue_unit(const StepUnit& unit, const std::vector<RegionArgs>& args,
                            cudaStream_t stream) {
  for (int i = unit.first; i <= unit.last; ++i)
    regions_[static_cast<size_t>(i)].enqueue(stream, args[static_cast<size_t>(i - unit.first)]);
  if (full_step() && rng_ != nullptr) rng_->advance(stream);
}

void StepPlan::run_eager_step(cudaStream_t stream) {
  for (int i = 0; i < static_cast<int>(regions_.size()); ++i)
    regions_[static_cast<size_t>(i)].enqueue(stream, args_of(i));
  if (rng_ != nullptr) rng_->advance(stream);
}

// Neutral warm-up, in every mode so that all start from the same state: lazy initialization
// (library handles, kernel modules, NCCL) happens here, outside any capture, at every shape key;
// then every byte that carries between steps is put back, so step 0 is the same in every mode. With
// a warm-up hold, the optimizer skips its update and only the registered (small) state is saved.
void StepPlan::warm_up(cudaStream_t stream) {
  size_t total = 0;
  for (const Buffer& b : state_) total += b.bytes;
  PinnedBuffer saved(total);
  size_t offset = 0;
  for (const Buffer& b : state_) {
    if (b.bytes)
      REPLAY_CUDA_CHECK(
          cudaMemcpyAsync(saved.get() + offset, b.device, b.bytes, cudaMemcpyDeviceToHost, stream));
    offset += b.bytes;
  }
  static const int32_t kOn = 1, kOff = 0;
  if (warmup_hold_ != nullptr)
    REPLAY_CUDA_CHECK(
        cudaMemcpyAsync(warmup_hold_, &kOn, sizeof(kOn), cudaMemcpyHostToDevice, stream));
  if (rng_ != nullptr) rng_->snapshot(stream);
  for (int key = 0; key < shape_keys(); ++key) {
    if (select_key_) select_key_(key);
    for (int w = 0; w < options_.warmup_steps; ++w) run_eager_step(stream);
  }
  offset = 0;
  for (const Buffer& b : state_) {
    if (b.bytes)
      REPLAY_CUDA_CHECK(
          cudaMemcpyAsync(b.device, saved.get() + offset, b.bytes, cudaMemcpyHostToDevice, stream));
    offset += b.bytes;
  }
  if (warmup_hold_ != nullptr)
    REPLAY_CUDA_CHECK(
        cudaMemcpyAsync(warmup_hold_, &kOff, sizeof(kOff), cudaMemcpyHostToDevice, stream));
  if (rng_ != nullptr) rng_->restore(stream);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));  // `saved` is freed at scope exit
}

void StepPlan::capture(size_t u, int key, cudaStream_t stream) {
  const StepUnit& unit = units_[u];
  UnitState::Keyed& st = unit_state_[u]->keys[static_cast<size_t>(key)];
  const std::vector<RegionArgs> args = args_of(unit);
  st.captured.clear();
  for (const RegionArgs& a : args) st.captured.push_back(fingerprint(a));
  st.graph = std::make_unique<Graph>(graph_name(unit, key));
  st.graph->build(
      capture_stream_->get(), [&](cudaStream_t s) { enqueue_unit(unit, args, s); }, stream,
      options_.capture_mode);
}

void StepPlan::prepare(cudaStream_t stream) {
  REPLAY_REQUIRE(!prepared_, "step '" + name_ + "' prepared twice");
  units_ = partition_step(name_, regions_, options_);
  unit_state_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    unit_state_.push_back(std::make_unique<UnitState>());
    unit_state_.back()->keys.resize(key_names_.size());
  }
  if (options_.warmup_steps > 0) warm_up(stream);
  if (options_.mode == GraphMode::kNone) {
    prepared_ = true;
    return;
  }

  // Capture in execution order on the plan's own stream, key by key; instantiate and upload on the
  // work stream.
  capture_stream_ = std::make_unique<CaptureStream>();
  for (int key = 0; key < shape_keys(); ++key) {
    if (select_key_) select_key_(key);
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].graphed) capture(u, key, stream);
  }
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  prepared_ = true;
}

void StepPlan::prepare_at(int key, cudaStream_t stream) {
  prepare(stream);
  if (select_key_) select_key_(key);  // the key this step runs at, which prepare() left for another
}

void StepPlan::check_arguments(size_t unit, int key, const std::vector<RegionArgs>& args) const {
  const StepUnit& u = units_[unit];
  const UnitState::Keyed& st = unit_state_[unit]->keys[static_cast<size_t>(key)];
  for (int i = u.first; i <= u.last; ++i) {
    const auto k = static_cast<size_t>(i - u.first);
    const std::string mismatch = fingerprint_mismatch(st.captured[k], fingerprint(args[k]));
    if (mismatch.empty()) continue;
    throw Error(
        "replay", "graph argument mismatch",
        "step '" + name_ + "', graph '" + graph_name(u, key) + "', region '" +
            regions_[static_cast<size_t>(i)].name + "': " + mismatch +
            ". Replaying would use the captured arguments: keep the buffers in place, or call "
            "StepPlan::update() after moving them");
  }
}

void StepPlan::run_unit(size_t unit, int key, cudaStream_t stream) {
  const StepUnit& u = units_[unit];
  const std::vector<RegionArgs> args = args_of(u);
  if (u.graphed) {
    check_arguments(unit, key, args);
    unit_state_[unit]->keys[static_cast<size_t>(key)].graph->launch(stream);
  } else {
    enqueue_unit(u, args, stream);
  }
}

void StepPlan::run_step(cudaStream_t stream, int key) {
  check_key(key);
  if (!prepared_) prepare_at(key, stream);
  if (trace_enqueue_) {
    run_step_traced(key, stream);
  } else {
    for (size_t u = 0; u < units_.size(); ++u) run_unit(u, key, stream);
  }
  if (!full_step() && rng_ != nullptr) rng_->advance(stream);
}

// The host clock around each unit's enqueue. A launch that finds the driver unable to take more
// work (its launch queues full, or too many launches pending of graphs holding cuDNN attention:
// README, "Looking inside a step") waits until the GPU has retired some; the line says where the
// host waited.
void StepPlan::run_step_traced(int key, cudaStream_t stream) {
  using Clock = std::chrono::steady_clock;
  constexpr double kReportUs = 200.0;
  std::ostringstream slow;
  double total_us = 0.0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto t0 = Clock::now();
    run_unit(u, key, stream);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    total_us += us;
    if (us > kReportUs) slow << ' ' << units_[u].name << ' ' << static_cast<int64_t>(us);
  }
  const std::string units = slow.str();
  std::fprintf(
      stderr, "[replay graphs] step '%s' #%lld enqueued in %lld us; units over %.0f us:%s\n",
      name_.c_str(), static_cast<long long>(traced_steps_++), static_cast<long long>(total_us),
      kReportUs, units.empty() ? " none" : units.c_str());
}

std::vector<StepPlan::Buffer> StepPlan::outputs_of(size_t unit,
                                                   const std::vector<RegionArgs>& args) const {
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
      REPLAY_REQUIRE(a.view.is_contiguous(), "verify-graphs: output '" + a.name + "' of region '" +
                                                 r.name + "' is not contiguous");
      add(Buffer{r.name + ":" + a.name, a.view.data, a.view.bytes(), a.view.dtype});
    }
  }
  if (full_step()) {
    for (const Buffer& s : state_) add(Buffer{"state:" + s.name, s.device, s.bytes, s.dtype});
    if (rng_ != nullptr)
      add(Buffer{"rng.slots", rng_->slots(), rng_->slots_bytes(), DType::kINT64});
  }
  return out;
}

VerifyReport StepPlan::verify_step(cudaStream_t stream, int key) {
  check_key(key);
  if (!prepared_) prepare_at(key, stream);
  VerifyReport report;
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (!unit.graphed) {
      run_unit(u, key, stream);
      continue;
    }
    Graph& graph = *unit_state_[u]->keys[static_cast<size_t>(key)].graph;
    const std::vector<RegionArgs> args = args_of(unit);
    check_arguments(u, key, args);
    const std::vector<Buffer> outputs = outputs_of(u, args);
    if (outputs
            .empty()) {  // nothing to compare; running it twice could apply undeclared writes twice
      graph.launch(stream);
      continue;
    }
    size_t total = 0;
    for (const Buffer& b : outputs) total += b.bytes;
    if (3 * total > verify_host_bytes_) {
      // Earlier copies into the old buffer completed at the last synchronization below.
      if (verify_host_) REPLAY_CUDA_CHECK(cudaFreeHost(verify_host_));
      verify_host_ = nullptr;
      verify_host_bytes_ = 0;
      REPLAY_CUDA_CHECK(
          cudaHostAlloc(reinterpret_cast<void**>(&verify_host_), 3 * total, cudaHostAllocDefault));
      verify_host_bytes_ = 3 * total;
    }
    char* saved = verify_host_;
    char* eager = verify_host_ + total;
    char* graphed = verify_host_ + 2 * total;
    auto copy_out = [&](char* host) {
      size_t off = 0;
      for (const Buffer& b : outputs) {
        REPLAY_CUDA_CHECK(
            cudaMemcpyAsync(host + off, b.device, b.bytes, cudaMemcpyDeviceToHost, stream));
        off += b.bytes;
      }
    };
    copy_out(saved);
    enqueue_unit(unit, args, stream);  // eagerly, the same launches the graph holds
    copy_out(eager);
    size_t off = 0;
    for (const Buffer& b : outputs) {
      REPLAY_CUDA_CHECK(
          cudaMemcpyAsync(b.device, saved + off, b.bytes, cudaMemcpyHostToDevice, stream));
      off += b.bytes;
    }
    graph.launch(stream);
    copy_out(graphed);
    REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));

    report.graphs_checked += 1;
    off = 0;
    for (const Buffer& b : outputs) {
      report.tensors_checked += 1;
      const int64_t index = first_difference(eager + off, graphed + off, b.bytes, b.dtype);
      if (index >= 0 && report.ok) {
        report.ok = false;
        report.graph = graph.name();
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

std::vector<UpdateReport> StepPlan::update(cudaStream_t stream, int key) {
  REPLAY_REQUIRE(prepared_, "step '" + name_ + "' updated before it was built");
  check_key(key);
  std::vector<UpdateReport> reports;
  for (size_t u = 0; u < units_.size(); ++u) {
    const StepUnit& unit = units_[u];
    if (!unit.graphed) continue;
    UnitState::Keyed& st = unit_state_[u]->keys[static_cast<size_t>(key)];
    const std::vector<RegionArgs> args = args_of(unit);
    std::vector<std::vector<ArgFingerprint>> now;
    bool changed = false;
    for (size_t k = 0; k < args.size(); ++k) {
      now.push_back(fingerprint(args[k]));
      changed = changed || !fingerprint_mismatch(st.captured[k], now.back()).empty();
    }
    if (!changed) continue;
    reports.push_back(st.graph->update(
        capture_stream_->get(), [&](cudaStream_t s) { enqueue_unit(unit, args, s); }, stream,
        options_.capture_mode));
    st.captured = std::move(now);
  }
  return reports;
}

std::vector<GraphStats> StepPlan::graph_stats() const {
  std::vector<GraphStats> stats;
  for (const auto& unit : unit_state_)
    for (const UnitState::Keyed& k : unit->keys)
      if (k.graph) stats.push_back(k.graph->stats());
  return stats;
}

std::string StepPlan::describe() const {
  std::ostringstream os;
  os << "step '" << name_ << "', graph mode " << graph_mode_name(options_.mode) << ", warm-up "
     << options_.warmup_steps << ", capture " << capture_mode_name(options_.capture_mode);
  if (shape_keys() > 1) {
    os << ", shape keys";
    for (const std::string& k : key_names_) os << " " << k;
  }
  os << "\n";
  char line[256];
  for (int key = 0; key < shape_keys(); ++key) {
    for (size_t u = 0; u < units_.size(); ++u) {
      const StepUnit& unit = units_[u];
      const Graph* g = unit_state_.empty()
                           ? nullptr
                           : unit_state_[u]->keys[static_cast<size_t>(key)].graph.get();
      if (unit.graphed && g != nullptr) {
        const GraphStats& s = g->stats();
        std::snprintf(
            line, sizeof(line),
            "  graph %-28s regions %d..%d  nodes %zu  capture %.2f ms  instantiate %.2f ms:",
            g->name().c_str(), unit.first, unit.last, s.nodes, s.capture_ms, s.instantiate_ms);
      } else if (key == 0) {
        std::snprintf(line, sizeof(line), "  eager %-28s region %d:", unit.name.c_str(),
                      unit.first);
      } else {
        continue;  // eager units are listed once
      }
      os << line;
      for (int r = unit.first; r <= unit.last; ++r)
        os << " " << regions_[static_cast<size_t>(r)].name;
      os << "\n";
    }
  }
  return os.str();
}

}  // namespace replay::graphs
