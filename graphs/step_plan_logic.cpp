// step_plan_logic.cpp: StepPlan's host-only logic (modes, arguments, fingerprints, partition), kept
// free of CUDA calls so the CPU tests exercise it without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "common/check.h"
#include "graphs/step_plan.h"

namespace replay::graphs {

namespace {

std::string describe_arg(const ArgFingerprint& f) {
  std::string s = dtype_name(f.dtype);
  s += "[";
  for (int i = 0; i < f.ndim; ++i)
    s += (i ? "x" : "") + std::to_string(f.shape[static_cast<size_t>(i)]);
  s += "]";
  // Strides only when they are not the contiguous ones.
  int64_t expect = 1;
  bool contiguous = true;
  for (int i = f.ndim - 1; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    if (f.shape[k] != 1 && f.stride[k] != expect) contiguous = false;
    expect *= f.shape[k];
  }
  if (!contiguous) {
    s += " strides (";
    for (int i = 0; i < f.ndim; ++i)
      s += (i ? "," : "") + std::to_string(f.stride[static_cast<size_t>(i)]);
    s += ")";
  }
  char addr[32];
  std::snprintf(addr, sizeof(addr), " at %p", f.data);
  return s + addr;
}

const char* access_name(Access a) {
  switch (a) {
    case Access::kRead:
      return "read";
    case Access::kWrite:
      return "write";
    case Access::kReadWrite:
      return "read-write";
  }
  return "?";
}

std::string names_of(const std::vector<ArgFingerprint>& f) {
  std::string s = "[";
  for (size_t i = 0; i < f.size(); ++i) s += (i ? ", " : "") + f[i].name;
  return s + "]";
}

}  // namespace

const char* graph_mode_name(GraphMode mode) {
  switch (mode) {
    case GraphMode::kNone:
      return "none";
    case GraphMode::kLayer:
      return "layer";
    case GraphMode::kFull:
      return "full";
  }
  return "?";
}

GraphMode parse_graph_mode(std::string_view text) {
  if (text == "none") return GraphMode::kNone;
  if (text == "layer") return GraphMode::kLayer;
  if (text == "full") return GraphMode::kFull;
  throw Error("replay", "invalid argument",
              "graph mode '" + std::string(text) + "' is not one of: none, layer, full");
}

const char* region_kind_name(RegionKind kind) {
  switch (kind) {
    case RegionKind::kForwardLayer:
      return "forward-layer";
    case RegionKind::kBackwardLayer:
      return "backward-layer";
    case RegionKind::kOther:
      return "other";
  }
  return "?";
}

RegionArgs& RegionArgs::add(std::string name, const TensorView& view, Access access) {
  REPLAY_REQUIRE(!name.empty(), "a region argument needs a name");
  for (const RegionArg& a : args_)
    REPLAY_REQUIRE(a.name != name, "region argument '" + name + "' listed twice");
  args_.push_back(RegionArg{std::move(name), view, access});
  return *this;
}

RegionArgs& RegionArgs::read(std::string name, const TensorView& view) {
  return add(std::move(name), view, Access::kRead);
}
RegionArgs& RegionArgs::write(std::string name, const TensorView& view) {
  return add(std::move(name), view, Access::kWrite);
}
RegionArgs& RegionArgs::read_write(std::string name, const TensorView& view) {
  return add(std::move(name), view, Access::kReadWrite);
}

const TensorView& RegionArgs::operator[](std::string_view name) const {
  for (const RegionArg& a : args_)
    if (a.name == name) return a.view;
  std::string have;
  for (const RegionArg& a : args_) have += (have.empty() ? "" : ", ") + a.name;
  throw Error(
      "replay", "invalid argument",
      "region argument '" + std::string(name) + "' was not declared (declared: " + have + ")");
}

std::vector<ArgFingerprint> fingerprint(const RegionArgs& args) {
  std::vector<ArgFingerprint> out;
  out.reserve(args.list().size());
  for (const RegionArg& a : args.list()) {
    ArgFingerprint f;
    f.name = a.name;
    f.data = a.view.data;
    f.dtype = a.view.dtype;
    f.ndim = a.view.ndim;
    f.shape = a.view.shape;
    f.stride = a.view.stride;
    f.access = a.access;
    // Dimensions past ndim carry no meaning; zero them so they never cause a mismatch.
    for (int i = f.ndim; i < TensorView::kMaxDims; ++i)
      f.shape[static_cast<size_t>(i)] = f.stride[static_cast<size_t>(i)] = 0;
    out.push_back(std::move(f));
  }
  return out;
}

std::string fingerprint_mismatch(const std::vector<ArgFingerprint>& captured,
                                 const std::vector<ArgFingerprint>& now) {
  bool same_names = captured.size() == now.size();
  for (size_t i = 0; same_names && i < captured.size(); ++i)
    same_names = captured[i].name == now[i].name;
  if (!same_names) {
    // Name the first argument present on one side only.
    for (const ArgFingerprint& c : captured)
      if (std::none_of(now.begin(), now.end(),
                       [&](const ArgFingerprint& n) { return n.name == c.name; }))
        return "argument '" + c.name + "' was captured but is no longer passed (captured " +
               names_of(captured) + ", now " + names_of(now) + ")";
    for (const ArgFingerprint& n : now)
      if (std::none_of(captured.begin(), captured.end(),
                       [&](const ArgFingerprint& c) { return c.name == n.name; }))
        return "argument '" + n.name + "' is passed but was not captured (captured " +
               names_of(captured) + ", now " + names_of(now) + ")";
    return "the arguments changed order (captured " + names_of(captured) + ", now " +
           names_of(now) + ")";
  }
  for (size_t i = 0; i < captured.size(); ++i) {
    const ArgFingerprint& c = captured[i];
    const ArgFingerprint& n = now[i];
    const bool same = c.data == n.data && c.dtype == n.dtype && c.ndim == n.ndim &&
                      c.shape == n.shape && c.stride == n.stride;
    if (!same)
      return "argument '" + c.name + "' was captured as " + describe_arg(c) + " and is now " +
             describe_arg(n);
    if (c.access != n.access)
      return std::string("argument '") + c.name + "' was captured as " + access_name(c.access) +
             " and is now " + access_name(n.access);
  }
  return {};
}

std::vector<StepUnit> partition_step(const std::string& plan_name,
                                     const std::vector<Region>& regions,
                                     const StepPlanOptions& options) {
  REPLAY_REQUIRE(!regions.empty(), "step '" + plan_name + "' has no regions");
  REPLAY_REQUIRE(options.warmup_steps >= 0, "step '" + plan_name + "': warm-up steps must be >= 0");
  std::set<std::string> names, scopes;
  for (const Region& r : regions) {
    REPLAY_REQUIRE(!r.name.empty(), "step '" + plan_name + "' has a region without a name");
    REPLAY_REQUIRE(names.insert(r.name).second,
                   "step '" + plan_name + "': region '" + r.name + "' added twice");
    REPLAY_REQUIRE(static_cast<bool>(r.enqueue), "region '" + r.name + "' has no enqueue function");
    if (!r.scope.empty()) scopes.insert(r.scope);
  }
  REPLAY_REQUIRE(options.scopes.empty() || options.mode == GraphMode::kLayer,
                 "step '" + plan_name + "': module scopes apply to layer mode only, the mode is " +
                     graph_mode_name(options.mode));
  for (const std::string& s : options.scopes) {
    if (scopes.count(s)) continue;
    std::string have;
    for (const std::string& d : scopes) have += (have.empty() ? "" : ", ") + d;
    throw Error("replay", "invalid argument",
                "step '" + plan_name + "': scope '" + s + "' matches no region (declared scopes: " +
                    (have.empty() ? "none" : have) + ")");
  }

  const int n = static_cast<int>(regions.size());
  std::vector<StepUnit> units;
  if (options.mode == GraphMode::kFull) {
    units.push_back(StepUnit{plan_name, 0, n - 1, true});
    return units;
  }
  for (int i = 0; i < n; ++i) {
    const Region& r = regions[static_cast<size_t>(i)];
    bool graphed = false;
    if (options.mode == GraphMode::kLayer) {
      graphed = r.graphable.value_or(r.kind != RegionKind::kOther);
      if (!options.scopes.empty())
        graphed = graphed && std::find(options.scopes.begin(), options.scopes.end(), r.scope) !=
                                 options.scopes.end();
    }
    units.push_back(StepUnit{r.name, i, i, graphed});
  }
  return units;
}

int64_t first_difference(const void* a, const void* b, size_t bytes, DType dtype) {
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < bytes; ++i)
    if (pa[i] != pb[i]) return static_cast<int64_t>(i / dtype_size(dtype));
  return -1;
}

std::string format_element(const void* data, DType dtype, int64_t index) {
  const auto* p =
      static_cast<const unsigned char*>(data) + static_cast<size_t>(index) * dtype_size(dtype);
  char buf[64];
  switch (dtype) {
    case DType::kFP32: {
      float v;
      uint32_t bits;
      std::memcpy(&v, p, 4);
      std::memcpy(&bits, p, 4);
      std::snprintf(buf, sizeof(buf), "%.9g (0x%08x)", static_cast<double>(v), bits);
      break;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      std::snprintf(buf, sizeof(buf), "%.4g (0x%04x)", static_cast<double>(v), h);
      break;
    }
    case DType::kFP16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      // IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
      const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
      double v = exp == 0    ? std::ldexp(man, -24)
                 : exp == 31 ? (man ? NAN : INFINITY)
                             : std::ldexp(man + 1024, exp - 25);
      if (h & 0x8000) v = -v;
      std::snprintf(buf, sizeof(buf), "%.5g (0x%04x)", v, h);
      break;
    }
    case DType::kINT32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      std::snprintf(buf, sizeof(buf), "%d", v);
      break;
    }
    case DType::kINT64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(v));
      break;
    }
    case DType::kUINT8:
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
      std::snprintf(buf, sizeof(buf), "0x%02x", p[0]);
      break;
  }
  return buf;
}

std::string VerifyReport::message() const {
  if (ok) {
    return "verify-graphs: " + std::to_string(graphs_checked) + " graphs, " +
           std::to_string(tensors_checked) +
           " outputs: eager and graphed results are bit-identical";
  }
  return "verify-graphs: graph '" + graph + "': output '" + tensor + "' differs at element " +
         std::to_string(index) + ": eager " + eager_value + ", graphed " + graph_value;
}

}  // namespace replay::graphs
