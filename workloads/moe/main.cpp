// replay-moe: DeepSeek-V3 shard training steps, timed in one graph mode (workloads/moe/README.md).
#include "train/driver.h"
#include "workloads/moe/moe_workload.h"

int main(int argc, char** argv) {
  replay::moe::MoeWorkload workload;
  return replay::train::main(workload, argc, argv);
}
