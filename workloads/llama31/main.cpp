// replay-llama31: Llama 3.1 405B shard training steps, timed in one graph mode
// (workloads/llama31/README.md).
#include "train/driver.h"
#include "workloads/llama31/llama31.h"

int main(int argc, char** argv) {
  replay::transformer::TransformerWorkload workload(replay::llama31::recipe());
  return replay::train::main(workload, argc, argv);
}
