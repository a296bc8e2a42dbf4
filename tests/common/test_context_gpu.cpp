// Context on a real GPU: streams are non-blocking, handles exist, the arena is one allocation, the
// environment report names every library.
#include "common/context.h"

#include <gtest/gtest.h>

namespace replay {
namespace {

TEST(Context, StreamsHandlesAndEnvironment) {
  Context ctx;
  unsigned flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(ctx.stream(), &flags), cudaSuccess);
  EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);
  EXPECT_NE(ctx.cublaslt(), nullptr);
  EXPECT_NE(ctx.cudnn(), nullptr);
  EXPECT_GT(ctx.sm_count(), 0);
  const EnvironmentReport env = ctx.environment();
  for (const char* key : {"gpu", "sm_count", "cuda_driver", "cuda_runtime", "cublaslt", "cudnn",
                          "nccl", "mpi", "hdf5"})
    EXPECT_FALSE(env.get(key).empty()) << key;
  std::printf("%s", env.to_text().c_str());
}

TEST(Context, ArenaIsOneAllocationAndPoisoned) {
  Context ctx;
  ArenaPlan plan;
  BufferId a = plan.add("a", DType::kFP32, 1024, "test", {0, 0});
  BufferId b = plan.add("b", DType::kFP32, 1024, "test", {1, 1});
  Arena& arena = ctx.create_arena(std::move(plan));
  EXPECT_EQ(arena.data(a), arena.data(b));  // disjoint lifetimes share memory
  std::vector<float> host(1024);
  ASSERT_EQ(cudaMemcpy(host.data(), arena.data(a), 4096, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(host[0]));
  EXPECT_THROW(arena.view(a, DType::kFP32, {2048}), Error);
  EXPECT_THROW(ctx.create_arena(ArenaPlan{}), Error);
}

TEST(Context, ArenaTooLargeIsAClearError) {
  Context ctx;
  ArenaPlan plan;
  plan.add("huge.activations", size_t{1} << 50, "activations");
  try {
    ctx.create_arena(std::move(plan));
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("huge.activations"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace replay
