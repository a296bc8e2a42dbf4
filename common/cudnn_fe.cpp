// cudnn_fe.cpp: the cuDNN frontend's error codes, staged graph builds, the handle on a stream and
// execute, shared by every op on the frontend (cudnn_fe.h).

// This code runs at set-up, or builds one variant pack per call, so -O1 costs nothing measurable
// and cuts GCC's code generation for the frontend's headers by almost half.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif

#include "common/cudnn_fe.h"

#include <exception>

namespace replay::cudnn_fe {

const char* code_name(fe::error_code_t code) {
  switch (code) {
    case fe::error_code_t::OK:
      return "OK";
    case fe::error_code_t::ATTRIBUTE_NOT_SET:
      return "ATTRIBUTE_NOT_SET";
    case fe::error_code_t::SHAPE_DEDUCTION_FAILED:
      return "SHAPE_DEDUCTION_FAILED";
    case fe::error_code_t::INVALID_TENSOR_NAME:
      return "INVALID_TENSOR_NAME";
    case fe::error_code_t::INVALID_VARIANT_PACK:
      return "INVALID_VARIANT_PACK";
    case fe::error_code_t::GRAPH_NOT_SUPPORTED:
      return "GRAPH_NOT_SUPPORTED";
    case fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED:
      return "GRAPH_EXECUTION_PLAN_CREATION_FAILED";
    case fe::error_code_t::GRAPH_EXECUTION_FAILED:
      return "GRAPH_EXECUTION_FAILED";
    case fe::error_code_t::HEURISTIC_QUERY_FAILED:
      return "HEURISTIC_QUERY_FAILED";
    case fe::error_code_t::UNSUPPORTED_GRAPH_FORMAT:
      return "UNSUPPORTED_GRAPH_FORMAT";
    case fe::error_code_t::CUDA_API_FAILED:
      return "CUDA_API_FAILED";
    case fe::error_code_t::CUDNN_BACKEND_API_FAILED:
      return "CUDNN_BACKEND_API_FAILED";
    case fe::error_code_t::INVALID_CUDA_DEVICE:
      return "INVALID_CUDA_DEVICE";
    case fe::error_code_t::HANDLE_ERROR:
      return "HANDLE_ERROR";
    case fe::error_code_t::INVALID_VALUE:
      return "INVALID_VALUE";
    case fe::error_code_t::NVRTC_COMPILATION_FAILED:
      return "NVRTC_COMPILATION_FAILED";
  }
  return "UNKNOWN";
}

void throw_status(fe::error_t status, const char* call, const char* file, int line,
                  const std::string& what) {
  throw_error("cuDNN frontend", code_name(status.get_code()), call, file, line,
              what + ": " + status.get_message());
}

fe::DataType_t io_type(DType dtype) {
  REPLAY_REQUIRE(
      dtype == DType::kBF16 || dtype == DType::kFP16,
      std::string("cuDNN frontend storage must be bf16 or fp16, got ") + dtype_name(dtype));
  return dtype == DType::kFP16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

Built build(const std::function<std::shared_ptr<fe::graph::Graph>()>& make, cudnnHandle_t handle) {
  Built out;
  auto stage = [&](const char* name, fe::error_t status) {
    if (status.is_good()) return true;
    out.failure = std::string(name) + " failed with " + code_name(status.get_code()) + ": " +
                  status.get_message();
    return false;
  };
  try {
    out.graph = make();
    fe::graph::Graph& g = *out.graph;
    const bool ok =
        stage("validate", g.validate()) &&
        stage("build_operation_graph", g.build_operation_graph(handle)) &&
        stage("create_execution_plans",
              g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})) &&
        stage("check_support", g.check_support()) &&
        stage("build_plans", g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE));
    if (!ok) out.graph.reset();
  } catch (const std::exception& e) {
    out.graph.reset();
    out.failure = std::string("graph construction failed: ") + e.what();
  }
  return out;
}

HandleOnStream::HandleOnStream(cudnnHandle_t handle, cudaStream_t stream) : handle_(handle) {
  REPLAY_CUDNN_CHECK(cudnnGetStream(handle_, &previous_));
  changed_ = previous_ != stream;
  if (changed_) REPLAY_CUDNN_CHECK(cudnnSetStream(handle_, stream));
}

HandleOnStream::~HandleOnStream() {
  if (changed_) cudnnSetStream(handle_, previous_);
}

void execute(fe::graph::Graph& graph, cudnnHandle_t handle, cudaStream_t stream,
             std::unordered_map<int64_t, void*>& pack, void* workspace,
             const std::function<std::string()>& what) {
  HandleOnStream on_stream(handle, stream);
  const fe::error_t status = graph.execute(handle, pack, workspace);
  if (status.is_bad()) throw_status(status, "execute", __FILE__, __LINE__, what());
  detail::host_launch_delay();
}

}  // namespace replay::cudnn_fe
