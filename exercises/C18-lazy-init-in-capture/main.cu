// C18: lazy initialization inside a capture: the first cuBLAS GEMM on a handle, and the first
// cudaFuncSetAttribute for a kernel, happen while capturing. Libraries may allocate workspace, load
// kernels or query the device on first use; inside a capture that can fail the capture or leave the
// one-time work out of the graph. The exercise reports what this CUDA version does with each; the
// fix is the same either way: one eager warm-up call before capture.
#include <cublas_v2.h>

#include "common.h"

constexpr int kN = 64;            // square GEMM size
constexpr int kSmem = 96 * 1024;  // above the 48 KiB default: needs the attribute

// Sums kN ones through a large dynamic shared-memory buffer.
__global__ void big_smem_sum(float* out) {
  extern __shared__ float tile[];
  tile[threadIdx.x] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int i = 0; i < kN; ++i) s += tile[i];
    *out = s;
  }
}

static const char* blas_name(cublasStatus_t s) {
  return cublasGetStatusName(s);
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "C18");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float *a, *c, *sum;
  EX_CHECK(cudaMalloc(&a, kN * kN * sizeof(float)));
  EX_CHECK(cudaMalloc(&c, kN * kN * sizeof(float)));
  EX_CHECK(cudaMalloc(&sum, sizeof(float)));
  float ones[kN * kN];
  for (float& v : ones) v = 1.0f;
  EX_CHECK(cudaMemcpy(a, ones, sizeof(ones), cudaMemcpyHostToDevice));
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS)
    return ex::report("C18", args, false, "cublasCreate failed");
  if (cublasSetStream(handle, stream) != CUBLAS_STATUS_SUCCESS)
    return ex::report("C18", args, false, "cublasSetStream failed");
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&] {
    return cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, kN, kN, kN, &one, a, kN, a, kN, &zero, c,
                       kN);
  };

  if (!args.broken()) {
    // Fixed: warm up eagerly: one GEMM and the attribute, before any capture.
    if (gemm() != CUBLAS_STATUS_SUCCESS)
      return ex::report("C18", args, false, "eager warm-up GEMM failed");
    EX_CHECK(
        cudaFuncSetAttribute(big_smem_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    EX_CHECK(cudaStreamSynchronize(stream));
  }
  cudaGraph_t graph = nullptr;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const cublasStatus_t blas = gemm();
  const cudaError_t attr =
      args.broken() ? EX_TRY(cudaFuncSetAttribute(
                          big_smem_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem))
                    : cudaSuccess;
  big_smem_sum<<<1, kN, kSmem, stream>>>(sum);
  const cudaError_t launch = EX_TRY(cudaGetLastError());
  const cudaError_t end = EX_TRY(cudaStreamEndCapture(stream, &graph));

  float c00 = -1, total = -1;
  if (end == cudaSuccess) {
    const cudaGraphExec_t exec = ex::instantiate(graph);
    EX_CHECK(cudaMemsetAsync(c, 0, kN * kN * sizeof(float), stream));
    EX_CHECK(cudaMemsetAsync(sum, 0, sizeof(float), stream));
    EX_CHECK(cudaGraphLaunch(exec, stream));
    EX_CHECK(cudaMemcpyAsync(&c00, c, sizeof(float), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaMemcpyAsync(&total, sum, sizeof(float), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));
    ex::destroy_graph(exec, graph);
  }
  cublasDestroy(handle);
  const bool replay_correct = end == cudaSuccess && c00 == kN && total == kN;
  if (args.broken()) {
    // Documented either way: a refused capture or a failing first call is the guide's symptom; a
    // correct replay means this library and driver made these first calls capture-safe. Only a
    // silently wrong replay (every call reported success) is unexpected.
    const bool call_failed =
        blas != CUBLAS_STATUS_SUCCESS || attr != cudaSuccess || launch != cudaSuccess;
    const char* outcome = end != cudaSuccess ? "capture refused"
                          : call_failed      ? "a first call failed"
                          : replay_correct   ? "capture-safe here, replay correct"
                                             : "replay WRONG";
    return ex::report(
        "C18", args, end != cudaSuccess || call_failed || replay_correct,
        "first cublasSgemm in capture -> %s, cudaFuncSetAttribute in capture -> %s, launch -> %s, "
        "cudaStreamEndCapture -> %s; %s",
        blas_name(blas), ex::name(attr).c_str(), ex::name(launch).c_str(), ex::name(end).c_str(),
        outcome);
  }
  return ex::report(
      "C18", args, replay_correct && blas == CUBLAS_STATUS_SUCCESS,
      "warmed up before capture, replay gave C[0]=%.0f and sum=%.0f (expected %d, %d)", c00, total,
      kN, kN);
}
