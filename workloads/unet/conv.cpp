// conv.cpp: ConvDesc, ConvPlan and ConvCache over the cuDNN frontend's convolution graphs
// (samples/cpp/convolution in the frontend's repository show the same nodes); the frontend's
// plumbing (errors, the handle on a stream, execute) is common/cudnn_fe.h's. The build stages are
// cudnn_fe::build's with one step between heuristics and support checks: removing the engine
// configs that are not deterministic (conv.h), which cudnn_fe::build has no hook for.

// Set-up code and one variant pack per call: -O1 costs nothing measurable and cuts GCC's code
// generation for the frontend's headers by almost half (as in attention.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif

#include "workloads/unet/conv.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/cudnn_fe.h"

namespace fe = cudnn_frontend;

namespace replay::unet {
namespace {

// Variant-pack uids, the same tensor under the same uid in every graph.
enum Uid : int64_t { kX = 1, kW, kBias, kY, kDY, kDX, kDW };

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;
using GraphPtr = std::shared_ptr<fe::graph::Graph>;

// Logical [n, c, h, w] with channels innermost in memory (x, y, and the filter as [K, C, R, S]).
fe::graph::Tensor_attributes channels_last(const char* name, Uid uid, int64_t n, int64_t c,
                                           int64_t h, int64_t w) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({n, c, h, w})
      .set_stride({h * w * c, 1, w * c, c});
}

GraphPtr new_graph(const ConvDesc& d) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(cudnn_fe::io_type(d.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

TensorPtr x_tensor(fe::graph::Graph& g, const ConvDesc& d) {
  return g.tensor(channels_last("x", kX, d.batch, d.in_channels, d.height, d.width));
}
TensorPtr w_tensor(fe::graph::Graph& g, const ConvDesc& d) {
  return g.tensor(channels_last("w", kW, d.out_channels, d.in_channels, d.kernel, d.kernel));
}
TensorPtr dy_tensor(fe::graph::Graph& g, const ConvDesc& d) {
  return g.tensor(channels_last("dy", kDY, d.batch, d.out_channels, d.out_height(), d.out_width()));
}

// The same three settings on every kind of convolution node.
template <typename Attributes>
Attributes geometry(Attributes a, const ConvDesc& d) {
  a.set_padding({d.padding, d.padding}).set_stride({d.stride, d.stride}).set_dilation({1, 1});
  return a;
}

GraphPtr forward_graph(const ConvDesc& d, bool fused_bias) {
  auto g = new_graph(d);
  auto x = x_tensor(*g, d);
  auto w = w_tensor(*g, d);
  TensorPtr y = g->conv_fprop(x, w, geometry(fe::graph::Conv_fprop_attributes(), d));
  if (fused_bias) {
    // The conv's result stays an fp32 intermediate; bias is added in fp32 and rounded once.
    auto bias = g->tensor(channels_last("bias", kBias, 1, d.out_channels, 1, 1));
    y = g->pointwise(y, bias,
                     fe::graph::Pointwise_attributes()
                         .set_name("bias")
                         .set_mode(fe::PointwiseMode_t::ADD)
                         .set_compute_data_type(fe::DataType_t::FLOAT));
  }
  y->set_output(true)
      .set_uid(kY)
      .set_data_type(cudnn_fe::io_type(d.dtype))
      .set_dim({d.batch, d.out_channels, d.out_height(), d.out_width()})
      .set_stride({d.out_height() * d.out_width() * d.out_channels, 1,
                   d.out_width() * d.out_channels, d.out_channels});
  return g;
}

GraphPtr dgrad_graph(const ConvDesc& d) {
  auto g = new_graph(d);
  auto dy = dy_tensor(*g, d);
  auto w = w_tensor(*g, d);
  auto dx = g->conv_dgrad(dy, w, geometry(fe::graph::Conv_dgrad_attributes(), d));
  // dgrad cannot infer H and W (a strided convolution maps several input sizes to one output).
  dx->set_output(true)
      .set_uid(kDX)
      .set_data_type(cudnn_fe::io_type(d.dtype))
      .set_dim({d.batch, d.in_channels, d.height, d.width})
      .set_stride({d.height * d.width * d.in_channels, 1, d.width * d.in_channels, d.in_channels});
  return g;
}

GraphPtr wgrad_graph(const ConvDesc& d) {
  auto g = new_graph(d);
  auto dy = dy_tensor(*g, d);
  auto x = x_tensor(*g, d);
  auto dw = g->conv_wgrad(dy, x, geometry(fe::graph::Conv_wgrad_attributes(), d));
  dw->set_output(true)
      .set_uid(kDW)
      .set_data_type(d.fp32_weight_grad ? fe::DataType_t::FLOAT : cudnn_fe::io_type(d.dtype))
      .set_dim({d.out_channels, d.in_channels, d.kernel, d.kernel})
      .set_stride(
          {d.kernel * d.kernel * d.in_channels, 1, d.kernel * d.in_channels, d.in_channels});
  return g;
}

// cudnn_fe::build's stages, with the engine configs that are nondeterministic, reduce in reduced
// precision or need more than workspace_limit removed after the heuristics query (conv.h,
// Determinism). Set-up only.
cudnn_fe::Built build_deterministic(const std::function<GraphPtr()>& make, cudnnHandle_t handle,
                                    size_t workspace_limit) {
  cudnn_fe::Built out;
  auto stage = [&](const char* name, fe::error_t status) {
    if (status.is_good()) return true;
    out.failure = std::string(name) + " failed with " + cudnn_fe::code_name(status.get_code()) +
                  ": " + status.get_message();
    return false;
  };
  try {
    out.graph = make();
    fe::graph::Graph& g = *out.graph;
    bool ok = stage("validate", g.validate()) &&
              stage("build_operation_graph", g.build_operation_graph(handle)) &&
              stage("create_execution_plans",
                    g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}));
    if (ok) {
      g.deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC,
                                fe::NumericalNote_t::REDUCED_PRECISION_REDUCTION});
      g.deselect_workspace_greater_than(
          static_cast<int64_t>(std::min<size_t>(workspace_limit, static_cast<size_t>(INT64_MAX))));
      ok = stage("check_support", g.check_support()) &&
           stage("build_plans", g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE));
    }
    if (!ok) out.graph.reset();
  } catch (const std::exception& e) {
    out.graph.reset();
    out.failure = std::string("graph construction failed: ") + e.what();
  }
  return out;
}

void require_pointer(const void* p, const char* name, const ConvDesc& d, ConvKind kind) {
  REPLAY_REQUIRE(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 std::string("convolution ") + conv_kind_name(kind) + ": " + name +
                     " must be non-null and 16-byte aligned (" + d.describe() + ")");
}

void require_null(const void* p, const char* name, const ConvDesc& d, ConvKind kind) {
  REPLAY_REQUIRE(p == nullptr, std::string("convolution ") + conv_kind_name(kind) + ": " + name +
                                   " is not used and must be null (" + d.describe() + ")");
}

// The key: what does not change a kind's graph is normalized away, so that a layer's dgrad and
// wgrad plans are shared whatever its bias settings.
ConvDesc normalized(ConvDesc d, ConvKind kind) {
  if (kind != ConvKind::kForward || !d.bias) {
    d.bias = false;
    d.fuse_bias = true;
  }
  if (kind != ConvKind::kWeightGrad) d.fp32_weight_grad = false;
  return d;
}

}  // namespace

const char* conv_kind_name(ConvKind kind) {
  switch (kind) {
    case ConvKind::kForward:
      return "fprop";
    case ConvKind::kDataGrad:
      return "dgrad";
    case ConvKind::kWeightGrad:
      return "wgrad";
  }
  return "?";
}

// -------------------------------------------------------------------------------------------------
// ConvDesc

void ConvDesc::validate() const {
  const std::string at = " (" + describe() + ")";
  REPLAY_REQUIRE(batch >= 1 && height >= 1 && width >= 1, "convolution sizes must be >= 1" + at);
  REPLAY_REQUIRE(in_channels >= 4 && in_channels % 4 == 0 && out_channels >= 4 &&
                     out_channels % 4 == 0 && out_channels <= 4096,
                 "convolution channels must be multiples of 4 (8-byte pixel rows), K <= 4096" + at);
  REPLAY_REQUIRE(kernel >= 1 && kernel % 2 == 1 && stride >= 1 && padding >= 0,
                 "convolution kernel must be odd, stride >= 1, padding >= 0" + at);
  REPLAY_REQUIRE(out_height() >= 1 && out_width() >= 1, "convolution output is empty" + at);
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16,
                 "convolution storage must be fp16 or bf16" + at);
}

std::string ConvDesc::describe() const {
  char buf[256];
  std::snprintf(
      buf, sizeof(buf), "conv N=%lld %lldx%lld C=%lld -> K=%lld %lldx%lld s%lld p%lld %s%s%s",
      static_cast<long long>(batch), static_cast<long long>(height), static_cast<long long>(width),
      static_cast<long long>(in_channels), static_cast<long long>(out_channels),
      static_cast<long long>(kernel), static_cast<long long>(kernel),
      static_cast<long long>(stride), static_cast<long long>(padding), dtype_name(dtype),
      bias ? (fuse_bias ? " +bias" : " +bias(kernel)") : "", fp32_weight_grad ? " fp32-dw" : "");
  return buf;
}

// -------------------------------------------------------------------------------------------------
// ConvPlan

struct ConvPlan::Impl {
  GraphPtr graph;
  size_t workspace = 0;
  std::string engine;
  bool bias_fused = false;
};

ConvPlan::ConvPlan(const Context& ctx, const ConvDesc& desc, ConvKind kind,
                   const ConvOptions& options)
    : desc_(desc), kind_(kind), impl_(std::make_unique<Impl>()) {
  cudnnHandle_t handle = ctx.cudnn();
  auto build = [&](const std::function<GraphPtr()>& make) {
    return build_deterministic(make, handle, options.workspace_limit);
  };
  cudnn_fe::Built built;
  std::string failure;
  switch (kind_) {
    case ConvKind::kForward:
      if (desc_.bias && desc_.fuse_bias) {
        built = build([&] { return forward_graph(desc_, true); });
        impl_->bias_fused = built.graph != nullptr;
        if (!built.graph) failure = "with fused bias: " + built.failure + "; ";
      }
      if (!built.graph) built = build([&] { return forward_graph(desc_, false); });
      break;
    case ConvKind::kDataGrad:
      built = build([&] { return dgrad_graph(desc_); });
      break;
    case ConvKind::kWeightGrad:
      built = build([&] { return wgrad_graph(desc_); });
      break;
  }
  if (!built.graph)
    throw Error("cuDNN frontend", "not supported",
                std::string("cuDNN has no deterministic engine for the ") + conv_kind_name(kind_) +
                    " of " + desc_.describe() + ": " + failure + built.failure);
  impl_->graph = std::move(built.graph);
  int64_t bytes = 0;
  REPLAY_FE_CHECK(impl_->graph->get_workspace_size(bytes), "convolution workspace");
  impl_->workspace = static_cast<size_t>(bytes);
  REPLAY_FE_CHECK(impl_->graph->get_plan_name(impl_->engine), "convolution plan name");
}

ConvPlan::~ConvPlan() = default;

size_t ConvPlan::workspace_bytes() const {
  return impl_->workspace;
}
const std::string& ConvPlan::engine() const {
  return impl_->engine;
}
bool ConvPlan::bias_fused() const {
  return impl_->bias_fused;
}

void ConvPlan::execute(const Context& ctx, cudaStream_t stream, const ConvArgs& a, void* workspace,
                       size_t workspace_bytes) const {
  const ConvDesc& d = desc_;
  std::unordered_map<int64_t, void*> pack;
  switch (kind_) {
    case ConvKind::kForward:
      require_pointer(a.x, "x", d, kind_);
      require_pointer(a.w, "w", d, kind_);
      require_pointer(a.y, "y", d, kind_);
      if (d.bias)
        require_pointer(a.bias, "bias", d, kind_);
      else
        require_null(a.bias, "bias", d, kind_);
      require_null(a.dy, "dy", d, kind_);
      require_null(a.dx, "dx", d, kind_);
      require_null(a.dw, "dw", d, kind_);
      pack = {{kX, const_cast<void*>(a.x)}, {kW, const_cast<void*>(a.w)}, {kY, a.y}};
      if (impl_->bias_fused) pack[kBias] = const_cast<void*>(a.bias);
      break;
    case ConvKind::kDataGrad:
      require_pointer(a.dy, "dy", d, kind_);
      require_pointer(a.w, "w", d, kind_);
      require_pointer(a.dx, "dx", d, kind_);
      require_null(a.x, "x", d, kind_);
      require_null(a.y, "y", d, kind_);
      require_null(a.bias, "bias", d, kind_);
      require_null(a.dw, "dw", d, kind_);
      pack = {{kDY, const_cast<void*>(a.dy)}, {kW, const_cast<void*>(a.w)}, {kDX, a.dx}};
      break;
    case ConvKind::kWeightGrad:
      require_pointer(a.dy, "dy", d, kind_);
      require_pointer(a.x, "x", d, kind_);
      require_pointer(a.dw, "dw", d, kind_);
      require_null(a.w, "w", d, kind_);
      require_null(a.y, "y", d, kind_);
      require_null(a.bias, "bias", d, kind_);
      require_null(a.dx, "dx", d, kind_);
      pack = {{kDY, const_cast<void*>(a.dy)}, {kX, const_cast<void*>(a.x)}, {kDW, a.dw}};
      break;
  }
  REPLAY_REQUIRE(workspace_bytes >= impl_->workspace,
                 "convolution workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                     std::to_string(impl_->workspace) + " needed (" + d.describe() + ")");
  if (impl_->workspace > 0)
    REPLAY_REQUIRE(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                   "convolution workspace must be 16-byte aligned (" + d.describe() + ")");
  cudnn_fe::execute(*impl_->graph, ctx.cudnn(), stream, pack, workspace, [&] {
    return std::string("convolution ") + conv_kind_name(kind_) + " " + d.describe();
  });
  if (kind_ == ConvKind::kForward && d.bias && !impl_->bias_fused)
    conv_bias_add(d.dtype, a.y, a.bias, d.batch * d.out_height() * d.out_width(), d.out_channels,
                  stream);
}

// -------------------------------------------------------------------------------------------------
// ConvCache

ConvCache::ConvCache(ConvOptions options) : options_(options) {}
ConvCache::~ConvCache() = default;

const ConvPlan& ConvCache::get(const Context& ctx, const ConvDesc& desc, ConvKind kind) {
  desc.validate();
  const ConvDesc key = normalized(desc, kind);
  auto it = plans_.find({key, kind});
  if (it == plans_.end()) {
    REPLAY_REQUIRE(!sealed_, std::string("convolution plan for the ") + conv_kind_name(kind) +
                                 " of " + key.describe() +
                                 " requested after set-up (the cache is sealed)");
    it = plans_
             .emplace(std::make_pair(key, kind),
                      std::unique_ptr<ConvPlan>(new ConvPlan(ctx, key, kind, options_)))
             .first;
  }
  return *it->second;
}

size_t ConvCache::max_workspace_bytes() const {
  size_t bytes = 0;
  for (const auto& entry : plans_) bytes = std::max(bytes, entry.second->workspace_bytes());
  return bytes;
}

}  // namespace replay::unet
