// replay-gpt3: GPT-3 175B shard training steps, timed in one graph mode (workloads/gpt3/README.md).
#include "train/driver.h"
#include "workloads/gpt3/gpt3.h"

int main(int argc, char** argv) {
  replay::transformer::TransformerWorkload workload(replay::gpt3::recipe());
  return replay::train::main(workload, argc, argv);
}
