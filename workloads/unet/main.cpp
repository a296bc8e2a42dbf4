// replay-unet: Stable Diffusion v2 UNet training steps, timed in one graph mode
// (workloads/unet/README.md).
#include "train/driver.h"
#include "workloads/unet/unet_workload.h"

int main(int argc, char** argv) {
  replay::unet::UnetWorkload workload;
  return replay::train::main(workload, argc, argv);
}
