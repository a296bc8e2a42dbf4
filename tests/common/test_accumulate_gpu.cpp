// The gradient-accumulation helpers against host loops: fp32 accumulation in place (16-byte packs
// and ragged tails) and the ordered mean, both bit-identical to the host.
#include "common/kernels/accumulate.h"

#include <cuda_runtime.h>  // the typed cudaMalloc DeviceBuffer uses
#include <gtest/gtest.h>

#include <vector>

#include "tests/support/compare.h"

namespace replay {
namespace {

using test::DeviceBuffer;

TEST(Accumulate, AddsInPlaceBitIdenticalToTheHost) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (size_t n : {1u, 3u, 4u, 5u, 1000u, 100003u, 2000001u}) {
    const std::vector<float> dst = test::random_uniform(n, 10 + n),
                             src = test::random_normal(n, 20 + n);
    DeviceBuffer<float> d_dst(dst), d_src(src);
    accumulate(d_dst.get(), d_src.get(), static_cast<int64_t>(n), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> expect(n);
    for (size_t i = 0; i < n; ++i) expect[i] = dst[i] + src[i];
    const std::vector<float> got = d_dst.download();
    EXPECT_TRUE(
        test::bit_equal("accumulate n=" + std::to_string(n), got.data(), expect.data(), n * 4));
  }
  cudaStreamDestroy(stream);
}

TEST(Accumulate, MeanSumsInOrder) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int n : {1, 2, 3, 7}) {
    const std::vector<float> src = test::random_uniform(static_cast<size_t>(n), 30 + n, 1.0f, 9.0f);
    DeviceBuffer<float> d_src(src), d_dst(1);
    mean_of(d_dst.get(), d_src.get(), n, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    float sum = 0.0f;
    for (float x : src) sum += x;
    const float expect = sum / static_cast<float>(n);
    const float got = d_dst.download()[0];
    EXPECT_TRUE(test::bit_equal("mean of " + std::to_string(n), &got, &expect, 4))
        << got << " vs " << expect;
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace replay
