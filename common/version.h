// version.h: replay's version as every report and log header names it.
#pragma once

namespace replay {

// `git describe --always --dirty --tags` of the checkout the binaries were built from, taken at
// build time (the project version outside a git checkout).
const char* version();

}  // namespace replay
