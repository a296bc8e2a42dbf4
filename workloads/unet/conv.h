// conv.h: the UNet's 2-D convolutions (3x3 stride 1 or 2 with padding 1, 1x1) on the cuDNN
// frontend, forward (fprop), data gradient (dgrad) and weight gradient (wgrad), with plans built at
// set-up and cached by shape, and the bias: fused into the forward graph where cuDNN can, its
// gradient as a deterministic channel sum. The frontend stays inside conv.cpp: this header is
// light.
//
// Layouts (row-major, strides in elements; cuDNN's "channels last": logical NCHW / KCRS dims with
// these strides):
//   x  [N, H, W, C]    input (and dx, the data gradient)
//   w  [K, R, S, C]    filter, R = S = kernel (and dw, the weight gradient)
//   y  [N, P, Q, K]    output (and dy), P = (H + 2 * padding - kernel) / stride + 1, Q likewise
//   bias [K]
// Storage fp16 or bf16 (ConvDesc::dtype), accumulation and epilogue in fp32. dw is written in the
// storage type, or in fp32 with fp32_weight_grad (straight into fp32 master gradients) where cuDNN
// has an engine for it. Nothing is accumulated: y, dx and dw are overwritten.
//
// Determinism. Engines come from cuDNN's heuristics (mode A, then the fallback list) in their
// order, a pure function of the desc, the GPU and the cuDNN version, with every engine config
// that carries the NONDETERMINISTIC numerical note removed (wgrad and dgrad engines that reduce
// with atomics), and those with REDUCED_PRECISION_REDUCTION (partial sums in 16 bits); the first
// remaining config that cuDNN supports is built and kept. So one plan always runs the same engine
// and the same bits come out run to run, eager or captured.
//
// Workspace. Each plan reports the workspace its engine needs (ConvPlan::workspace_bytes, at most
// ConvOptions::workspace_limit); the caller passes it from the arena (ConvCache::
// max_workspace_bytes sizes one buffer for every plan). A workspace serves one stream at a time.
//
// Alignment: every pointer 16-byte aligned (arena buffers are 256-byte aligned).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "common/context.h"
#include "common/tensor.h"

namespace replay::unet {

enum class ConvKind : uint8_t { kForward, kDataGrad, kWeightGrad };
const char* conv_kind_name(ConvKind kind);

// One convolution layer's shape and types: with the kind, the cache key.
struct ConvDesc {
  int64_t batch = 1;
  int64_t height = 1, width = 1;  // input H, W
  int64_t in_channels = 0;        // C (4 for the UNet's first layer)
  int64_t out_channels = 0;       // K (4 for its last)
  int64_t kernel = 3;             // R = S: 3 or 1
  int64_t stride = 1;             // 1 or 2
  int64_t padding = 1;            // symmetric, on H and W
  DType dtype = DType::kFP16;     // x, w, y, dy, dx, bias storage: kFP16 or kBF16
  bool bias = false;              // forward: y = conv(x, w) + bias[k]
  bool fuse_bias = true;          // add it in the cuDNN graph; false, or no engine: a kernel after
  bool fp32_weight_grad = false;  // dw in fp32 instead of dtype

  int64_t out_height() const { return (height + 2 * padding - kernel) / stride + 1; }
  int64_t out_width() const { return (width + 2 * padding - kernel) / stride + 1; }
  int64_t x_elements() const { return batch * height * width * in_channels; }
  int64_t w_elements() const { return out_channels * kernel * kernel * in_channels; }
  int64_t y_elements() const { return batch * out_height() * out_width() * out_channels; }
  // Multiply-adds times two of one direction (each of fprop, dgrad and wgrad does the same work).
  double flops() const {
    return 2.0 * static_cast<double>(y_elements()) * static_cast<double>(kernel * kernel) *
           static_cast<double>(in_channels);
  }

  // Throws Error naming the field when the desc is malformed. What cuDNN cannot run is reported
  // when the plan is built.
  void validate() const;
  std::string describe() const;
  auto tie() const {
    return std::tie(batch, height, width, in_channels, out_channels, kernel, stride, padding, dtype,
                    bias, fuse_bias, fp32_weight_grad);
  }
  bool operator<(const ConvDesc& o) const { return tie() < o.tie(); }
};

// Device pointers of one call; unused ones stay null (a stray pointer is a wiring mistake).
//   kForward:    x, w, y, and bias when desc.bias
//   kDataGrad:   dy, w -> dx
//   kWeightGrad: dy, x -> dw
struct ConvArgs {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;
  void* y = nullptr;
  const void* dy = nullptr;
  void* dx = nullptr;
  void* dw = nullptr;
};

struct ConvOptions {
  // Engine configs whose workspace exceeds this are skipped.
  size_t workspace_limit = size_t{256} << 20;
};

// One built cuDNN graph (one kind of one desc). Obtained from ConvCache only.
class ConvPlan {
 public:
  ~ConvPlan();
  ConvPlan(const ConvPlan&) = delete;
  ConvPlan& operator=(const ConvPlan&) = delete;

  const ConvDesc& desc() const { return desc_; }
  ConvKind kind() const { return kind_; }
  size_t workspace_bytes() const;
  const std::string& engine() const;  // the engine cuDNN's heuristics chose, for reports
  // Forward with bias: whether the cuDNN graph adds it (otherwise conv_bias_add runs after).
  bool bias_fused() const;

  // Enqueues the graph on `stream` (the handle of ctx is pointed at it for the call and back
  // after). Checks the pointers on the host; no allocation, no synchronization, no host read of
  // device data: capturable.
  void execute(const Context& ctx, cudaStream_t stream, const ConvArgs& args, void* workspace,
               size_t workspace_bytes) const;

 private:
  friend class ConvCache;
  struct Impl;
  ConvPlan(const Context& ctx, const ConvDesc& desc, ConvKind kind, const ConvOptions& options);

  ConvDesc desc_;
  ConvKind kind_;
  std::unique_ptr<Impl> impl_;
};

// Plans keyed by (desc, kind). get() builds on first use, at set-up (a configuration cuDNN cannot
// run throws Error naming the desc, the stage and cuDNN's reason); seal() marks the end of set-up,
// after which a get() that would build throws: plans are never built during capture. Plans live
// as long as the cache, which must not outlive the Context whose cuDNN handle built them.
class ConvCache {
 public:
  explicit ConvCache(ConvOptions options = {});
  ~ConvCache();
  ConvCache(const ConvCache&) = delete;
  ConvCache& operator=(const ConvCache&) = delete;

  const ConvPlan& get(const Context& ctx, const ConvDesc& desc, ConvKind kind);
  void seal() { sealed_ = true; }
  size_t size() const { return plans_.size(); }
  size_t max_workspace_bytes() const;

 private:
  ConvOptions options_;
  std::map<std::pair<ConvDesc, ConvKind>, std::unique_ptr<ConvPlan>> plans_;
  bool sealed_ = false;
};

// The bias over NHWC rows (rows = N * P * Q, channels = K, a multiple of 4 up to 4096; y, dy, bias
// 16-byte aligned). Kernels in group_norm.cu, whose tiling they share.
//
// dbias[k] (+)= sum over rows of dy[row, k], fp32: per-tile partial rows in a fixed order, then
// column sums in a fixed order (deterministic). The workspace (scratch) is a pure function of the
// shape.
size_t conv_bias_grad_workspace_bytes(int64_t rows, int64_t channels);
void conv_bias_grad(DType dtype, float* dbias, const void* dy, int64_t rows, int64_t channels,
                    bool accumulate, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// y[row, k] += bias[k], in place, fp32 add and one rounding: the forward's bias when cuDNN does not
// fuse it.
void conv_bias_add(DType dtype, void* y, const void* bias, int64_t rows, int64_t channels,
                   cudaStream_t stream);

}  // namespace replay::unet
