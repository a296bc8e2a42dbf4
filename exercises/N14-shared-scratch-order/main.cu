// N14: two graphs share memory (one pool, one scratch buffer): B reads an intermediate that A
// leaves in the shared buffer. That only holds when the graphs replay in capture order; replaying B
// before A makes B read the previous step's leftovers (no error).
#include "common.h"

// Graph A: scratch = x (its intermediate, kept in the shared buffer), a_out = scratch + 5.
__global__ void graph_a(const int* x, int* scratch, int* a_out) {
  *scratch = *x;
  *a_out = *scratch + 5;
}
// Graph B, captured after A: b_out = scratch + 1, relying on A's intermediate.
__global__ void graph_b(const int* scratch, int* b_out) {
  *b_out = *scratch + 1;
}

static cudaGraphExec_t capture(cudaStream_t stream, void (*enqueue)(cudaStream_t)) {
  cudaGraph_t graph;
  EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue(stream);
  const cudaGraphExec_t exec = ex::end_capture_and_instantiate(stream, &graph);
  EX_CHECK(cudaGraphDestroy(graph));
  return exec;
}

static int *x, *scratch, *a_out, *b_out;

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N14");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  int* pool;  // one allocation shared by both graphs
  EX_CHECK(cudaMalloc(&pool, 4 * sizeof(int)));
  x = pool, scratch = pool + 1, a_out = pool + 2, b_out = pool + 3;
  const cudaGraphExec_t a =
      capture(stream, [](cudaStream_t s) { graph_a<<<1, 1, 0, s>>>(x, scratch, a_out); });
  const cudaGraphExec_t b =
      capture(stream, [](cudaStream_t s) { graph_b<<<1, 1, 0, s>>>(scratch, b_out); });

  int host[2];
  for (int input : {2, 3}) {  // two steps; the input is updated in place
    EX_CHECK(cudaMemcpyAsync(x, &input, sizeof(int), cudaMemcpyHostToDevice, stream));
    const bool out_of_order =
        args.broken() && input == 3;  // Broken: the second step replays B first
    EX_CHECK(cudaGraphLaunch(out_of_order ? b : a, stream));
    EX_CHECK(cudaGraphLaunch(out_of_order ? a : b, stream));
    EX_CHECK(cudaMemcpyAsync(host, a_out, 2 * sizeof(int), cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));
  }
  EX_CHECK(cudaGraphExecDestroy(a));
  EX_CHECK(cudaGraphExecDestroy(b));
  const bool ok = host[0] == 8 && (args.broken() ? host[1] == 3 : host[1] == 4);
  return ex::report("N14", args, ok, "step input 3: A gave %d, B gave %d (expected 8 and 4; %s)",
                    host[0], host[1], args.broken() ? "B replayed before A" : "capture order");
}
