// cudnn_fe.h: what every op built on the cuDNN frontend shares (attention, the convolutions): the
// frontend's include with the settings every translation unit must agree on, its error codes turned
// into replay::Error, a graph built through the frontend's stages or the reason it could not be,
// the handle pointed at the caller's stream for one call, and execute with the host launch delay.
//
// Include it only from the .cpp files that build frontend graphs: cudnn_frontend.h is slow to
// parse.
#pragma once

// The frontend's JSON (de)serialization is not used, and skipping it halves the parse. Every
// translation unit that includes cudnn_frontend.h must agree on this macro (one definition rule),
// so it is set here and nowhere else.
#ifndef CUDNN_FRONTEND_SKIP_JSON_LIB
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#endif

#include <cudnn_frontend.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/check.h"
#include "common/tensor.h"

namespace replay::cudnn_fe {

namespace fe = cudnn_frontend;

// "GRAPH_NOT_SUPPORTED" for the frontend's error codes.
const char* code_name(fe::error_code_t code);

// Throws Error("cuDNN frontend", <code>, ...) with the frontend's message and `what` was done.
[[noreturn]] void throw_status(fe::error_t status, const char* call, const char* file, int line,
                               const std::string& what);

// bf16 or fp16 storage as the frontend names it; anything else throws.
fe::DataType_t io_type(DType dtype);

// A graph built through the frontend's stages, or why it could not be.
struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  std::string failure;  // empty on success
};

// validate, build the operation graph, query heuristics (mode A, then fallback), check support,
// build the first plan that finalizes. Frontend exceptions (graph construction) count as failures
// too. Set-up only: never inside a capture.
Built build(const std::function<std::shared_ptr<fe::graph::Graph>()>& make, cudnnHandle_t handle);

// Points the cuDNN handle at `stream` for one call, and back at its previous stream afterwards:
// the Context binds the handle to its work stream, callers may pass any stream. Host-only calls,
// safe during capture.
class HandleOnStream {
 public:
  HandleOnStream(cudnnHandle_t handle, cudaStream_t stream);
  ~HandleOnStream();
  HandleOnStream(const HandleOnStream&) = delete;
  HandleOnStream& operator=(const HandleOnStream&) = delete;

 private:
  cudnnHandle_t handle_;
  cudaStream_t previous_ = nullptr;
  bool changed_ = false;
};

// Runs a built graph on `stream` with the variant pack and workspace; a failure throws naming
// `what` (evaluated only then: this runs every step). Capturable.
void execute(fe::graph::Graph& graph, cudnnHandle_t handle, cudaStream_t stream,
             std::unordered_map<int64_t, void*>& pack, void* workspace,
             const std::function<std::string()>& what);

}  // namespace replay::cudnn_fe

// REPLAY_FE_CHECK(call, what): a frontend call whose error_t must be good.
#define REPLAY_FE_CHECK(call, what)                                                          \
  do {                                                                                       \
    ::cudnn_frontend::error_t replay_fe_status = (call);                                     \
    if (replay_fe_status.is_bad())                                                           \
      ::replay::cudnn_fe::throw_status(replay_fe_status, #call, __FILE__, __LINE__, (what)); \
  } while (0)
