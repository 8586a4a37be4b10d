#include "engine/nccl_check.h"

#include <gtest/gtest.h>

#include <string>

namespace stepgraph {
namespace {

TEST(NcclCheckTest, FailureIsAnNcclErrorWithNcclsText) {
  EXPECT_NO_THROW(SG_NCCL_CHECK(ncclSuccess));
  try {
    SG_NCCL_CHECK(ncclInvalidArgument);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNccl);
    EXPECT_NE(error.message().find("ncclInvalidArgument failed: "), std::string::npos) << error.message();
    EXPECT_NE(error.message().find(ncclGetErrorString(ncclInvalidArgument)), std::string::npos) << error.message();
  }
}

}  // namespace
}  // namespace stepgraph
