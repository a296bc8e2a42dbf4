// conditional.h: Conditionals, IF and WHILE conditional nodes whose conditions live in device
// memory, so control flow stays on the GPU: skip the optimizer on overflow, loop while a device
// counter says so (RNN-T greedy decoding as one graph launch). Bodies are captured into the node's
// body graph (cudaStreamBeginCaptureToGraph); a one-thread kernel reads the device condition and
// sets the node's handle with cudaGraphSetConditional. Bodies may hold kernels, memcpy/memset and
// nested conditionals only (no allocation, event or host nodes).
//
// Called while `stream` is capturing (a StepPlan region, a Graph's work), the node joins that
// capture. Called on a stream that is not capturing (an eager region), the node is captured into a
// graph of its own that is instantiated, launched on `stream` and released: the branch is still
// decided on the device, at the cost of one instantiation per call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "graphs/graph.h"

namespace replay::graphs {

class Conditionals {
 public:
  static constexpr int kMaxDepth = 4;  // nesting levels of conditional bodies

  // Creates the non-blocking streams bodies are captured on. Set-up, before any capture.
  Conditionals();
  ~Conditionals();
  Conditionals(const Conditionals&) = delete;
  Conditionals& operator=(const Conditionals&) = delete;

  // IF: `body` runs when *flag == value at the time the node executes.
  void if_equal(cudaStream_t stream, const std::string& name, const int32_t* flag, int32_t value,
                const Work& body);
  // WHILE: `body` runs as long as *flag != 0, tested before every iteration (zero iterations when
  // it is 0 on arrival); the body changes *flag.
  void while_nonzero(cudaStream_t stream, const std::string& name, const int32_t* flag,
                     const Work& body);
  // WHILE with a trip count read on the device at every launch: `body` runs *trip_count times (none
  // when it is <= 0); during the body *iteration holds the 0-based iteration, afterwards the count
  // run.
  void repeat(cudaStream_t stream, const std::string& name, const int32_t* trip_count,
              int32_t* iteration, const Work& body);

 private:
  // Launches a kernel on the stream that sets the handle.
  using SetCondition = std::function<void(cudaStream_t, cudaGraphConditionalHandle)>;
  void add(cudaStream_t stream, const std::string& name, cudaGraphConditionalNodeType type,
           const SetCondition& before, const Work& body, const SetCondition& after_body);
  void add_to_capture(cudaStream_t stream, const std::string& name,
                      cudaGraphConditionalNodeType type, const SetCondition& before,
                      const Work& body, const SetCondition& after_body);

  std::vector<cudaStream_t> body_streams_;  // one per nesting level
  CaptureStream one_shot_stream_;           // captures a conditional called outside any capture
  int depth_ = 0;
};

}  // namespace replay::graphs
