// expert_gemm.cpp: the capacity-padded expert GEMMs as strided batches (see expert_gemm.h).
#include "workloads/moe/expert_gemm.h"

#include <string>

#include "common/check.h"

namespace replay::moe {

LinearGemms expert_linear_gemms(int64_t experts, int64_t capacity, int64_t in, int64_t out,
                                bool accumulate_wgrad) {
  REPLAY_REQUIRE(experts >= 1 && capacity >= 1 && in >= 1 && out >= 1,
                 "expert GEMMs need positive experts, capacity, in and out (got " +
                     std::to_string(experts) + ", " + std::to_string(capacity) + ", " +
                     std::to_string(in) + ", " + std::to_string(out) + ")");
  // One expert's linear layer over its C rows; the packed strides (GemmDesc::normalized) then put
  // entry e at X + e * C * in, W + e * out * in, Y + e * C * out (and dW + e * out * in).
  LinearGemms g = linear_gemms(capacity, in, out, /*bias=*/false, accumulate_wgrad);
  for (GemmDesc* d : {&g.forward, &g.dgrad, &g.wgrad}) d->batch = experts;
  return g;
}

}  // namespace replay::moe
