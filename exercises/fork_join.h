// fork_join.h: the setup that C4 (side stream never forked) and C5 (fork never joined) share. The
// capture runs on `main_stream`; work on `side` belongs in the graph only once `fork` makes side
// wait on the capture, and the capture can end only once `join` makes main_stream wait on side.
// Both exercises add 1 on main_stream and 10 on side to `value`, so a replay of the whole graph
// gives 11.
#pragma once

#include "common.h"

namespace ex {

struct ForkJoin {
  cudaStream_t main_stream = nonblocking_stream();
  cudaStream_t side = nonblocking_stream();
  cudaEvent_t fork = untimed_event();
  cudaEvent_t join = untimed_event();
  int* value = device_zeros<int>();
};

}  // namespace ex
