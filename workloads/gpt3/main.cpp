// replay-gpt3: GPT-3 175B shard training steps, timed in one graph mode (workloads/gpt3/README.md).
#include "common/bench/harness.h"
#include "workloads/gpt3/gpt3.h"

int main(int argc, char** argv) {
  using namespace replay;
  return bench::run_main("replay-gpt3", [&] {
    const auto flags = bench::parse_flags("replay-gpt3", argc, argv, gpt3::preset_names(), "tiny");
    if (!flags) return 0;  // --help
    gpt3::run(gpt3::resolve(*flags));
    return 0;
  });
}
