// The check macros turn library status codes into Errors; no GPU needed.
#include "engine/cuda_check.h"

#include <gtest/gtest.h>

#include <string>

namespace stepgraph {
namespace {

TEST(CudaCheckTest, SuccessDoesNotThrow) {
  EXPECT_NO_THROW(SG_CUDA_CHECK(cudaSuccess));
  EXPECT_NO_THROW(SG_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
}

TEST(CudaCheckTest, CudaFailureNamesTheCallAndTheError) {
  try {
    SG_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kCuda);
    EXPECT_NE(error.message().find("cudaErrorInvalidValue failed: cudaErrorInvalidValue"), std::string::npos)
        << error.message();
  }
}

TEST(CudaCheckTest, OutOfMemoryAndMissingDriverGetTheirOwnCodes) {
  try {
    SG_CUDA_CHECK(cudaErrorMemoryAllocation);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kOutOfMemory);
    EXPECT_NE(error.message().find("failed: cudaErrorMemoryAllocation"), std::string::npos) << error.message();
  }
  try {
    SG_CUDA_CHECK(cudaErrorNoDevice);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNoDevice);
    EXPECT_NE(error.message().find("failed: cudaErrorNoDevice"), std::string::npos) << error.message();
  }
}

TEST(CudaCheckTest, CublasFailureNamesTheStatus) {
  try {
    SG_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kCublas);
    EXPECT_NE(error.message().find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos) << error.message();
  }
  try {
    SG_CUBLAS_CHECK(CUBLAS_STATUS_ALLOC_FAILED);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kOutOfMemory);
    EXPECT_NE(error.message().find("failed: CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos) << error.message();
  }
}

}  // namespace
}  // namespace stepgraph
