// N9: keeping references to a graph's output across replays. The output is a static buffer: every
// replay overwrites it, so all kept "results" show the last step's value (no error).
#include "common.h"

// One training step in miniature: the loss of step k is k.
__global__ void step(int* counter, int* loss) {
  *loss = ++*counter;
}

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N9");
  ex::require_gpu();
  constexpr int steps = 3;
  const cudaStream_t stream = ex::nonblocking_stream();
  int *counter, *loss, *history;
  EX_CHECK(cudaMalloc(&counter, sizeof(int)));
  EX_CHECK(cudaMalloc(&loss, sizeof(int)));
  EX_CHECK(cudaMalloc(&history, steps * sizeof(int)));
  EX_CHECK(cudaMemset(counter, 0, sizeof(int)));

  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step<<<1, 1, 0, stream>>>(counter, loss);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);

  const int* kept[steps];  // what the training loop keeps for logging at the end
  for (int s = 0; s < steps; ++s) {
    EX_CHECK(cudaGraphLaunch(exec, stream));
    if (args.broken()) {
      kept[s] = loss;  // Broken: a reference to the static output
    } else {
      // Fixed: copy the output out (on the device, no sync) before the next replay overwrites it.
      EX_CHECK(cudaMemcpyAsync(history + s, loss, sizeof(int), cudaMemcpyDeviceToDevice, stream));
      kept[s] = history + s;
    }
  }
  int values[steps];
  for (int s = 0; s < steps; ++s) {
    EX_CHECK(cudaMemcpyAsync(&values[s], kept[s], sizeof(int), cudaMemcpyDeviceToHost, stream));
  }
  EX_CHECK(cudaStreamSynchronize(stream));
  ex::destroy_graph(exec, graph);
  const bool last_only = values[0] == 3 && values[1] == 3 && values[2] == 3;
  const bool each_step = values[0] == 1 && values[1] == 2 && values[2] == 3;
  return ex::report("N9", args, args.broken() ? last_only : each_step, "kept losses %d %d %d (%s)",
                    values[0], values[1], values[2],
                    last_only ? "every reference shows the last replay" : "one per step");
}
