// step_plan.h: StepPlan, one training step declared as ordered regions and run eagerly (`none`), as
// one graph per graphable region (`layer`), or as one graph for the whole step, optimizer included
// (`full`). Warm-up before capture is neutral (RNG slots and registered state are restored), graphs
// are captured in execution order, each replay checks the arguments every region was captured with,
// and verify_step() runs each graph's regions eagerly and graphed on the same inputs and names the
// first output that differs.
//
//   StepPlan plan("gpt3", {GraphMode::kFull});
//   plan.add_region({"layer0.fwd", RegionKind::kForwardLayer,
//                    [&](cudaStream_t s, const RegionArgs& a) { layer_forward(0, a["x"], a["y"],
//                    s); },
//                    [&] { return RegionArgs().read("x", x).write("y", y); }});
//   ...
//   plan.add_state("adam.exp_avg", exp_avg_view);   // everything that carries from one step to the
//   next plan.set_rng(&rng); for (int step = 0; step < steps; ++step) plan.run_step(ctx.stream());
//
// A step that runs at several shapes (a ladder of padded lengths, as NVIDIA's RNN-T) declares shape
// keys: the plan keeps one executable per graph and key, all captured in prepare(), and
// run_step(stream, key) replays that key's (TensorRT-LLM's graph cache, keyed by shape):
//   plan.set_shape_keys({"T400", "T800"}, [&](int key) { model.select_rung(key); });
//   model.select_rung(k); load a batch padded to rung k; plan.run_step(stream, k);
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor.h"
#include "graphs/graph.h"
#include "graphs/rng.h"

namespace replay::graphs {

enum class GraphMode { kNone, kLayer, kFull };
const char* graph_mode_name(GraphMode mode);
// "none", "layer" or "full"; anything else throws an Error listing the choices.
GraphMode parse_graph_mode(std::string_view text);

enum class RegionKind { kForwardLayer, kBackwardLayer, kOther };
const char* region_kind_name(RegionKind kind);

// How a region uses an argument. Outputs (write, read-write) are what verify_step() compares and
// restores, so every tensor a region writes must be listed.
enum class Access { kRead, kWrite, kReadWrite };

struct RegionArg {
  std::string name;
  TensorView view;
  Access access = Access::kRead;
};

// The tensors a region reads and writes (device scalars are one-element views).
class RegionArgs {
 public:
  RegionArgs& read(std::string name, const TensorView& view);
  RegionArgs& write(std::string name, const TensorView& view);
  RegionArgs& read_write(std::string name, const TensorView& view);
  // Any of the three, for lists that one region writes and another reads.
  RegionArgs& add(std::string name, const TensorView& view, Access access);
  // The argument called `name`; throws an Error naming it when it is absent.
  const TensorView& operator[](std::string_view name) const;
  const std::vector<RegionArg>& list() const { return args_; }

 private:
  std::vector<RegionArg> args_;
};

struct Region {
  std::string name;  // unique in the plan: "embedding", "layer3.fwd", "loss", "optimizer"
  RegionKind kind = RegionKind::kOther;
  // Launches the region's work on the given stream (or on side streams forked from it and joined
  // back). Never synchronizes, allocates or reads device values: it may be captured, and then
  // `stream` is the plan's own capture stream, so library calls must take it (cuBLASLt's stream
  // argument, cudnnSetStream).
  std::function<void(cudaStream_t, const RegionArgs&)> enqueue;
  // The region's current arguments; evaluated at capture and before every replay. May be empty.
  std::function<RegionArgs()> args;
  // Module scope ("attn", "mlp", "moe_router", ...): in layer mode with StepPlanOptions::scopes
  // set, only regions of those scopes become graphs.
  std::string scope;
  // Layer mode: whether this region is captured as its own graph. Unset: forward and backward
  // layers are, other regions run eagerly.
  std::optional<bool> graphable;
};

struct StepPlanOptions {
  StepPlanOptions() = default;
  StepPlanOptions(GraphMode m) : mode(m) {}  // implicit on purpose: `{GraphMode::kFull}` reads well

  GraphMode mode = GraphMode::kNone;
  int warmup_steps = 3;  // eager steps before capture (graph modes); their effects are undone
  CaptureMode capture_mode = CaptureMode::kGlobal;
  std::vector<std::string> scopes;  // layer mode: capture only regions of these module scopes
};

// ---- Host logic (no GPU needed; tested on the CPU) ----

// What a region was captured with: per argument its name, address, type, shape and strides.
struct ArgFingerprint {
  std::string name;
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int ndim = 0;
  std::array<int64_t, TensorView::kMaxDims> shape{};
  std::array<int64_t, TensorView::kMaxDims> stride{};
  Access access = Access::kRead;
};
std::vector<ArgFingerprint> fingerprint(const RegionArgs& args);
// Empty when `now` matches `captured`; otherwise one sentence naming the first argument that
// differs and how ("argument 'x' was captured as bf16[4x8] at 0x7f00 and is now bf16[4x8] at
// 0x7f80").
std::string fingerprint_mismatch(const std::vector<ArgFingerprint>& captured,
                                 const std::vector<ArgFingerprint>& now);

// A run of regions executed together: one graph, or one eager region.
struct StepUnit {
  std::string name;  // the region's name, or the plan's name for the full-step graph
  int first = 0;     // region indices, inclusive
  int last = 0;
  bool graphed = false;
};
// Splits the step by mode, in execution order. Validates the regions (unique non-empty names, an
// enqueue function each) and the scopes (each must name a scope some region declares).
std::vector<StepUnit> partition_step(const std::string& plan_name,
                                     const std::vector<Region>& regions,
                                     const StepPlanOptions& options);

// Index of the first element (of type `dtype`) at which two host copies differ bitwise; -1 when
// equal.
int64_t first_difference(const void* a, const void* b, size_t bytes, DType dtype);
// Element `index` of a host array printed with its bits: "1.5 (0x3fc00000)", "-2 (0xc000)", "17".
std::string format_element(const void* data, DType dtype, int64_t index);

// ---- Shadow verification ----

struct VerifyReport {
  bool ok = true;
  int graphs_checked = 0;
  int tensors_checked = 0;
  // The first difference, when !ok:
  std::string graph;        // the graph whose outputs differ
  std::string tensor;       // the output (argument or state) that differs
  int64_t index = -1;       // its first differing element
  std::string eager_value;  // that element after the eager run
  std::string graph_value;  // and after the graphed run
  std::string message() const;
};

class StepPlan {
 public:
  explicit StepPlan(std::string name, StepPlanOptions options = {});
  ~StepPlan();
  StepPlan(const StepPlan&) = delete;
  StepPlan& operator=(const StepPlan&) = delete;

  // ---- Declaring the step, before the first run ----
  // Regions run in the order they are added.
  void add_region(Region region);
  // Device memory whose value carries from one step to the next (weights, master weights, optimizer
  // state, step counters, loss-scaler state, ...): saved before warm-up and restored after it,
  // through pinned host memory allocated and freed by prepare(). Also compared by verify_step() in
  // full mode.
  void add_state(const std::string& name, void* device, size_t bytes);
  void add_state(const std::string& name, const TensorView& view);
  // A device int32 that the plan sets to 1 for the neutral warm-up and back to 0 after it. An
  // optimizer that reads it as a no-op (StepScalars::hold, through prepare_optimizer) leaves
  // parameters and optimizer state untouched during warm-up, so they need not be registered with
  // add_state: only the small state that changes regardless (the step scalars) is saved. Optional.
  void set_warmup_hold(int32_t* device_flag) { warmup_hold_ = device_flag; }
  // The RNG whose slots advance at the end of every step (inside the graph in full mode) and are
  // restored after warm-up. Optional.
  void set_rng(RngTracker* rng);
  // Shape keys (at least one; by default one, unnamed). `select(k)` makes the regions' arguments
  // and work those of key k: prepare() calls it before warming up and before capturing each key, so
  // every key is warmed up and captured with its own shapes. prepare() leaves the last key selected
  // (a first run_step that prepares selects its own key again); the caller selects the key of each
  // batch before run_step(stream, key). Optional.
  void set_shape_keys(std::vector<std::string> names, std::function<void(int key)> select);
  int shape_keys() const { return static_cast<int>(key_names_.size()); }

  // ---- Running ----
  // Every mode: neutral warm-up (warmup_steps eager steps per shape key, then state and RNG
  // restored). Graph modes: capture of every graph of every key in execution order on the plan's
  // own capture stream, instantiation and upload on `stream`. Synchronizes `stream` once (set-up).
  // Called by the first run_step() when not called before.
  void prepare(cudaStream_t stream);
  // One training step on `stream` at shape key `key` (selected by the caller). Before each replay
  // the arguments of every region in the graph are compared with those the key's graph was captured
  // with; a difference throws an Error naming region and argument. With REPLAY_TRACE_ENQUEUE set in
  // the environment, each step also prints to stderr the host time it took to enqueue and the units
  // that took over 200 us of it: where the host waits for the driver.
  void run_step(cudaStream_t stream, int key = 0);
  // One training step in which every graph also runs eagerly on the same inputs and RNG state:
  // outputs are saved, the graph's regions run eagerly, outputs copied out and restored, the graph
  // replayed and both results compared bitwise. The step's results are the graphed ones.
  // Synchronizes after every graph and uses pinned host memory (allocated on first use): a
  // diagnostic, not a timed step. A graph without outputs (no write arguments; in full mode state
  // and RNG count) is only replayed, and in none mode there is nothing to compare: a normal step
  // runs.
  VerifyReport verify_step(cudaStream_t stream, int key = 0);
  // Re-captures every graph of `key` whose region arguments changed since capture (a moved buffer,
  // a new shape) and updates it in place, or re-instantiates it and says so. Returns one report per
  // updated graph.
  std::vector<UpdateReport> update(cudaStream_t stream, int key = 0);

  // ---- Inspection ----
  const std::string& name() const { return name_; }
  const StepPlanOptions& options() const { return options_; }
  bool prepared() const { return prepared_; }
  const std::vector<StepUnit>& units() const;
  // Per graph and shape key: nodes, capture and instantiate times, updates (for the benchmark
  // JSON).
  std::vector<GraphStats> graph_stats() const;
  // One line per unit: "graph layer3.fwd  regions 7..7  nodes 41  capture 0.31 ms  instantiate 0.52
  // ms".
  std::string describe() const;

 private:
  struct UnitState;
  // A span of device memory with a name and an element type (state buffers, outputs to verify).
  struct Buffer {
    std::string name;
    void* device = nullptr;
    size_t bytes = 0;
    DType dtype = DType::kUINT8;
  };

  RegionArgs args_of(int region) const;
  std::vector<RegionArgs> args_of(const StepUnit& unit) const;
  // Enqueues the unit's regions (and, for the full-step unit, the RNG advance) on `stream`.
  void enqueue_unit(const StepUnit& unit, const std::vector<RegionArgs>& args, cudaStream_t stream);
  void run_eager_step(cudaStream_t stream);
  void warm_up(cudaStream_t stream);
  void prepare_at(int key, cudaStream_t stream);
  void capture(size_t unit, int key, cudaStream_t stream);
  void run_unit(size_t unit, int key, cudaStream_t stream);
  void run_step_traced(int key, cudaStream_t stream);
  void check_key(int key) const;
  void check_arguments(size_t unit, int key, const std::vector<RegionArgs>& args) const;
  std::string graph_name(const StepUnit& unit, int key) const;
  std::vector<Buffer> outputs_of(size_t unit, const std::vector<RegionArgs>& args) const;
  bool full_step() const { return options_.mode == GraphMode::kFull; }

  std::string name_;
  StepPlanOptions options_;
  std::vector<Region> regions_;
  int32_t* warmup_hold_ = nullptr;
  std::vector<Buffer> state_;
  RngTracker* rng_ = nullptr;
  std::vector<std::string> key_names_{""};
  std::function<void(int)> select_key_;
  bool prepared_ = false;
  bool trace_enqueue_ = false;  // REPLAY_TRACE_ENQUEUE: per-step host enqueue times on stderr
  int64_t traced_steps_ = 0;
  std::vector<StepUnit> units_;
  std::vector<std::unique_ptr<UnitState>>
      unit_state_;  // one per unit; per key its graph (graphed units)
  std::unique_ptr<CaptureStream> capture_stream_;
  // Pinned host memory for verify_step(): saved outputs, eager results, graphed results.
  char* verify_host_ = nullptr;
  size_t verify_host_bytes_ = 0;
};

}  // namespace replay::graphs
