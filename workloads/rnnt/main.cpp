// replay-rnnt: MLPerf's RNN-T training steps on a ladder of padded shapes, timed in one graph mode
// (workloads/rnnt/README.md).
#include "train/driver.h"
#include "workloads/rnnt/rnnt_workload.h"

int main(int argc, char** argv) {
  replay::rnnt::RnntWorkload workload;
  return replay::train::main(workload, argc, argv);
}
