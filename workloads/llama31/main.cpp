// replay-llama31: Llama 3.1 405B shard training steps, timed in one graph mode
// (workloads/llama31/README.md).
#include "common/bench/harness.h"
#include "workloads/llama31/llama31.h"

int main(int argc, char** argv) {
  using namespace replay;
  return bench::run_main("replay-llama31", [&] {
    const auto flags =
        bench::parse_flags("replay-llama31", argc, argv, llama31::preset_names(), "tiny");
    if (!flags) return 0;  // --help
    llama31::run(llama31::resolve(*flags));
    return 0;
  });
}
