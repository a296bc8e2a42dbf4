// replay-gpt3: GPT-3 175B shard training steps, timed in one graph mode (workloads/gpt3/README.md).
#include "workloads/gpt3/gpt3.h"

int main(int argc, char** argv) {
  return replay::transformer::workload_main(replay::gpt3::workload(), argc, argv);
}
