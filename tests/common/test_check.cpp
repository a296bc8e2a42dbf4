// Error messages name the library, the status, the call, file:line and the rank.
#include "common/check.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn_graph.h>
#include <gtest/gtest.h>
#include <nccl.h>

namespace replay {
namespace {

TEST(Check, CudaErrorNamesLibraryStatusCallAndLocation) {
  try {
    REPLAY_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "no exception";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.library(), "CUDA");
    EXPECT_NE(m.find("cudaErrorInvalidValue"), std::string::npos) << m;
    EXPECT_NE(m.find("test_check.cpp:"), std::string::npos) << m;
    EXPECT_NE(m.find("in cudaErrorInvalidValue"), std::string::npos) << m;
  }
}

TEST(Check, CublasAndCudnnAndNccl) {
  EXPECT_THROW(REPLAY_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED), Error);
  EXPECT_THROW(REPLAY_CUDNN_CHECK(CUDNN_STATUS_BAD_PARAM), Error);
  EXPECT_THROW(REPLAY_NCCL_CHECK(ncclInvalidArgument), Error);
  EXPECT_NO_THROW(REPLAY_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
  try {
    REPLAY_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED);
  } catch (const Error& e) {
    EXPECT_EQ(e.library(), "cuBLASLt");
    EXPECT_EQ(e.status(), "CUBLAS_STATUS_NOT_SUPPORTED");
  }
  try {
    REPLAY_NCCL_CHECK(ncclInvalidArgument);
  } catch (const Error& e) {
    EXPECT_EQ(e.library(), "NCCL");
    EXPECT_NE(std::string(e.what()).find("invalid argument"), std::string::npos) << e.what();
  }
}

TEST(Check, HdfAndMpiNegativeStatus) {
  EXPECT_NO_THROW(REPLAY_HDF5_CHECK(0));
  EXPECT_THROW(REPLAY_HDF5_CHECK(-1), Error);
  EXPECT_THROW(REPLAY_MPI_CHECK(1), Error);  // any non-MPI_SUCCESS value
}

TEST(Check, RankAppearsWhenSet) {
  set_error_rank(3);
  try {
    REPLAY_REQUIRE(1 == 2, "explanation");
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("[rank 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("1 == 2"), std::string::npos) << m;
    EXPECT_NE(m.find("explanation"), std::string::npos) << m;
  }
  set_error_rank(-1);
  try {
    REPLAY_REQUIRE(false, "x");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("[rank"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace replay
