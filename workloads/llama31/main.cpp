// replay-llama31: Llama 3.1 405B shard training steps, timed in one graph mode
// (workloads/llama31/README.md).
#include "workloads/llama31/llama31.h"

int main(int argc, char** argv) {
  return replay::transformer::workload_main(replay::llama31::workload(), argc, argv);
}
