// expert_gemm.h: the routed experts' GEMMs over the capacity-padded dispatch layout, as one
// strided-batched cuBLASLt matmul per GEMM (one batch entry per expert), planned at set-up through
// replay's GemmPlan/GemmCache like every other GEMM.
//
// Why not a grouped GEMM. The issue asks for cuBLASLt's grouped GEMM reading each expert's token
// count from device memory. The CUDA 13.0 toolkit here ships cuBLAS/cuBLASLt 13.1.0.3, and its
// cublasLt.h has no grouped matmul: no grouped matrix layout, no per-group shape arrays, no
// "group" attribute at all. What it has is batching with one shape for every batch entry:
// CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT with either strided batches (CUBLASLT_BATCH_MODE_STRIDED) or
// device arrays of per-entry pointers (CUBLASLT_BATCH_MODE_POINTER_ARRAY), and per-entry alpha
// vectors (CUBLASLT_POINTER_MODE_DEVICE_VECTOR). The grouped GEMM that does exist is the legacy
// cuBLAS API's cublasGemmGroupedBatchedEx (and _64): per-group m, n, k, leading dimensions and
// counts in *host* arrays, read at the call. Driving it from device-side counts means a host read
// of the counts every layer, which stalls the stream and cannot live inside a CUDA graph (the
// sizes would be frozen at capture), so it is not used.
//
// What replay does instead (what the issue allows, and what NVIDIA's MLPerf DeepSeek-V3 graphs
// do with fixed per-expert capacity): the dispatch lays expert e's rows out at [e * C, e * C + C)
// with zero padding (moe_dispatch_index in kCapacity mode), and each GEMM is a batch of E equal
// problems, C rows each. The shapes are static, so the plan is made once and the launch is
// graph-friendly; the device-side counts act as a mask: padding rows are zero in, so their
// outputs are zero (SwiGLU(0) = 0, and a zero row adds nothing to a weight gradient), and
// the combine never reads them. The cost is the padding's arithmetic: E * C rows against the
// sum of the counts. Dropless training goes through the same path with C = tokens (an expert
// receives at most one assignment per token, so nothing can be dropped), which is exact but
// computes E / topk times the routed rows: affordable at the tiny preset and for a few local
// experts, not for 256 experts on one GPU; that case waits for a grouped GEMM with device-side
// sizes (a CUTLASS grouped kernel, or a cuBLASLt that gains one).
#pragma once

#include <cstdint>

#include "common/gemm.h"

namespace replay::moe {

// The three GEMMs of an expert linear layer Y_e = X_e W_e^T for every expert e < E at once:
//   X [E, C, in] bf16 (the gathered rows), W [E, out, in] bf16 (nn.Linear's layout per expert),
//   Y [E, C, out] bf16; dgrad dX [E, C, in] = dY W; wgrad dW [E, out, in] fp32 = dY^T X,
// accumulated into dW (beta 1) when `accumulate_wgrad`. Each is replay's linear_gemms over C rows
// with batch E and packed batch strides, so every GemmPlan rule (determinism, alignment: in and
// out multiples of 8) applies. in and out are per expert: for DeepSeek-V3's SwiGLU experts the
// fused gate+up layer is in = hidden 7168, out = 2 * 2048, and the down layer in = 2048,
// out = 7168.
LinearGemms expert_linear_gemms(int64_t experts, int64_t capacity, int64_t in, int64_t out,
                                bool accumulate_wgrad);

// Floating-point operations of one expert GEMM as executed (padding included) and as useful
// (the routed rows only): 2 * rows * in * out.
inline double expert_gemm_flops(int64_t rows, int64_t in, int64_t out) {
  return 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
}

}  // namespace replay::moe
