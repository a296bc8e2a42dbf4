// version.cpp: the one translation unit that sees the generated version header.
#include "common/version.h"

#include "replay_version.h"  // generated at build time by cmake/ReplayVersion.cmake

namespace replay {

const char* version() {
  return REPLAY_VERSION;
}

}  // namespace replay
