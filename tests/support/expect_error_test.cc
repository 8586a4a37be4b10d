// EXPECT_ERROR_CONTAINS passes only when the statement raises a
// stepgraph::Error whose message has every word.
#include "tests/support/expect_error.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "engine/error.h"

namespace stepgraph::testing {
namespace {

void refuse(int rank) { SG_CHECK(rank == 2, "gemm needs 2-D operands, got rank ", rank); }

TEST(ExpectErrorContainsTest, PassesWhenEveryWordIsInTheMessage) {
  EXPECT_ERROR_CONTAINS(refuse(3), "gemm", "rank 3");
  EXPECT_ERROR_CONTAINS(const int unused = (refuse(1), 0); (void)unused, "got rank 1");  // a declaration
}

TEST(ExpectErrorContainsTest, FailsWhenAWordIsMissing) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR_CONTAINS(refuse(3), "gemm", "rank 4"), "without 'rank 4'");
}

TEST(ExpectErrorContainsTest, FailsWhenNothingIsRaised) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR_CONTAINS(refuse(2), "gemm"), "refuse(2)\n  raised nothing");
}

TEST(ExpectErrorContainsTest, FailsOnAnotherException) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR_CONTAINS(throw std::runtime_error("gemm"), "gemm"),
                          "raised a non-stepgraph exception: gemm");
}

}  // namespace
}  // namespace stepgraph::testing
