// unet_model.cpp: the SD2 UNet's nodes (forward and backward of each op), the network built from
// them, the buffer and lifetime planning, the regions and the data (unet_model.h).
#include "workloads/unet/unet_model.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "common/attention.h"
#include "common/check.h"
#include "common/data/batch_stream.h"
#include "common/gemm.h"
#include "train/step_scalars.h"
#include "workloads/unet/conv.h"
#include "workloads/unet/diffusion.h"
#include "workloads/unet/elementwise.h"
#include "workloads/unet/group_norm.h"
#include "workloads/unet/layer_norm.h"
#include "workloads/unet/latent_stream.h"
#include "workloads/unet/pointwise.h"

namespace replay::unet {

void UnetConfig::validate() const {
  auto fail = [](const std::string& what) {
    throw Error("replay", "invalid", "UNet configuration: " + what);
  };
  if (dtype != DType::kFP16 && dtype != DType::kBF16) fail("precision must be fp16 or bf16");
  if (batch < 1) fail("batch must be at least 1");
  if (mult.empty() || attention.size() != mult.size())
    fail("one channel multiplier and one attention flag per level");
  if (latent < (int64_t{1} << (levels() - 1)) || latent % (int64_t{1} << (levels() - 1)) != 0)
    fail("latent size " + std::to_string(latent) + " is not divisible by 2^(levels - 1)");
  if (latent_channels < 1 || latent_channels % 4 != 0)
    fail("latent channels must be a multiple of 4");
  if (res_blocks < 1) fail("at least one residual block per level");
  if (base % 8 != 0 || base < 8) fail("base channels must be a positive multiple of 8");
  for (int l = 0; l < levels(); ++l) {
    const int64_t c = channels(l);
    if (c % groups != 0 || c > kGroupNormMaxChannels)
      fail("level " + std::to_string(l) + ": " + std::to_string(c) +
           " channels do not split into " + std::to_string(groups) + " GroupNorm groups");
    if (attention[static_cast<size_t>(l)] && c % head_dim != 0)
      fail("level " + std::to_string(l) + ": " + std::to_string(c) +
           " channels are not a whole number of heads of " + std::to_string(head_dim));
  }
  if (channels(levels() - 1) % head_dim != 0)
    fail("the middle block's channels must be whole heads");
  if (head_dim % 8 != 0) fail("head dimension must be a multiple of 8");
  if (context_len < 1 || context_dim % 8 != 0) fail("context dimension must be a multiple of 8");
}

std::string UnetConfig::describe() const {
  std::string m, a;
  for (int l = 0; l < levels(); ++l) {
    m += (l ? "," : "") + std::to_string(mult[static_cast<size_t>(l)]);
    a += (l ? "," : "") + std::string(attention[static_cast<size_t>(l)] ? "1" : "0");
  }
  char buf[400];
  std::snprintf(buf, sizeof(buf),
                "UNet: base %" PRId64
                " x [%s], attention [%s], %d residual blocks per level, "
                "GroupNorm %d groups, heads of %d, latent %" PRId64 "x%" PRId64 "x%" PRId64
                ", context %" PRId64 "x%" PRId64 ", batch %" PRId64 ", %s",
                base, m.c_str(), a.c_str(), res_blocks, groups, head_dim, latent_channels, latent,
                latent, context_len, context_dim, batch, dtype_name(dtype));
  std::string r = buf;
  if (recompute_norms || recompute_geglu)
    r += std::string(", recomputed in the backward: ") + (recompute_norms && recompute_geglu
                                                              ? "norms, GEGLU"
                                                          : recompute_norms ? "norms"
                                                                            : "GEGLU");
  return r;
}

// ---- The tape -----------------------------------------------------------------------------------

namespace {

struct Tensor {
  std::string name;
  DType dtype = DType::kFP16;
  int64_t rows = 0, cols = 0;       // [rows, cols]; NHWC activations are [N * H * W, C]
  bool grad = false;                // has a gradient buffer
  bool external = false;            // an input the host fills (load_batch): lives the whole run
  int producer = -1;                // node
  int begin = INT_MAX, end = -1;    // data lifetime (phases)
  int gbegin = INT_MAX, gend = -1;  // gradient lifetime
  BufferId id = -1, gid = -1;
  void* data = nullptr;
  void* gdata = nullptr;
  // Recomputed (UnetConfig::recompute_*): the forward's buffer lives only until the last forward
  // reader; the backward reads a second buffer that its producer's forward kernel fills again,
  // from the same inputs, just before the first backward reader runs.
  bool recompute = false;
  int rbegin = INT_MAX, rend = -1;  // the second buffer's lifetime
  // The gradient is written over the data (one buffer): the node that reads the data last writes
  // the gradient first, in place (GEGLU's backward: din may alias in).
  bool grad_in_place = false;
  BufferId rid = -1;
  void* rdata = nullptr;
  int64_t numel() const { return rows * cols; }
  TensorView view() const { return TensorView(data, dtype, {numel()}); }
  TensorView gview() const { return TensorView(gdata, dtype, {numel()}); }
  TensorView rview() const { return TensorView(rdata, dtype, {numel()}); }
  // What a backward reads: the saved bytes, or the recomputed ones.
  void* bdata() const { return recompute ? rdata : data; }
};

}  // namespace

struct Node;

// --op-times: CUDA events after every node's forward and backward in eager mode; the time between
// an event and the one before it (within a region) is that node's, summed per op class. Events are
// read back at every load_batch (a host sync: a diagnostic, never a timed run's default) or when
// the pool is full, and the totals written to a file when the model is destroyed.
struct OpTimer {
  static constexpr int kBoundary = -1;     // a region's start: the time before it is nobody's
  static constexpr size_t kTopNodes = 30;  // the slowest nodes the file lists
  std::string path;
  std::vector<cudaEvent_t> events;
  std::vector<int> classes;  // of each recorded event: the node's op class, or kBoundary
  std::vector<int> owners;   // of each recorded event: the node whose work ended there, or -1
  size_t used = 0;
  std::array<double, kOpClasses> ms{};
  std::array<int64_t, kOpClasses> calls{};
  std::vector<double> node_ms;  // by node index: its forward, backward and recomputes
  // Steps summed: all but the first, whose launches load the kernels' modules (CUDA's lazy
  // loading) and warm the libraries; the first alone in a one-step run.
  int64_t steps = 0;
  int64_t started = 0;  // region "input.fwd" starts seen

  OpTimer(std::string file, size_t pool, size_t nodes)
      : path(std::move(file)), classes(pool, kBoundary), owners(pool, -1), node_ms(nodes, 0.0) {
    for (size_t i = 0; i < pool; ++i) {
      cudaEvent_t e = nullptr;
      REPLAY_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
  }
  ~OpTimer() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // At the start of every step (before its first mark): the first step's times are dropped.
  void start_step() {
    if (started == 1) {
      collect();
      ms.fill(0);
      calls.fill(0);
      std::fill(node_ms.begin(), node_ms.end(), 0.0);
      steps = 0;
    }
    started += 1;
    steps += 1;
  }
  void mark(int op_class, cudaStream_t s, int owner = -1) {
    if (used == events.size()) collect();
    REPLAY_CUDA_CHECK(cudaEventRecord(events[used], s));
    classes[used] = op_class;
    owners[used] = owner;
    used += 1;
  }
  // Waits for the recorded events, adds their intervals, keeps the last as the next one's start.
  void collect() {
    if (used == 0) return;
    REPLAY_CUDA_CHECK(cudaEventSynchronize(events[used - 1]));
    for (size_t i = 1; i < used; ++i) {
      const int c = classes[i];
      if (c == kBoundary) continue;
      float t = 0;
      REPLAY_CUDA_CHECK(cudaEventElapsedTime(&t, events[i - 1], events[i]));
      ms[static_cast<size_t>(c)] += t;
      calls[static_cast<size_t>(c)] += 1;
      if (owners[i] >= 0) node_ms[static_cast<size_t>(owners[i])] += t;
    }
    std::swap(events[0], events[used - 1]);
    classes[0] = kBoundary;
    owners[0] = -1;
    used = 1;
  }
};

struct UnetModel::Impl {
  // ctx null: the structure and parameters only, no plans (parameter counts on the CPU).
  Impl(const Context* c, const UnetConfig& cfg, std::shared_ptr<const UnetData> d, int64_t at)
      : ctx(c), config(cfg), data(std::move(d)), overflow_at(at), params(cfg.dtype) {
    if (c) gemms = std::make_unique<GemmCache>(*c);
  }

  const Context* ctx;
  UnetConfig config;
  std::shared_ptr<const UnetData> data;
  int64_t overflow_at;
  train::ParamStore params;
  std::unique_ptr<GemmCache> gemms;
  ConvCache convs;
  AttentionCache attention;
  std::vector<Tensor> tensors;
  std::vector<std::unique_ptr<Node>> nodes;
  std::vector<std::string>
      blocks;     // block names, in forward order; the loss is block blocks.size()
  int block = 0;  // the block nodes are being added to
  train::StepIO io;
  const int64_t* iteration = nullptr;  // the trainer's step counter (overflow_at)
  RngArgs sample_rng;
  // Inputs, the schedule, the loss.
  int moments = -1, context = -1, pred = -1, v_target = -1;
  // Workspaces (whole step) and their sizes.
  size_t gemm_ws_bytes = 0, conv_ws_bytes = 0, attn_ws_bytes = 0, gn_ws_bytes = 0,
         bias_ws_bytes = 0, cbias_ws_bytes = 0, loss_ws_bytes = 0;
  int64_t scratch_elements = 0, dw16_elements = 0, rstats_elements = 0;
  BufferId rstats_id = -1;  // a recomputed norm's mean and rstd (equal to the saved ones)
  float* rstats = nullptr;
  BufferId gemm_ws_id = -1, conv_ws_id = -1, gn_ws_id = -1, bias_ws_id = -1, cbias_ws_id = -1,
           loss_ws_id = -1, scratch_id = -1, dw16_id = -1, table_id = -1;
  void *gemm_ws = nullptr, *conv_ws = nullptr, *gn_ws = nullptr, *bias_ws = nullptr,
       *cbias_ws = nullptr, *loss_ws = nullptr, *scratch = nullptr, *dw16 = nullptr;
  float* table = nullptr;
  void* host = nullptr;                     // the training split, pinned: moments then text
  std::unique_ptr<LatentStream> stream;     // UnetData::stream: the batches read ahead instead
  std::unique_ptr<data::BatchOrder> order;  // shuffled per epoch from the data seed
  std::vector<int64_t> rows;                // the samples of the batch being loaded
  int64_t next_batch = 0;
  double flops = 0;
  std::array<double, kOpClasses> class_flops{}, class_bytes{};  // a step's, by OpClass
  std::unique_ptr<OpTimer> timer;                               // --op-times only
  // --poison-dead-buffers: after each phase, the buffers whose lifetime ended there, filled with
  // 0xFF bytes (NaN in every float type). Built on the first use, after bind().
  bool poison = false;
  std::vector<std::vector<std::pair<void*, size_t>>> dead_after;  // by phase
  void poison_after(int phase, cudaStream_t s);
  void recompute_for(Node& n, cudaStream_t s);  // n's recomputes, before its backward

  int tensor(const std::string& name, DType dtype, int64_t rows, int64_t cols, bool grad) {
    Tensor t;
    t.name = name, t.dtype = dtype, t.rows = rows, t.cols = cols, t.grad = grad;
    tensors.push_back(t);
    return static_cast<int>(tensors.size()) - 1;
  }
  Tensor& T(int id) { return tensors[static_cast<size_t>(id)]; }
  // The step's phases, one per node and direction, in the order they run: node k's forward is
  // phase k + 1, the backward runs the nodes in reverse (node k's backward is phase 2K - k, the
  // loss node's forward and backward the middle two), then the optimizer (2K + 1). Buffers live
  // from the phase that writes them to the last that reads them, so the arena shares memory
  // between any two never live together, within a block as well as across blocks.
  int node_count() const { return static_cast<int>(nodes.size()); }
  int fwd_phase(int node) const { return node + 1; }
  int bwd_phase(int node) const { return 2 * node_count() - node; }
  int optimizer_phase() const { return 2 * node_count() + 1; }
  std::string phase_name(int p) const;
  void add_node(std::unique_ptr<Node> n);
  void finish();
  void build();
  void plan_buffers(ArenaPlan& plan);
};

// One op of the network. ins are read by the forward, outs written (the first out is the op's
// result; others are saved statistics); bwd_reads are what the backward reads besides the
// gradients of outs. acc[i]: the backward adds into ins[i]'s gradient instead of writing it.
struct Node {
  virtual ~Node() = default;
  std::string name;
  int block = 0;
  int index = 0;  // in the node list: its phases are fwd_phase(index) and bwd_phase(index)
  std::vector<int> ins, outs, bwd_reads;
  std::vector<bool> acc;
  std::vector<int> recomputes;  // tensors recomputed just before this node's backward
  train::ParamId p_first = -1, p_last = -1;
  OpClass op_class = OpClass::kPointwise;  // --op-times
  virtual void forward(UnetModel::Impl& m, cudaStream_t s) = 0;
  virtual void backward(UnetModel::Impl& m, cudaStream_t s) = 0;
  // Writes outs[0] again into its recompute buffer: the forward's kernel on the same inputs.
  virtual bool recomputable() const { return false; }
  virtual void recompute(UnetModel::Impl&, cudaStream_t) {}
  virtual double flops() const { return 0; }  // forward and backward
  // --op-times: the bytes of activations and gradients a forward (backward false) or backward
  // must move to or from memory at the least (each tensor read or written once, 16-bit storage;
  // parameters, statistics and per-channel sums left out); 0 where the op is counted in FLOPs.
  virtual double bytes(const UnetModel::Impl&, bool /*backward*/) const { return 0; }
};

// Bytes of `count` tensors' elements each.
double elements(const UnetModel::Impl& m, int t) {
  return static_cast<double>(m.tensors[static_cast<size_t>(t)].numel());
}

void UnetModel::Impl::poison_after(int phase, cudaStream_t s) {
  if (dead_after.empty()) {
    dead_after.resize(static_cast<size_t>(optimizer_phase() + 1));
    auto add = [this](int end, void* ptr, int64_t numel, DType dtype) {
      if (ptr == nullptr || end < 1 || end > optimizer_phase()) return;
      dead_after[static_cast<size_t>(end)].emplace_back(
          ptr, static_cast<size_t>(numel) * dtype_size(dtype));
    };
    for (const Tensor& t : tensors) {
      if (!t.external) add(t.end, t.data, t.numel(), t.dtype);
      if (t.gid >= 0) add(t.gend, t.gdata, t.numel(), t.dtype);
      if (t.rid >= 0) add(t.rend, t.rdata, t.numel(), t.dtype);
    }
  }
  for (const auto& [ptr, bytes] : dead_after[static_cast<size_t>(phase)])
    REPLAY_CUDA_CHECK(cudaMemsetAsync(ptr, 0xFF, bytes, s));
}

void UnetModel::Impl::recompute_for(Node& n, cudaStream_t s) {
  for (int t : n.recomputes) {
    Node& p = *nodes[static_cast<size_t>(T(t).producer)];
    p.recompute(*this, s);
    if (timer) timer->mark(static_cast<int>(p.op_class), s, p.index);
  }
}

std::string UnetModel::Impl::phase_name(int p) const {
  const int K = node_count();
  if (p == optimizer_phase()) return "optimizer";
  if (p >= 1 && p <= K) return nodes[static_cast<size_t>(p - 1)]->name + ".fwd";
  if (p > K && p <= 2 * K) return nodes[static_cast<size_t>(2 * K - p)]->name + ".bwd";
  return p == Lifetime::kForever ? "end" : "phase " + std::to_string(p);
}

namespace {

using Impl = UnetModel::Impl;

void* W(Impl& m, train::ParamId id) {
  return m.params.weight(id);
}
float* G(Impl& m, train::ParamId id) {
  return m.params.grad(id);
}

// The gradient of an input: straight into its buffer, or via the scratch and an addition.
struct GradTarget {
  void* ptr;
  bool via_scratch;
};
GradTarget grad_target(Impl& m, const Node& n, size_t i) {
  Tensor& t = m.T(n.ins[i]);
  if (n.acc[i]) {
    REPLAY_REQUIRE(t.numel() <= m.scratch_elements, "gradient scratch too small for " + t.name);
    return {m.scratch, true};
  }
  return {t.gdata, false};
}
void finish_grad(Impl& m, const Node& n, size_t i, const GradTarget& g, cudaStream_t s) {
  if (!g.via_scratch) return;
  Tensor& t = m.T(n.ins[i]);
  add_into(t.dtype, t.gdata, m.scratch, t.numel(), s);
}
// dy passed through unchanged (an addition's backward).
void pass_grad(Impl& m, const Node& n, size_t i, const void* dy, cudaStream_t s) {
  Tensor& t = m.T(n.ins[i]);
  if (!t.grad) return;
  if (n.acc[i]) {
    add_into(t.dtype, t.gdata, dy, t.numel(), s);
  } else {
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(t.gdata, dy, static_cast<size_t>(t.numel()) * 2,
                                      cudaMemcpyDeviceToDevice, s));
  }
}

// The bytes pass_grad moves: a copy, or an addition into the gradient; nothing without one.
double pass_bytes(const Impl& m, const Node& n, size_t i) {
  if (!m.tensors[static_cast<size_t>(n.ins[i])].grad) return 0;
  return 2.0 * elements(m, n.ins[i]) * (n.acc[i] ? 3.0 : 2.0);
}

// The deterministic attention backward's workspace, about B x heads x Sq x Skv x 2 bytes (5122.5
// MiB measured for SD2's largest at 32 images against 5120 estimated).
size_t attention_backward_workspace_estimate(const AttentionDesc& d) {
  return static_cast<size_t>(d.batch * d.heads_q * d.seq_q * d.kv_len() * 2);
}

struct ConvNode : Node {
  ConvDesc d;
  const ConvPlan *fwd = nullptr, *dgrad = nullptr, *wgrad = nullptr;
  bool fp32_dw = false, has_dgrad = false;
  train::ParamId w = -1, b = -1;
  void forward(Impl& m, cudaStream_t s) override {
    ConvArgs a;
    a.x = m.T(ins[0]).data, a.w = W(m, w), a.bias = W(m, b), a.y = m.T(outs[0]).data;
    fwd->execute(*m.ctx, s, a, m.conv_ws, m.conv_ws_bytes);
    if (!fwd->bias_fused())
      conv_bias_add(d.dtype, a.y, a.bias, d.batch * d.out_height() * d.out_width(), d.out_channels,
                    s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    const void* dy = m.T(outs[0]).gdata;
    ConvArgs wa;
    wa.dy = dy, wa.x = m.T(ins[0]).bdata(), wa.dw = fp32_dw ? static_cast<void*>(G(m, w)) : m.dw16;
    wgrad->execute(*m.ctx, s, wa, m.conv_ws, m.conv_ws_bytes);
    if (!fp32_dw) to_float(d.dtype, G(m, w), m.dw16, d.w_elements(), s);
    conv_bias_grad(d.dtype, G(m, b), dy, d.batch * d.out_height() * d.out_width(), d.out_channels,
                   false, m.bias_ws, m.bias_ws_bytes, s);
    if (dgrad == nullptr) return;
    const GradTarget g = grad_target(m, *this, 0);
    ConvArgs da;
    da.dy = dy, da.w = W(m, w), da.dx = g.ptr;
    dgrad->execute(*m.ctx, s, da, m.conv_ws, m.conv_ws_bytes);
    finish_grad(m, *this, 0, g, s);
  }
  double flops() const override { return d.flops() * (has_dgrad ? 3.0 : 2.0); }
};

struct GroupNormNode : Node {  // outs: y, mean, rstd
  GroupNormShape shape;
  float eps = 1e-5f;
  GroupNormAct act = GroupNormAct::kNone;
  train::ParamId gamma = -1, beta = -1;
  // A LayerNorm (one group over one token, no SiLU) runs the row kernels of layer_norm.h: a warp a
  // token, instead of the GroupNorm kernels' block a sample (here, a token of 320 to 1280 values).
  bool rows() const {
    return shape.pixels == 1 && shape.groups == 1 && act == GroupNormAct::kNone &&
           shape.channels <= kLayerNormMaxChannels;
  }
  // The GroupNorm kernels put samples on the grid's y dimension (at most 65,535): a norm over more
  // samples runs in chunks of kChunk samples, the parameter gradients added chunk after chunk.
  static constexpr int64_t kChunk = 32768;
  GroupNormShape chunk(int64_t first) const {
    GroupNormShape c = shape;
    c.batch = std::min(kChunk, shape.batch - first);
    return c;
  }
  void run_forward(Impl& m, void* y, float* mean, float* rstd, cudaStream_t s) const {
    if (rows()) {
      layer_norm_forward(m.config.dtype, y, mean, rstd, m.T(ins[0]).data, W(m, gamma), W(m, beta),
                         shape.batch, shape.channels, eps, s);
      return;
    }
    const int64_t row = shape.pixels * shape.channels * 2;  // bytes of one sample
    for (int64_t n = 0; n < shape.batch; n += kChunk) {
      group_norm_forward(m.config.dtype, static_cast<char*>(y) + n * row, mean + n * shape.groups,
                         rstd + n * shape.groups,
                         static_cast<const char*>(m.T(ins[0]).data) + n * row, W(m, gamma),
                         W(m, beta), chunk(n), eps, act, m.gn_ws, m.gn_ws_bytes, s);
    }
  }
  void forward(Impl& m, cudaStream_t s) override {
    run_forward(m, m.T(outs[0]).data, static_cast<float*>(m.T(outs[1]).data),
                static_cast<float*>(m.T(outs[2]).data), s);
  }
  // The same launches on the same x, gamma and beta: the same y, bit for bit (the statistics,
  // equal to the saved ones, go to a scratch).
  bool recomputable() const override { return true; }
  void recompute(Impl& m, cudaStream_t s) override {
    const int64_t stats = shape.batch * shape.groups;
    REPLAY_REQUIRE(2 * stats <= m.rstats_elements, name + ": recompute statistics scratch");
    run_forward(m, m.T(outs[0]).rdata, m.rstats, m.rstats + stats, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    if (rows()) {
      layer_norm_backward(m.config.dtype, m.T(ins[0]).gdata, G(m, gamma), G(m, beta),
                          m.T(outs[0]).gdata, m.T(ins[0]).bdata(), W(m, gamma),
                          static_cast<const float*>(m.T(outs[1]).data),
                          static_cast<const float*>(m.T(outs[2]).data), shape.batch, shape.channels,
                          acc[0], false, m.gn_ws, m.gn_ws_bytes, s);
      return;
    }
    const int64_t row = shape.pixels * shape.channels * 2;
    for (int64_t n = 0; n < shape.batch; n += kChunk) {
      group_norm_backward(
          m.config.dtype, static_cast<char*>(m.T(ins[0]).gdata) + n * row, G(m, gamma), G(m, beta),
          static_cast<const char*>(m.T(outs[0]).gdata) + n * row,
          static_cast<const char*>(m.T(ins[0]).bdata()) + n * row, W(m, gamma), W(m, beta),
          static_cast<const float*>(m.T(outs[1]).data) + n * shape.groups,
          static_cast<const float*>(m.T(outs[2]).data) + n * shape.groups, chunk(n), act, acc[0],
          n > 0, m.gn_ws, m.gn_ws_bytes, s);
    }
  }
  // Forward: x read, y written. Backward: x and dy read, dx written (and read where it is added
  // to).
  double bytes(const Impl&, bool backward) const override {
    const auto e = static_cast<double>(shape.elements());
    return 2.0 * e * (backward ? 3.0 + (acc[0] ? 1.0 : 0.0) : 2.0);
  }
};

struct LinearNode : Node {
  int64_t rows = 0, in = 0, out = 0;
  GemmPlan *fwd = nullptr, *dgrad = nullptr, *dgrad_acc = nullptr, *wgrad = nullptr;
  bool has_dgrad = false;
  train::ParamId w = -1, b = -1;
  void run(Impl& m, GemmPlan* p, GemmArgs a, cudaStream_t s) const {
    a.workspace = m.gemm_ws, a.workspace_bytes = m.gemm_ws_bytes;
    p->run(s, a);
  }
  void forward(Impl& m, cudaStream_t s) override {
    GemmArgs a;
    a.a = m.T(ins[0]).data, a.b = W(m, w), a.d = m.T(outs[0]).data;
    if (b >= 0) a.bias = W(m, b);
    run(m, fwd, a, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    const void* dy = m.T(outs[0]).gdata;
    GemmArgs wa;  // dW = dY^T X, db = column sums of dY
    wa.a = dy, wa.b = m.T(ins[0]).bdata(), wa.d = G(m, w);
    if (b >= 0) wa.bias_grad = G(m, b);
    run(m, wgrad, wa, s);
    if (!m.T(ins[0]).grad) return;
    GemmArgs da;  // dX (+)= dY W
    da.a = dy, da.b = W(m, w), da.d = m.T(ins[0]).gdata;
    run(m, acc[0] ? dgrad_acc : dgrad, da, s);
  }
  double flops() const override {
    return 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out) *
           (has_dgrad ? 3.0 : 2.0);
  }
};

struct SiluNode : Node {
  void forward(Impl& m, cudaStream_t s) override {
    silu_forward(m.T(ins[0]).dtype, m.T(outs[0]).data, m.T(ins[0]).data, m.T(ins[0]).numel(), s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    Tensor& x = m.T(ins[0]);
    silu_backward(x.dtype, x.gdata, m.T(outs[0]).gdata, x.bdata(), x.numel(), acc[0], s);
  }
  double bytes(const Impl& m, bool backward) const override {
    return 2.0 * elements(m, ins[0]) * (backward ? 3.0 + (acc[0] ? 1.0 : 0.0) : 2.0);
  }
};

struct AddNode : Node {
  void forward(Impl& m, cudaStream_t s) override {
    Tensor& y = m.T(outs[0]);
    add(y.dtype, y.data, m.T(ins[0]).data, m.T(ins[1]).data, y.numel(), s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    const void* dy = m.T(outs[0]).gdata;
    pass_grad(m, *this, 0, dy, s);
    pass_grad(m, *this, 1, dy, s);
  }
  double bytes(const Impl& m, bool backward) const override {
    return backward ? pass_bytes(m, *this, 0) + pass_bytes(m, *this, 1)
                    : 2.0 * 3.0 * elements(m, outs[0]);
  }
};

struct ChannelBiasNode : Node {  // ins: h [N * P, C], t [N, C]
  int64_t batch = 0, pixels = 0, channels = 0;
  void forward(Impl& m, cudaStream_t s) override {
    channel_bias_forward(m.config.dtype, m.T(outs[0]).data, m.T(ins[0]).data, m.T(ins[1]).data,
                         batch, pixels, channels, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    const void* dy = m.T(outs[0]).gdata;
    pass_grad(m, *this, 0, dy, s);
    REPLAY_REQUIRE(!acc[1], name + ": the timestep bias is read once");
    channel_bias_backward(m.config.dtype, m.T(ins[1]).gdata, dy, batch, pixels, channels,
                          m.cbias_ws, m.cbias_ws_bytes, s);
  }
  // Forward: h read, y written. Backward: dh passed on, dy read again for the bias sums.
  double bytes(const Impl& m, bool backward) const override {
    const double e = elements(m, outs[0]);
    return backward ? pass_bytes(m, *this, 0) + 2.0 * e : 2.0 * 2.0 * e;
  }
};

struct UpsampleNode : Node {
  UpsampleShape shape;
  void forward(Impl& m, cudaStream_t s) override {
    upsample_nearest2x_forward(m.config.dtype, m.T(outs[0]).data, m.T(ins[0]).data, shape, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    const GradTarget g = grad_target(m, *this, 0);
    upsample_nearest2x_backward(m.config.dtype, g.ptr, m.T(outs[0]).gdata, shape, s);
    finish_grad(m, *this, 0, g, s);
  }
  double bytes(const Impl& m, bool backward) const override {
    const double e = elements(m, ins[0]) + elements(m, outs[0]);
    return 2.0 * (backward && acc[0] ? e + 3.0 * elements(m, ins[0]) : e);
  }
};

struct ConcatNode : Node {
  int64_t rows = 0;
  int ca = 0, cb = 0;
  void forward(Impl& m, cudaStream_t s) override {
    concat_channels_forward(m.config.dtype, m.T(outs[0]).data, m.T(ins[0]).data, ca,
                            m.T(ins[1]).data, cb, rows, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    concat_channels_backward(m.config.dtype, m.T(ins[0]).gdata, m.T(ins[1]).gdata,
                             m.T(outs[0]).gdata, ca, cb, rows, acc[0], acc[1], s);
  }
  double bytes(const Impl& m, bool backward) const override {
    double e = 2.0 * elements(m, outs[0]);  // the parts read and the whole written, or back
    if (backward) e += (acc[0] ? elements(m, ins[0]) : 0.0) + (acc[1] ? elements(m, ins[1]) : 0.0);
    return 2.0 * e;
  }
};

// Self-attention over a fused QKV tensor [N * S, 3C] (ins[0]); or cross-attention, ins q [N * S,
// C], k and v [N * L, C]. outs: o [N * S, C], stats.
struct AttentionNode : Node {
  const AttentionPlan* plan = nullptr;
  AttentionDesc desc;
  bool fused = true;
  // Each call's own workspace, live only during that call (the deterministic backward's is about
  // B x heads x Sq x Skv x 2 bytes: 10 GiB for SD2's 4096-token self-attention at 64 images), so
  // the arena gives it memory other buffers use the rest of the step. Sizes from the plan; on the
  // CPU (no plan) the backward's estimated, the forward's 0.
  size_t ws_fwd_bytes = 0, ws_bwd_bytes = 0;
  BufferId ws_fwd_id = -1, ws_bwd_id = -1;
  void *ws_fwd = nullptr, *ws_bwd = nullptr;
  TensorView workspace_view(bool backward) const {
    return backward ? TensorView(ws_bwd, DType::kUINT8, {static_cast<int64_t>(ws_bwd_bytes)})
                    : TensorView(ws_fwd, DType::kUINT8, {static_cast<int64_t>(ws_fwd_bytes)});
  }
  void forward(Impl& m, cudaStream_t s) override {
    plan->forward(*m.ctx, s, io(m, false), RngArgs{}, ws_fwd, ws_fwd_bytes);
  }
  AttentionIO io(Impl& m, bool backward) const {
    const AttentionDesc& d = plan->desc();
    auto data = [&m, backward](int t) { return backward ? m.T(t).bdata() : m.T(t).data; };
    AttentionIO a;
    a.o = data(outs[0]), a.stats = static_cast<float*>(m.T(outs[1]).data);
    if (fused) {
      char* qkv = static_cast<char*>(data(ins[0]));
      a.q = qkv, a.k = qkv + d.k_offset() * 2, a.v = qkv + d.v_offset() * 2;
    } else {
      a.q = data(ins[0]), a.k = data(ins[1]), a.v = data(ins[2]);
    }
    return a;
  }
  void backward(Impl& m, cudaStream_t s) override {
    const AttentionDesc& d = plan->desc();
    for (size_t i = 0; i < ins.size(); ++i)
      REPLAY_REQUIRE(!acc[i], name + ": attention inputs are read once");
    AttentionGrads g;
    g.d_o = m.T(outs[0]).gdata;
    if (fused) {
      char* dqkv = static_cast<char*>(m.T(ins[0]).gdata);
      g.dq = dqkv, g.dk = dqkv + d.k_offset() * 2, g.dv = dqkv + d.v_offset() * 2;
    } else {
      g.dq = m.T(ins[0]).gdata, g.dk = m.T(ins[1]).gdata, g.dv = m.T(ins[2]).gdata;
    }
    plan->backward(*m.ctx, s, io(m, true), g, RngArgs{}, ws_bwd, ws_bwd_bytes);
  }
  double flops() const override {
    const AttentionDesc& d = desc;
    // QK^T and PV forward; dV, dP, dQ, dK (and the recomputed QK^T) backward: 3.5x the forward.
    return 3.5 * 4.0 * static_cast<double>(d.batch * d.heads_q * d.seq_q * d.kv_len()) *
           static_cast<double>(d.head_dim_qk);
  }
};

struct GegluNode : Node {
  int64_t rows = 0;
  int f = 0;
  void forward(Impl& m, cudaStream_t s) override {
    geglu_forward(m.config.dtype, m.T(outs[0]).data, m.T(ins[0]).data, rows, f, s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    REPLAY_REQUIRE(!acc[0], name + ": the GEGLU projection is read once");
    geglu_backward(m.config.dtype, m.T(ins[0]).gdata, m.T(outs[0]).gdata, m.T(ins[0]).bdata(), rows,
                   f, s);
  }
  // The same kernel on the same projection: the same output, bit for bit.
  bool recomputable() const override { return true; }
  void recompute(Impl& m, cudaStream_t s) override {
    geglu_forward(m.config.dtype, m.T(outs[0]).rdata, m.T(ins[0]).data, rows, f, s);
  }
  // Forward: the projection [rows, 2f] read, [rows, f] written. Backward: dy and the projection
  // read, its gradient written.
  double bytes(const Impl& m, bool backward) const override {
    const double in = elements(m, ins[0]), out = elements(m, outs[0]);
    return 2.0 * (backward ? out + 2.0 * in : in + out);
  }
};

// The diffusion objective's inputs: latents from the moments, timesteps, noise; the noisy latent,
// the v-target and the timesteps (outs).
struct SampleNode : Node {
  LatentShape shape;
  void forward(Impl& m, cudaStream_t s) override {
    diffusion_sample(m.config.dtype, m.T(outs[0]).data, static_cast<float*>(m.T(outs[1]).data),
                     static_cast<int32_t*>(m.T(outs[2]).data),
                     static_cast<const __half*>(m.T(ins[0]).data), m.table, shape, 0, m.sample_rng,
                     s);
  }
  void backward(Impl&, cudaStream_t) override {}
};

struct TimestepNode : Node {
  int64_t batch = 0;
  TimestepEmbeddingConfig config;
  void forward(Impl& m, cudaStream_t s) override {
    timestep_embedding(m.config.dtype, m.T(outs[0]).data,
                       static_cast<const int32_t*>(m.T(ins[0]).data), batch, config, s);
  }
  void backward(Impl&, cudaStream_t) override {}
};

// The loss: mean squared error against the v-target; its gradient scaled by the loss scale, and
// made infinite at step overflow_at (--overflow-at).
struct LossNode : Node {
  LatentShape shape;
  void forward(Impl& m, cudaStream_t s) override {
    mse_loss_forward(m.config.dtype, m.io.loss, nullptr, m.T(ins[0]).data,
                     static_cast<const float*>(m.T(ins[1]).data), shape, m.loss_ws, m.loss_ws_bytes,
                     s);
  }
  void backward(Impl& m, cudaStream_t s) override {
    Tensor& p = m.T(ins[0]);
    mse_loss_backward(m.config.dtype, p.gdata, p.bdata(),
                      static_cast<const float*>(m.T(ins[1]).data), m.io.loss_scale, shape, s);
    if (m.overflow_at >= 0) poison_at(m.config.dtype, p.gdata, m.iteration, m.overflow_at, s);
  }
};

// ---- Building the network
// -------------------------------------------------------------------------

struct Builder {
  Impl& m;
  DType dt;
  int64_t N;

  train::ParamId param(const std::string& name, std::vector<int64_t> shape, train::ParamInit init,
                       double fan_in, bool decay) {
    train::ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.init = init;
    p.stddev = init == train::ParamInit::kNormal ? static_cast<float>(1.0 / std::sqrt(fan_in)) : 0;
    p.weight_decay = decay;
    return m.params.add(p);
  }
  template <typename N_>
  N_* node(const std::string& name, std::vector<int> ins, std::vector<int> outs) {
    auto n = std::make_unique<N_>();
    n->name = name;
    n->ins = std::move(ins);
    n->outs = std::move(outs);
    N_* raw = n.get();
    m.add_node(std::move(n));
    return raw;
  }

  // x [N * H * W, Cin] -> [N * P * Q, Cout]. zero: weight and bias start at zero (the reference's
  // zero_module: a residual block's second convolution, conv_out).
  int conv(const std::string& name, int x, int64_t H, int64_t cin, int64_t cout, int64_t kernel,
           int64_t stride, bool zero = false) {
    ConvDesc d;
    d.batch = N, d.height = H, d.width = H, d.in_channels = cin, d.out_channels = cout;
    d.kernel = kernel, d.stride = stride, d.padding = kernel / 2, d.dtype = dt, d.bias = true;
    const int y = m.tensor(name, dt, N * d.out_height() * d.out_width(), cout, true);
    auto* n = node<ConvNode>(name, {x}, {y});
    n->bwd_reads = {x};  // the weight gradient reads the input
    n->d = d;
    n->w = param(name + ".weight", {cout, kernel, kernel, cin},
                 zero ? train::ParamInit::kZeros : train::ParamInit::kNormal,
                 static_cast<double>(cin * kernel * kernel), true);
    n->b = param(name + ".bias", {cout}, train::ParamInit::kZeros, 1, false);
    n->p_first = n->w, n->p_last = n->b;
    d.validate();
    n->has_dgrad = m.T(x).grad;
    if (m.ctx == nullptr) return y;
    n->fwd = &m.convs.get(*m.ctx, d, ConvKind::kForward);
    if (m.T(x).grad) n->dgrad = &m.convs.get(*m.ctx, d, ConvKind::kDataGrad);
    ConvDesc w32 = d;
    w32.fp32_weight_grad = true;
    try {
      n->wgrad = &m.convs.get(*m.ctx, w32, ConvKind::kWeightGrad);
      n->fp32_dw = true;
    } catch (const Error&) {  // no deterministic fp32-dw engine: 16-bit dw, then a cast
      n->wgrad = &m.convs.get(*m.ctx, d, ConvKind::kWeightGrad);
      m.dw16_elements = std::max(m.dw16_elements, d.w_elements());
    }
    m.bias_ws_bytes = std::max(m.bias_ws_bytes, conv_bias_grad_workspace_bytes(m.T(y).rows, cout));
    if (m.T(x).grad) m.scratch_elements = std::max(m.scratch_elements, m.T(x).numel());
    return y;
  }

  // GroupNorm(+SiLU) over [batch, pixels, C]; LayerNorm is one group over one token (pixels 1).
  int norm(const std::string& name, int x, int64_t batch, int64_t pixels, int64_t C, int groups,
           float eps, bool silu) {
    const int y = m.tensor(name, dt, batch * pixels, C, true);
    const int mean = m.tensor(name + ".mean", DType::kFP32, batch, groups, false);
    const int rstd = m.tensor(name + ".rstd", DType::kFP32, batch, groups, false);
    auto* n = node<GroupNormNode>(name, {x}, {y, mean, rstd});
    n->bwd_reads = {x, mean, rstd};
    n->shape = GroupNormShape{batch, pixels, static_cast<int>(C), groups};
    n->eps = eps;
    n->act = silu ? GroupNormAct::kSilu : GroupNormAct::kNone;
    n->gamma = param(name + ".weight", {C}, train::ParamInit::kOnes, 1, false);
    n->beta = param(name + ".bias", {C}, train::ParamInit::kZeros, 1, false);
    n->p_first = n->gamma, n->p_last = n->beta;
    if (n->rows()) {
      m.gn_ws_bytes =
          std::max(m.gn_ws_bytes, layer_norm_backward_workspace_bytes(batch * pixels, C));
      return y;
    }
    const GroupNormShape first = n->chunk(0);
    check_group_norm_shape(first);
    m.gn_ws_bytes = std::max({m.gn_ws_bytes, group_norm_forward_workspace_bytes(first),
                              group_norm_backward_workspace_bytes(first)});
    return y;
  }

  // zero: weight (and bias) start at zero (the reference's zero_module: proj_out).
  int linear(const std::string& name, int x, int64_t in, int64_t out, bool bias,
             bool zero = false) {
    const int64_t rows = m.T(x).rows;
    const int y = m.tensor(name, dt, rows, out, true);
    auto* n = node<LinearNode>(name, {x}, {y});
    n->bwd_reads = {x};
    n->rows = rows, n->in = in, n->out = out;
    n->w = param(name + ".weight", {out, in},
                 zero ? train::ParamInit::kZeros : train::ParamInit::kNormal,
                 static_cast<double>(in), true);
    n->p_first = n->p_last = n->w;
    if (bias) {
      n->b = param(name + ".bias", {out}, train::ParamInit::kZeros, 1, false);
      n->p_last = n->b;
    }
    n->has_dgrad = m.T(x).grad;
    if (!m.gemms) return y;
    LinearGemms g = linear_gemms(rows, in, out, bias, false);
    for (GemmDesc* d : {&g.forward, &g.dgrad, &g.wgrad}) d->a_type = d->b_type = dt;
    g.forward.d_type = g.dgrad.d_type = dt;
    if (bias) g.forward.bias_type = dt;
    n->fwd = &m.gemms->get(g.forward);
    n->wgrad = &m.gemms->get(g.wgrad);
    if (m.T(x).grad) {
      n->dgrad = &m.gemms->get(g.dgrad);
      GemmDesc acc = g.dgrad;
      acc.beta = 1.0f;
      n->dgrad_acc = &m.gemms->get(acc);
    }
    return y;
  }

  int silu(const std::string& name, int x) {
    const int y = m.tensor(name, dt, m.T(x).rows, m.T(x).cols, true);
    node<SiluNode>(name, {x}, {y})->bwd_reads = {x};
    return y;
  }
  int sum(const std::string& name, int a, int b) {
    REPLAY_REQUIRE(m.T(a).numel() == m.T(b).numel(), name + ": shapes differ");
    const int y = m.tensor(name, dt, m.T(a).rows, m.T(a).cols, true);
    node<AddNode>(name, {a, b}, {y});
    return y;
  }

  int resnet(const std::string& p, int x, int64_t H, int64_t cin, int64_t cout, int temb) {
    const int64_t P = H * H;
    const int g = m.config.groups;
    int h = norm(p + ".norm1", x, N, P, cin, g, 1e-5f, true);
    h = conv(p + ".conv1", h, H, cin, cout, 3, 1);
    const int t = linear(p + ".time_emb_proj", temb, m.config.time_dim(), cout, true);
    const int hb = m.tensor(p + ".conv1_temb", dt, N * P, cout, true);
    auto* cb = node<ChannelBiasNode>(p + ".temb_add", {h, t}, {hb});
    cb->batch = N, cb->pixels = P, cb->channels = cout;
    m.cbias_ws_bytes =
        std::max(m.cbias_ws_bytes, channel_bias_backward_workspace_bytes(N, P, cout));
    h = norm(p + ".norm2", hb, N, P, cout, g, 1e-5f, true);
    h = conv(p + ".conv2", h, H, cout, cout, 3, 1, true);
    const int shortcut = cin == cout ? x : conv(p + ".conv_shortcut", x, H, cin, cout, 1, 1);
    return sum(p + ".out", shortcut, h);
  }

  int attention_node(const std::string& name, std::vector<int> ins, int64_t S, int64_t kv,
                     int64_t C, bool fused) {
    AttentionDesc d;
    d.batch = N, d.heads_q = d.heads_kv = C / m.config.head_dim, d.seq_q = S, d.seq_kv = kv;
    d.head_dim_qk = m.config.head_dim, d.dtype = dt;
    d.layout = fused ? AttentionLayout::kFusedQKV : AttentionLayout::kSeparate;
    const int o = m.tensor(name, dt, N * S, C, true);
    const int stats = m.tensor(name + ".stats", DType::kFP32, N * d.heads_q, S, false);
    auto* n = node<AttentionNode>(name, std::move(ins), {o, stats});
    n->bwd_reads = n->ins;
    n->bwd_reads.push_back(o);
    n->bwd_reads.push_back(stats);
    n->fused = fused;
    d.validate();
    n->desc = d;
    if (m.ctx) {
      n->plan = &m.attention.get(*m.ctx, d);
      n->ws_fwd_bytes = n->plan->forward_workspace_bytes();
      n->ws_bwd_bytes = n->plan->backward_workspace_bytes();
    } else {
      n->ws_bwd_bytes = attention_backward_workspace_estimate(d);
    }
    return o;
  }

  // The spatial transformer (diffusers' Transformer2DModel with use_linear_projection, one
  // BasicTransformerBlock): GroupNorm, proj_in, self-attention, cross-attention, GEGLU
  // feed-forward (each after a LayerNorm, each residual), proj_out, the outer residual.
  int transformer(const std::string& p, int x, int64_t H, int64_t C, int context) {
    const int64_t S = H * H, rows = N * S, L = m.config.context_len, D = m.config.context_dim;
    int h = norm(p + ".norm", x, N, S, C, m.config.groups, 1e-6f, false);
    h = linear(p + ".proj_in", h, C, C, true);
    const std::string b = p + ".transformer_blocks.0";
    int n1 = norm(b + ".norm1", h, rows, 1, C, 1, 1e-5f, false);
    const int qkv = linear(b + ".attn1.to_qkv", n1, C, 3 * C, false);
    int a = attention_node(b + ".attn1", {qkv}, S, S, C, true);
    a = linear(b + ".attn1.to_out.0", a, C, C, true);
    h = sum(b + ".attn1.residual", h, a);
    int n2 = norm(b + ".norm2", h, rows, 1, C, 1, 1e-5f, false);
    const int q = linear(b + ".attn2.to_q", n2, C, C, false);
    const int k = linear(b + ".attn2.to_k", context, D, C, false);
    const int v = linear(b + ".attn2.to_v", context, D, C, false);
    a = attention_node(b + ".attn2", {q, k, v}, S, L, C, false);
    a = linear(b + ".attn2.to_out.0", a, C, C, true);
    h = sum(b + ".attn2.residual", h, a);
    int n3 = norm(b + ".norm3", h, rows, 1, C, 1, 1e-5f, false);
    const int proj = linear(b + ".ff.net.0.proj", n3, C, 8 * C, true);
    const int ff = m.tensor(b + ".ff.geglu", dt, rows, 4 * C, true);
    auto* gg = node<GegluNode>(b + ".ff.geglu", {proj}, {ff});
    gg->bwd_reads = {proj};
    m.T(proj).grad_in_place = true;  // d(proj) over proj: geglu_backward reads before it writes
    gg->rows = rows, gg->f = static_cast<int>(4 * C);
    a = linear(b + ".ff.net.2", ff, 4 * C, C, true);
    h = sum(b + ".ff.residual", h, a);
    h = linear(p + ".proj_out", h, C, C, true, true);
    return sum(p + ".out", h, x);
  }
};

}  // namespace

void UnetModel::Impl::add_node(std::unique_ptr<Node> n) {
  n->block = block;
  n->index = static_cast<int>(nodes.size());
  const int id = static_cast<int>(nodes.size());
  for (int o : n->outs) {
    REPLAY_REQUIRE(T(o).producer < 0, "tensor " + T(o).name + " written twice");
    T(o).producer = id;
  }
  nodes.push_back(std::move(n));
}

void UnetModel::Impl::build() {
  const UnetConfig& c = config;
  Builder b{*this, c.dtype, c.batch};
  const int64_t N = c.batch, L = c.levels();
  const int64_t C0 = c.latent_channels;

  // Inputs the host fills: the moments [N, 2C, H, W] fp16 and the context [N * L, D].
  moments = tensor("batch.moments", DType::kFP16, N, 2 * C0 * c.latent * c.latent, false);
  context = tensor("batch.context", c.dtype, N * c.context_len, c.context_dim, false);
  T(moments).external = T(context).external = true;

  blocks.push_back("input");
  block = 0;
  const int noisy = tensor("noisy_latent", c.dtype, N * c.latent * c.latent, C0, false);
  v_target = tensor("v_target", DType::kFP32, N * c.latent * c.latent, C0, false);
  const int steps = tensor("timesteps", DType::kINT32, N, 1, false);
  auto* sample = b.node<SampleNode>("sample", {moments}, {noisy, v_target, steps});
  sample->shape = LatentShape{N, static_cast<int>(C0), c.latent, c.latent};
  check_latent_shape(sample->shape);
  const int tproj = tensor("time_proj", c.dtype, N, c.base, false);
  auto* ts = b.node<TimestepNode>("time_proj", {steps}, {tproj});
  ts->batch = N;
  ts->config.channels = static_cast<int>(c.base);
  int temb = b.linear("time_embedding.linear_1", tproj, c.base, c.time_dim(), true);
  temb = b.silu("time_embedding.act", temb);
  temb = b.linear("time_embedding.linear_2", temb, c.time_dim(), c.time_dim(), true);
  temb = b.silu("time_embedding.silu", temb);  // every residual block's projection reads it
  int h = b.conv("conv_in", noisy, c.latent, C0, c.base, 3, 1);

  struct Skip {
    int t;
    int64_t channels;
  };
  std::vector<Skip> skips{{h, c.base}};
  int64_t H = c.latent, ch = c.base;
  for (int l = 0; l < L; ++l) {
    blocks.push_back("down" + std::to_string(l));
    block = static_cast<int>(blocks.size()) - 1;
    const int64_t out = c.channels(l);
    for (int r = 0; r < c.res_blocks; ++r) {
      const std::string p = "down_blocks." + std::to_string(l);
      h = b.resnet(p + ".resnets." + std::to_string(r), h, H, ch, out, temb);
      ch = out;
      if (c.attention[static_cast<size_t>(l)])
        h = b.transformer(p + ".attentions." + std::to_string(r), h, H, ch, context);
      skips.push_back({h, ch});
    }
    if (l + 1 < L) {
      h = b.conv("down_blocks." + std::to_string(l) + ".downsamplers.0.conv", h, H, ch, ch, 3, 2);
      H /= 2;
      skips.push_back({h, ch});
    }
  }
  blocks.push_back("mid");
  block = static_cast<int>(blocks.size()) - 1;
  h = b.resnet("mid_block.resnets.0", h, H, ch, ch, temb);
  h = b.transformer("mid_block.attentions.0", h, H, ch, context);
  h = b.resnet("mid_block.resnets.1", h, H, ch, ch, temb);
  for (int u = 0; u < L; ++u) {
    const int l = static_cast<int>(L) - 1 - u;
    blocks.push_back("up" + std::to_string(u));
    block = static_cast<int>(blocks.size()) - 1;
    const int64_t out = c.channels(l);
    const std::string p = "up_blocks." + std::to_string(u);
    for (int r = 0; r <= c.res_blocks; ++r) {
      const Skip s = skips.back();
      skips.pop_back();
      const std::string q = p + ".resnets." + std::to_string(r);
      const int cat = tensor(q + ".cat", c.dtype, N * H * H, ch + s.channels, true);
      auto* cn = b.node<ConcatNode>(q + ".cat", {h, s.t}, {cat});
      cn->rows = N * H * H, cn->ca = static_cast<int>(ch), cn->cb = static_cast<int>(s.channels);
      h = b.resnet(q, cat, H, ch + s.channels, out, temb);
      ch = out;
      if (c.attention[static_cast<size_t>(l)])
        h = b.transformer(p + ".attentions." + std::to_string(r), h, H, ch, context);
    }
    if (u + 1 < L) {
      const int up = tensor(p + ".upsample", c.dtype, N * 4 * H * H, ch, true);
      auto* un = b.node<UpsampleNode>(p + ".upsample", {h}, {up});
      un->shape = UpsampleShape{N, H, H, static_cast<int>(ch)};
      H *= 2;
      h = b.conv(p + ".upsamplers.0.conv", up, H, ch, ch, 3, 1);
      scratch_elements = std::max(scratch_elements, T(h).numel());
    }
  }
  REPLAY_REQUIRE(skips.empty(), "UNet: unused skip connections");
  blocks.push_back("out");
  block = static_cast<int>(blocks.size()) - 1;
  h = b.norm("conv_norm_out", h, N, H * H, ch, c.groups, 1e-5f, true);
  pred = b.conv("conv_out", h, H, ch, C0, 3, 1, true);

  block = static_cast<int>(blocks.size());  // the loss
  auto* loss = b.node<LossNode>("loss", {pred, v_target}, {});
  loss->bwd_reads = {pred, v_target};
  loss->shape = LatentShape{N, static_cast<int>(C0), c.latent, c.latent};
  loss_ws_bytes = mse_loss_workspace_bytes(loss->shape);

  if (gemms) {
    gemms->seal();
    gemm_ws_bytes = gemms->max_workspace_bytes();
  }
  convs.seal();
  conv_ws_bytes = convs.max_workspace_bytes();
  attn_ws_bytes = attention.max_workspace_bytes();
  finish();
}

// Lifetimes and the write-or-add decision of every gradient, from the node list.
void UnetModel::Impl::finish() {
  for (auto& n : nodes) {
    const bool norm = dynamic_cast<const GroupNormNode*>(n.get()) != nullptr;
    const bool geglu = dynamic_cast<const GegluNode*>(n.get()) != nullptr;
    if ((norm && config.recompute_norms) || (geglu && config.recompute_geglu)) {
      REPLAY_REQUIRE(n->recomputable(), n->name + ": cannot be recomputed");
      T(n->outs[0]).recompute = true;
    }
  }
  for (Tensor& t : tensors) {
    if (t.external) continue;
    REPLAY_REQUIRE(t.producer >= 0, "tensor " + t.name + " has no producer");
    t.begin = t.end = fwd_phase(t.producer);
  }
  std::vector<bool> written(tensors.size(), false);
  for (size_t k = nodes.size(); k-- > 0;) {
    Node& n = *nodes[k];
    const int node = static_cast<int>(k);
    for (int i : n.ins) {
      Tensor& t = T(i);
      if (!t.external) t.end = std::max(t.end, fwd_phase(node));
    }
    for (int i : n.bwd_reads) {
      Tensor& t = T(i);
      if (t.external) continue;
      if (t.recompute) {
        t.rbegin = std::min(t.rbegin, bwd_phase(node));
        t.rend = std::max(t.rend, bwd_phase(node));
      } else {
        t.end = std::max(t.end, bwd_phase(node));
      }
    }
    for (int o : n.outs) {
      Tensor& t = T(o);
      if (!t.grad) continue;
      REPLAY_REQUIRE(written[static_cast<size_t>(o)],
                     "node " + n.name + ": nothing writes the gradient of " + t.name);
      t.gend = std::max(t.gend, bwd_phase(node));
    }
    n.acc.assign(n.ins.size(), false);
    for (size_t j = 0; j < n.ins.size(); ++j) {
      const int i = n.ins[j];
      Tensor& t = T(i);
      if (!t.grad) continue;
      n.acc[j] = written[static_cast<size_t>(i)];
      written[static_cast<size_t>(i)] = true;
      t.gbegin = std::min(t.gbegin, bwd_phase(node));
    }
  }
  // A gradient written in place over its data: the last read of the data and the first write of
  // the gradient are the same node's backward, and one buffer lives from the forward that writes
  // the data to the backward that reads the gradient last.
  for (Tensor& t : tensors) {
    if (!t.grad_in_place) continue;
    REPLAY_REQUIRE(t.grad && !t.recompute && !t.external && t.gbegin == t.end && t.gbegin <= t.gend,
                   t.name + ": the gradient cannot be written in place of the data");
    t.end = t.gend;
  }
  // Each recomputed tensor is filled again just before its first reader's backward (in backward
  // order), from its producer's inputs, which must still be live then.
  for (size_t i = 0; i < tensors.size(); ++i) {
    Tensor& t = tensors[i];
    if (!t.recompute) continue;
    if (t.rbegin > t.rend) {  // nothing in the backward reads it
      t.recompute = false;
      continue;
    }
    nodes[static_cast<size_t>(2 * node_count() - t.rbegin)]->recomputes.push_back(
        static_cast<int>(i));
    const Node& p = *nodes[static_cast<size_t>(t.producer)];
    for (int in : p.ins) {
      REPLAY_REQUIRE(!T(in).recompute, t.name + ": recomputed from a recomputed tensor");
      if (!T(in).external) T(in).end = std::max(T(in).end, t.rbegin);
    }
    if (const auto* g = dynamic_cast<const GroupNormNode*>(&p))
      rstats_elements = std::max(rstats_elements, 2 * g->shape.batch * g->shape.groups);
  }
  flops = 0;
  for (const auto& n : nodes) flops += n->flops();
  // The op class of each node (--op-times), from its type and, for a norm, its now-set shape.
  for (auto& n : nodes) {
    if (dynamic_cast<const ConvNode*>(n.get())) {
      n->op_class = OpClass::kConv;
    } else if (const auto* g = dynamic_cast<const GroupNormNode*>(n.get())) {
      n->op_class = g->shape.pixels == 1 ? OpClass::kLayerNorm : OpClass::kGroupNorm;
    } else if (dynamic_cast<const AttentionNode*>(n.get())) {
      n->op_class = OpClass::kAttention;
    } else if (dynamic_cast<const LinearNode*>(n.get())) {
      n->op_class = OpClass::kLinear;
    } else if (dynamic_cast<const SampleNode*>(n.get()) ||
               dynamic_cast<const TimestepNode*>(n.get()) ||
               dynamic_cast<const LossNode*>(n.get())) {
      n->op_class = OpClass::kDiffusion;
    }
  }
  // What each class computes and moves in a step (--op-times' rates): every node's forward and
  // backward, and the forward again of each recomputed tensor's producer.
  class_flops.fill(0);
  class_bytes.fill(0);
  for (const auto& n : nodes) {
    const auto c = static_cast<size_t>(n->op_class);
    class_flops[c] += n->flops();
    class_bytes[c] += n->bytes(*this, false) + n->bytes(*this, true);
    for (int t : n->recomputes) {
      const Node& p = *nodes[static_cast<size_t>(T(t).producer)];
      class_bytes[static_cast<size_t>(p.op_class)] += p.bytes(*this, false);
    }
  }
}

// ---- UnetModel
// ------------------------------------------------------------------------------------

UnetModel::UnetModel(const Context& ctx, const UnetConfig& config,
                     std::shared_ptr<const UnetData> data, int64_t overflow_at, uint64_t data_seed)
    : impl_(std::make_unique<Impl>(&ctx, config, std::move(data), overflow_at)) {
  config.validate();
  REPLAY_REQUIRE(impl_->data && impl_->data->samples >= config.batch,
                 "UNet: fewer training samples than one batch");
  impl_->build();
  const UnetData& d = *impl_->data;
  if (d.stream) {
    REPLAY_REQUIRE(d.shape.micro_batch == config.batch,
                   "UNet: the stream's batch is not the model's");
    LatentStreamOptions o;
    o.shuffle = true;
    o.seed = data_seed;
    o.num_samples = d.samples;
    o.text_bf16 = config.dtype == DType::kBF16;
    impl_->stream = std::make_unique<LatentStream>(d.info.path, d.shape, o);
    return;
  }
  impl_->order = std::make_unique<data::BatchOrder>(d.samples, config.batch, true, data_seed);
  impl_->rows.resize(static_cast<size_t>(config.batch));
  const size_t moments = d.moments.size() * 2, text = d.text.size() * 2;
  REPLAY_CUDA_CHECK(cudaHostAlloc(&impl_->host, moments + text, cudaHostAllocDefault));
  std::memcpy(impl_->host, d.moments.data(), moments);
  std::memcpy(static_cast<char*>(impl_->host) + moments, d.text.data(), text);
}

UnetModel::~UnetModel() {
  if (impl_ && impl_->timer) {
    try {
      write_op_times();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "--op-times: %s\n", e.what());
    }
    impl_->timer.reset();
  }
  if (impl_ && impl_->host) cudaFreeHost(impl_->host);
}

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::kConv:
      return "convolution";
    case OpClass::kGroupNorm:
      return "group_norm";
    case OpClass::kLayerNorm:
      return "layer_norm";
    case OpClass::kAttention:
      return "attention";
    case OpClass::kLinear:
      return "linear";
    case OpClass::kPointwise:
      return "pointwise";
    case OpClass::kDiffusion:
      return "diffusion";
  }
  return "?";
}

void UnetModel::time_ops(const std::string& path) {
  Impl& m = *impl_;
  REPLAY_REQUIRE(!path.empty(), "--op-times: no file");
  // One step's events: a start per region, one per node forward and one per node backward.
  const size_t pool = 2 * m.nodes.size() + 2 * m.blocks.size() + 8;
  m.timer = std::make_unique<OpTimer>(path, pool, m.nodes.size());
}

void UnetModel::poison_dead_buffers() {
  impl_->poison = true;
}

void UnetModel::write_op_times() {
  const Impl& m = *impl_;
  OpTimer& t = *m.timer;
  t.collect();
  std::FILE* f = std::fopen(t.path.c_str(), "w");
  if (f == nullptr) throw Error("replay-unet", "io", "--op-times: cannot write " + t.path);
  const double steps = static_cast<double>(std::max<int64_t>(t.steps, 1));
  double total = 0;
  for (double v : t.ms) total += v;
  std::fprintf(f,
               "{\n  \"steps\": %" PRId64 ",\n  \"steps_run\": %" PRId64
               ",\n  \"model_ms_per_step\": %.4f,\n",
               t.steps, t.started, total / steps);
  std::fprintf(f, "  \"classes\": {\n");
  for (int c = 0; c < kOpClasses; ++c) {
    const auto i = static_cast<size_t>(c);
    const double ms = t.ms[i] / steps;
    std::fprintf(f, "    \"%s\": {\"ms_per_step\": %.4f, \"calls_per_step\": %.1f",
                 op_class_name(static_cast<OpClass>(c)), ms,
                 static_cast<double>(t.calls[i]) / steps);
    // Achieved rates: the class's model FLOPs, or its least memory traffic, over its time.
    if (m.class_flops[i] > 0)
      std::fprintf(f, ", \"gflop_per_step\": %.3f, \"tflop_per_s\": %.2f", m.class_flops[i] / 1e9,
                   ms > 0 ? m.class_flops[i] / (ms * 1e9) : 0.0);
    if (m.class_bytes[i] > 0)
      std::fprintf(f, ", \"gb_per_step\": %.3f, \"gb_per_s\": %.1f", m.class_bytes[i] / 1e9,
                   ms > 0 ? m.class_bytes[i] / (ms * 1e6) : 0.0);
    std::fprintf(f, "}%s\n", c + 1 < kOpClasses ? "," : "");
  }
  // The nodes that took the most time (forward, backward and any recompute together), with the
  // rate each achieved: where a class's time goes, shape by shape.
  std::vector<size_t> order(m.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&t](size_t a, size_t b) { return t.node_ms[a] > t.node_ms[b]; });
  order.resize(std::min<size_t>(order.size(), OpTimer::kTopNodes));
  std::fprintf(f, "  },\n  \"top_nodes\": [\n");
  for (size_t k = 0; k < order.size(); ++k) {
    const Node& n = *m.nodes[order[k]];
    const double ms = t.node_ms[order[k]] / steps;
    const double flops = n.flops();
    double bytes = n.bytes(m, false) + n.bytes(m, true);
    if (!n.outs.empty() && m.tensors[static_cast<size_t>(n.outs[0])].recompute)
      bytes += n.bytes(m, false);
    std::fprintf(f, "    {\"node\": \"%s\", \"class\": \"%s\", \"ms_per_step\": %.4f",
                 n.name.c_str(), op_class_name(n.op_class), ms);
    if (flops > 0) std::fprintf(f, ", \"tflop_per_s\": %.2f", ms > 0 ? flops / (ms * 1e9) : 0.0);
    if (bytes > 0) std::fprintf(f, ", \"gb_per_s\": %.1f", ms > 0 ? bytes / (ms * 1e6) : 0.0);
    std::fprintf(f, "}%s\n", k + 1 < order.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  if (std::fclose(f) != 0) throw Error("replay-unet", "io", "--op-times: cannot write " + t.path);
  std::fprintf(stderr, "# op times: %s (%.1f ms of model ops a step over %" PRId64 " steps%s)\n",
               t.path.c_str(), total / steps, t.steps,
               t.started > t.steps ? ", the first step dropped" : "");
}

std::string UnetModel::describe() const {
  char buf[200];
  std::snprintf(buf, sizeof(buf), ", %.1fM parameters, %zu nodes in %zu blocks",
                static_cast<double>(impl_->params.total_numel()) / 1e6, impl_->nodes.size(),
                impl_->blocks.size());
  return impl_->config.describe() + buf;
}

train::ParamStore& UnetModel::params() {
  return impl_->params;
}
const train::ParamStore& UnetModel::params() const {
  return impl_->params;
}
int UnetModel::block_count() const {
  return static_cast<int>(impl_->blocks.size());
}
int64_t UnetModel::parameter_count() const {
  return impl_->params.total_numel();
}

namespace {

std::string gib_text(size_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// The kind of op that writes a tensor, for the memory report.
std::string producer_kind(const Node* n) {
  if (n == nullptr) return "input";
  if (dynamic_cast<const ConvNode*>(n)) return "convolution";
  if (const auto* g = dynamic_cast<const GroupNormNode*>(n))
    return g->shape.pixels == 1
               ? "layer_norm"
               : (g->act == GroupNormAct::kSilu ? "group_norm+silu" : "group_norm");
  if (dynamic_cast<const AttentionNode*>(n)) return "attention";
  if (dynamic_cast<const LinearNode*>(n)) return "linear";
  if (dynamic_cast<const GegluNode*>(n)) return "geglu";
  if (dynamic_cast<const AddNode*>(n)) return "add";
  if (dynamic_cast<const ChannelBiasNode*>(n)) return "timestep_bias";
  if (dynamic_cast<const ConcatNode*>(n)) return "concat";
  if (dynamic_cast<const UpsampleNode*>(n)) return "upsample";
  if (dynamic_cast<const SiluNode*>(n)) return "silu";
  return "diffusion";
}

// The arena's table, its peak phase and what is live there (UnetStructure::memory_report).
void memory_report(UnetModel::Impl& m, const ArenaPlan& plan, UnetStructure& s) {
  std::string out = plan.table(16);
  const int last = m.optimizer_phase();
  std::vector<size_t> live(static_cast<size_t>(last + 1), 0);
  for (const ArenaPlan::Entry& e : plan.entries())
    for (int p = 1; p <= last; ++p)
      if (e.life.begin <= p && p <= e.life.end) live[static_cast<size_t>(p)] += e.bytes;
  int peak = 1;
  for (int p = 1; p <= last; ++p)
    if (live[static_cast<size_t>(p)] > live[static_cast<size_t>(peak)]) peak = p;
  s.peak_live_bytes = live[static_cast<size_t>(peak)];
  s.peak_phase = m.phase_name(peak);
  auto alive = [peak](const Lifetime& l) { return l.begin <= peak && peak <= l.end; };
  char line[240];
  std::snprintf(line, sizeof(line),
                "peak: %s live at phase %d of %d (%s); the arena is %s (%.1f%% over the live "
                "bytes)\n",
                gib_text(s.peak_live_bytes).c_str(), peak, last, s.peak_phase.c_str(),
                gib_text(plan.total_bytes()).c_str(),
                100.0 * (static_cast<double>(plan.total_bytes()) /
                             static_cast<double>(std::max<size_t>(s.peak_live_bytes, 1)) -
                         1.0));
  out += line;
  std::map<std::string, size_t> groups, kinds;
  for (const ArenaPlan::Entry& e : plan.entries())
    if (alive(e.life)) groups[e.group] += e.bytes;
  for (const Tensor& t : m.tensors) {
    const Node* n = t.producer >= 0 ? m.nodes[static_cast<size_t>(t.producer)].get() : nullptr;
    if (t.id >= 0 && alive(plan.entry(t.id).life))
      kinds["saved " + producer_kind(n)] += plan.entry(t.id).bytes;
    if (t.gid >= 0 && alive(plan.entry(t.gid).life))
      kinds["gradient of " + producer_kind(n)] += plan.entry(t.gid).bytes;
  }
  out += "live at the peak, by group:\n";
  for (const auto& [g, b] : groups) {
    std::snprintf(line, sizeof(line), "  %-28s %12s\n", g.c_str(), gib_text(b).c_str());
    out += line;
  }
  out += "live activations and gradients at the peak, by the op that wrote them:\n";
  std::vector<std::pair<size_t, std::string>> sorted;
  for (const auto& [k, b] : kinds) sorted.emplace_back(b, k);
  std::sort(sorted.rbegin(), sorted.rend());
  for (const auto& [b, k] : sorted) {
    std::snprintf(line, sizeof(line), "  %-28s %12s\n", k.c_str(), gib_text(b).c_str());
    out += line;
  }
  std::vector<const ArenaPlan::Entry*> big;
  for (const ArenaPlan::Entry& e : plan.entries())
    if (alive(e.life) && e.life.end != Lifetime::kForever) big.push_back(&e);
  std::sort(big.begin(), big.end(), [](auto* a, auto* b) { return a->bytes > b->bytes; });
  out += "largest live buffers at the peak (lifetime):\n";
  for (size_t i = 0; i < big.size() && i < 12; ++i) {
    std::snprintf(line, sizeof(line), "  %-56.56s %10s  %s .. %s\n", big[i]->name.c_str(),
                  gib_text(big[i]->bytes).c_str(), m.phase_name(big[i]->life.begin).c_str(),
                  m.phase_name(big[i]->life.end).c_str());
    out += line;
  }
  s.memory_report = out;
}

}  // namespace

UnetStructure unet_structure(const UnetConfig& config) {
  config.validate();
  UnetModel::Impl m(nullptr, config, nullptr, -1);
  m.build();
  UnetStructure s;
  s.parameters = m.params.total_numel();
  s.blocks = static_cast<int>(m.blocks.size());
  s.nodes = static_cast<int>(m.nodes.size());
  s.flops_per_step = m.flops;
  for (int i = 0; i < m.params.count(); ++i) {
    s.parameter_names.push_back(m.params.spec(i).name);
    s.parameter_sizes.push_back(m.params.numel(i));
    s.parameter_init.push_back(m.params.spec(i).init);
  }
  s.nodes_per_class.assign(kOpClasses, 0);
  for (const auto& n : m.nodes) s.nodes_per_class[static_cast<size_t>(n->op_class)] += 1;
  s.flops_per_class.assign(m.class_flops.begin(), m.class_flops.end());
  s.bytes_per_class.assign(m.class_bytes.begin(), m.class_bytes.end());
  ArenaPlan plan;
  m.plan_buffers(plan);
  plan.plan();
  s.arena_bytes = plan.total_bytes();
  memory_report(m, plan, s);
  for (size_t k = 0; k < m.nodes.size(); ++k)
    if (const auto* c = dynamic_cast<const ConvNode*>(m.nodes[k].get())) {
      const Tensor& x = m.T(c->ins[0]);
      const int bwd = m.bwd_phase(static_cast<int>(k));
      const bool saved = x.recompute ? x.rbegin <= bwd && bwd <= x.rend : x.end >= bwd;
      if (!x.external && !saved) s.conv_inputs_dead_at_backward += 1;
    }
  const std::vector<ArenaPlan::Entry>& es = plan.entries();
  for (size_t i = 0; i < es.size(); ++i)
    for (size_t j = i + 1; j < es.size(); ++j)
      if (es[i].bytes > 0 && es[j].bytes > 0 && es[i].life.overlaps(es[j].life) &&
          es[i].offset < es[j].offset + es[j].bytes && es[j].offset < es[i].offset + es[i].bytes)
        s.overlapping_live_pairs += 1;
  for (const auto& n : m.nodes)
    if (const auto* a = dynamic_cast<const AttentionNode*>(n.get())) {
      const AttentionDesc& d = a->desc;
      s.attention_workspace_bytes =
          std::max(s.attention_workspace_bytes, attention_backward_workspace_estimate(d));
    }
  return s;
}

std::string UnetModel::plan_summary() const {
  char buf[320];
  std::snprintf(
      buf, sizeof(buf),
      "%zu convolution plans, %zu GEMM plans, %zu attention plans; workspaces: conv "
      "%.1f MiB, GEMM %.1f MiB, attention %.1f MiB (the largest; one per call), GroupNorm "
      "%.1f MiB",
      impl_->convs.size(), impl_->gemms->size(), impl_->attention.size(),
      static_cast<double>(impl_->conv_ws_bytes) / 1048576.0,
      static_cast<double>(impl_->gemm_ws_bytes) / 1048576.0,
      static_cast<double>(impl_->attn_ws_bytes) / 1048576.0,
      static_cast<double>(impl_->gn_ws_bytes) / 1048576.0);
  return buf;
}

void UnetModel::plan(ArenaPlan& plan) {
  impl_->plan_buffers(plan);
}

void UnetModel::Impl::plan_buffers(ArenaPlan& plan) {
  Impl& m = *this;
  m.params.plan(plan, {m.optimizer_phase(), m.optimizer_phase()});
  for (Tensor& t : m.tensors) {
    const Lifetime life = t.external ? Lifetime{} : Lifetime{t.begin, t.end};
    t.id = plan.add("unet." + t.name, t.dtype, t.numel(), "activations", life);
    if (t.grad && t.gbegin <= t.gend && !t.grad_in_place)
      t.gid =
          plan.add("unet.d." + t.name, t.dtype, t.numel(), "activation grads", {t.gbegin, t.gend});
    if (t.recompute)
      t.rid = plan.add("unet.r." + t.name, t.dtype, t.numel(), "recomputed", {t.rbegin, t.rend});
  }
  const Lifetime step{1, m.optimizer_phase() - 1};
  auto ws = [&](const char* name, size_t bytes) {
    return plan.add(std::string("unet.") + name, std::max<size_t>(bytes, 256), "workspaces", step);
  };
  m.gemm_ws_id = ws("gemm_workspace", m.gemm_ws_bytes);
  m.conv_ws_id = ws("conv_workspace", m.conv_ws_bytes);
  for (auto& n : m.nodes)
    if (auto* a = dynamic_cast<AttentionNode*>(n.get())) {
      const int k = a->index;
      a->ws_fwd_id = plan.add("unet.attention_workspace." + a->name + ".fwd",
                              std::max<size_t>(a->ws_fwd_bytes, 256), "workspaces",
                              {m.fwd_phase(k), m.fwd_phase(k)});
      a->ws_bwd_id = plan.add("unet.attention_workspace." + a->name + ".bwd",
                              std::max<size_t>(a->ws_bwd_bytes, 256), "workspaces",
                              {m.bwd_phase(k), m.bwd_phase(k)});
    }
  m.gn_ws_id = ws("group_norm_workspace", m.gn_ws_bytes);
  m.bias_ws_id = ws("bias_grad_workspace", m.bias_ws_bytes);
  m.cbias_ws_id = ws("temb_grad_workspace", m.cbias_ws_bytes);
  m.loss_ws_id = ws("loss_workspace", m.loss_ws_bytes);
  m.scratch_id = ws("grad_scratch", static_cast<size_t>(m.scratch_elements) * 2);
  m.dw16_id = ws("dw16_scratch", static_cast<size_t>(m.dw16_elements) * 2);
  m.rstats_id = ws("recompute_stats", static_cast<size_t>(m.rstats_elements) * 4);
  m.table_id = plan.add("unet.schedule", kScheduleTableBytes, "constants");
}

void UnetModel::bind(const Arena& arena) {
  Impl& m = *impl_;
  m.params.bind(arena);
  for (Tensor& t : m.tensors) {
    t.data = arena.data(t.id);
    if (t.gid >= 0) t.gdata = arena.data(t.gid);
    if (t.grad_in_place) t.gdata = t.data;
    if (t.rid >= 0) t.rdata = arena.data(t.rid);
  }
  m.rstats = arena.as<float>(m.rstats_id);
  m.gemm_ws = arena.data(m.gemm_ws_id);
  m.conv_ws = arena.data(m.conv_ws_id);
  for (auto& n : m.nodes)
    if (auto* a = dynamic_cast<AttentionNode*>(n.get())) {
      a->ws_fwd = arena.data(a->ws_fwd_id);
      a->ws_bwd = arena.data(a->ws_bwd_id);
      a->ws_fwd_bytes = arena.bytes(a->ws_fwd_id);
      a->ws_bwd_bytes = arena.bytes(a->ws_bwd_id);
    }
  m.gn_ws = arena.data(m.gn_ws_id);
  m.bias_ws = arena.data(m.bias_ws_id);
  m.cbias_ws = arena.data(m.cbias_ws_id);
  m.loss_ws = arena.data(m.loss_ws_id);
  m.scratch = arena.data(m.scratch_id);
  m.dw16 = arena.data(m.dw16_id);
  m.table = arena.as<float>(m.table_id);
  m.gemm_ws_bytes = arena.bytes(m.gemm_ws_id);
  m.conv_ws_bytes = arena.bytes(m.conv_ws_id);
  m.gn_ws_bytes = arena.bytes(m.gn_ws_id);
  m.bias_ws_bytes = arena.bytes(m.bias_ws_id);
  m.cbias_ws_bytes = arena.bytes(m.cbias_ws_id);
  m.loss_ws_bytes = arena.bytes(m.loss_ws_id);
}

void UnetModel::initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) {
  Impl& m = *impl_;
  m.io = io;
  // The planted overflow reads the trainer's step counter.
  REPLAY_REQUIRE(io.iteration != nullptr, "UNet: the trainer's step counter");
  m.iteration = io.iteration;
  m.params.initialize(seed, stream);
  diffusion_schedule_init(m.table, stream);
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void UnetModel::register_rng(graphs::RngTracker& rng) {
  impl_->sample_rng =
      rng.register_op(graphs::kDataParallelRng, "diffusion.sample", kDiffusionRngPositions);
}

namespace {

// A region's arguments from its nodes: every tensor once, written if the region writes it.
struct ArgSet {
  std::map<std::string, std::pair<TensorView, graphs::Access>> args;
  void add(const std::string& name, const TensorView& v, graphs::Access a) {
    auto it = args.find(name);
    if (it == args.end()) {
      args.emplace(name, std::make_pair(v, a));
    } else if (a != graphs::Access::kRead && it->second.second == graphs::Access::kRead) {
      it->second.second = graphs::Access::kReadWrite;
    }
  }
  graphs::RegionArgs build() const {
    graphs::RegionArgs r;
    for (const auto& [name, va] : args) r.add(name, va.first, va.second);
    return r;
  }
};

}  // namespace

std::vector<graphs::Region> UnetModel::regions() {
  Impl& m = *impl_;
  const int B = static_cast<int>(m.blocks.size());
  std::vector<std::vector<Node*>> by_block(static_cast<size_t>(B + 1));
  for (auto& n : m.nodes) by_block[static_cast<size_t>(n->block)].push_back(n.get());

  auto fwd_args = [&m](const std::vector<Node*>& nodes) {
    ArgSet a;
    for (Node* n : nodes) {
      for (int i : n->ins) a.add(m.T(i).name, m.T(i).view(), graphs::Access::kRead);
      for (int o : n->outs) a.add(m.T(o).name, m.T(o).view(), graphs::Access::kWrite);
      // An attention call's workspace shares memory with buffers not live during the call: a
      // write the region must list (verify-graphs restores what the eager run wrote).
      if (const auto* at = dynamic_cast<const AttentionNode*>(n))
        a.add("ws." + n->name + ".fwd", at->workspace_view(false), graphs::Access::kWrite);
      if (n->p_first >= 0)
        a.add("w." + n->name, m.params.weight_range(n->p_first, n->p_last), graphs::Access::kRead);
    }
    return a;
  };
  auto bwd_args = [&m](const std::vector<Node*>& nodes, ArgSet a) {
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      Node* n = *it;
      for (int o : n->outs)
        if (m.T(o).gdata) a.add("d." + m.T(o).name, m.T(o).gview(), graphs::Access::kRead);
      if (const auto* at = dynamic_cast<const AttentionNode*>(n))
        a.add("ws." + n->name + ".bwd", at->workspace_view(true), graphs::Access::kWrite);
      for (int t : n->recomputes) {  // the producer's forward again, into the second buffer
        const Node& p = *m.nodes[static_cast<size_t>(m.T(t).producer)];
        for (int i : p.ins) a.add(m.T(i).name, m.T(i).view(), graphs::Access::kRead);
        if (p.p_first >= 0)
          a.add("w." + p.name, m.params.weight_range(p.p_first, p.p_last), graphs::Access::kRead);
        a.add("r." + m.T(t).name, m.T(t).rview(), graphs::Access::kWrite);
      }
      for (int i : n->bwd_reads) {
        const Tensor& t = m.T(i);
        if (t.recompute) {
          a.add("r." + t.name, t.rview(), graphs::Access::kRead);
        } else {
          a.add(t.name, t.view(), graphs::Access::kRead);
        }
      }
      for (size_t j = 0; j < n->ins.size(); ++j) {
        const Tensor& t = m.T(n->ins[j]);
        if (t.gdata)
          a.add("d." + t.name, t.gview(),
                n->acc[j] ? graphs::Access::kReadWrite : graphs::Access::kWrite);
      }
      if (n->p_first >= 0) {
        a.add("w." + n->name, m.params.weight_range(n->p_first, n->p_last), graphs::Access::kRead);
        a.add("g." + n->name, m.params.grad_range(n->p_first, n->p_last), graphs::Access::kWrite);
      }
    }
    return a;
  };

  std::vector<graphs::Region> out;
  for (int b = 0; b < B; ++b) {
    graphs::Region r;
    r.name = m.blocks[static_cast<size_t>(b)] + ".fwd";
    r.kind = graphs::RegionKind::kForwardLayer;
    const std::vector<Node*> nodes = by_block[static_cast<size_t>(b)];
    r.enqueue = [&m, nodes, b](cudaStream_t s, const graphs::RegionArgs&) {
      if (m.timer) {
        if (b == 0) m.timer->start_step();
        m.timer->mark(OpTimer::kBoundary, s);
      }
      for (Node* n : nodes) {
        n->forward(m, s);
        if (m.timer) m.timer->mark(static_cast<int>(n->op_class), s, n->index);
        if (m.poison) m.poison_after(m.fwd_phase(n->index), s);
      }
    };
    r.args = [fwd_args, nodes] { return fwd_args(nodes).build(); };
    out.push_back(std::move(r));
  }
  {
    graphs::Region r;
    r.name = "loss";
    const std::vector<Node*> nodes = by_block[static_cast<size_t>(B)];
    r.enqueue = [&m, nodes](cudaStream_t s, const graphs::RegionArgs&) {
      if (m.timer) m.timer->mark(OpTimer::kBoundary, s);
      for (Node* n : nodes) {
        n->forward(m, s);
        if (m.timer) m.timer->mark(static_cast<int>(n->op_class), s, n->index);
        if (m.poison) m.poison_after(m.fwd_phase(n->index), s);
      }
      for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
        m.recompute_for(**it, s);
        (*it)->backward(m, s);
        if (m.timer) m.timer->mark(static_cast<int>((*it)->op_class), s, (*it)->index);
        if (m.poison) m.poison_after(m.bwd_phase((*it)->index), s);
      }
    };
    r.args = [&m, fwd_args, bwd_args, nodes] {
      ArgSet a = bwd_args(nodes, fwd_args(nodes));
      a.add("loss", TensorView(m.io.loss, DType::kFP32, {1}), graphs::Access::kWrite);
      a.add("loss_scale", TensorView(const_cast<float*>(m.io.loss_scale), DType::kFP32, {1}),
            graphs::Access::kRead);
      return a.build();
    };
    out.push_back(std::move(r));
  }
  for (int b = B - 1; b >= 0; --b) {
    graphs::Region r;
    r.name = m.blocks[static_cast<size_t>(b)] + ".bwd";
    r.kind = graphs::RegionKind::kBackwardLayer;
    const std::vector<Node*> nodes = by_block[static_cast<size_t>(b)];
    r.enqueue = [&m, nodes](cudaStream_t s, const graphs::RegionArgs&) {
      if (m.timer) m.timer->mark(OpTimer::kBoundary, s);
      for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
        m.recompute_for(**it, s);
        (*it)->backward(m, s);
        if (m.timer) m.timer->mark(static_cast<int>((*it)->op_class), s, (*it)->index);
        if (m.poison) m.poison_after(m.bwd_phase((*it)->index), s);
      }
    };
    r.args = [bwd_args, nodes] { return bwd_args(nodes, ArgSet{}).build(); };
    out.push_back(std::move(r));
  }
  return out;
}

int UnetModel::load_batch(cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.timer) m.timer->collect();  // the step before: a sync, --op-times only
  if (m.stream) {
    m.stream->next(stream, m.T(m.moments).data, m.T(m.context).data);
    return 0;
  }
  const UnetData& d = *m.data;
  const int64_t B = m.config.batch;
  const auto me =
      static_cast<size_t>(d.info.latent_channels * 2 * d.info.latent_height * d.info.latent_width) *
      2;  // bytes of one sample's moments
  const auto te = static_cast<size_t>(d.info.context_len * d.info.context_dim) * 2;
  const char* moments = static_cast<const char*>(m.host);
  const char* text = moments + d.moments.size() * 2;
  m.order->rows(m.next_batch, m.rows.data());
  // Slot i of the batch is sample rows[i]; runs of consecutive samples go in one copy each.
  for (int64_t i = 0; i < B;) {
    const int64_t first = m.rows[static_cast<size_t>(i)];
    REPLAY_REQUIRE(first >= 0 && first < d.samples, "UNet batch order: sample out of range");
    int64_t n = 1;
    while (i + n < B && m.rows[static_cast<size_t>(i + n)] == first + n) ++n;
    const auto slot = static_cast<size_t>(i), sample = static_cast<size_t>(first);
    const auto count = static_cast<size_t>(n);
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(m.T(m.moments).data) + slot * me,
                                      moments + sample * me, count * me, cudaMemcpyHostToDevice,
                                      stream));
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(m.T(m.context).data) + slot * te,
                                      text + sample * te, count * te, cudaMemcpyHostToDevice,
                                      stream));
    i += n;
  }
  m.next_batch += 1;
  return 0;
}

int64_t UnetModel::data_position() const {
  return impl_->stream ? impl_->stream->position() : impl_->next_batch;
}
void UnetModel::seek_data(int64_t position) {
  REPLAY_REQUIRE(position >= 0, "UnetModel::seek_data: negative position");
  if (impl_->stream) {
    impl_->stream->seek(position);
  } else {
    impl_->next_batch = position;
  }
}

std::vector<train::Model::NamedTensor> UnetModel::batch_tensors() const {
  return {{"moments", impl_->T(impl_->moments).view()},
          {"context", impl_->T(impl_->context).view()}};
}

double UnetModel::flops_per_step() const {
  return impl_->flops;
}
std::string UnetModel::flops_formula() const {
  return "sum over convolutions and linear layers of 2*MACs x 3 (forward, data and weight "
         "gradients; x2 where no data gradient), attention 4*B*heads*Sq*Skv*d x 3.5 (forward, "
         "and a backward that recomputes the scores)";
}
double UnetModel::units_per_step() const {
  return static_cast<double>(impl_->config.batch);
}
double UnetModel::samples_per_step() const {
  return static_cast<double>(impl_->config.batch);
}
double UnetModel::loss_floor() const {
  return impl_->data->info.provenance.loss_floor;
}

}  // namespace replay::unet
