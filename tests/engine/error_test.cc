#include "engine/error.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace stepgraph {
namespace {

TEST(ErrorTest, CheckPassesWithoutEvaluatingTheMessage) {
  int evaluated = 0;
  auto message = [&] {
    ++evaluated;
    return "never";
  };
  SG_CHECK(1 + 1 == 2, message());
  EXPECT_EQ(evaluated, 0);
}

TEST(ErrorTest, CheckFailureCarriesCodeMessageAndPlace) {
  try {
    const int rank = 3;
    SG_CHECK(rank == 2, "gemm needs 2-D operands, got rank ", rank);
    FAIL() << "SG_CHECK did not throw";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(error.message(), "gemm needs 2-D operands, got rank 3");
    EXPECT_NE(std::string(error.place().file).find("error_test.cc"), std::string::npos);
    EXPECT_GT(error.place().line, 0);
    const std::string what = error.what();
    EXPECT_EQ(what.rfind("[invalid_argument] gemm needs 2-D operands, got rank 3 (", 0), 0u) << what;
    EXPECT_NE(what.find("error_test.cc:"), std::string::npos) << what;
  }
}

TEST(ErrorTest, CheckCodeAndThrowUseTheGivenCode) {
  EXPECT_THROW(
      {
        try {
          SG_CHECK_CODE(false, ErrorCode::kInvalidState, "replay after release");
        } catch (const Error& error) {
          EXPECT_EQ(error.code(), ErrorCode::kInvalidState);
          EXPECT_EQ(error.message(), "replay after release");
          throw;
        }
      },
      Error);
  try {
    SG_THROW(ErrorCode::kUnsupported, "fp8 ", "epilogue");
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
    EXPECT_EQ(error.message(), "fp8 epilogue");
  }
}

TEST(ErrorTest, EveryCodeHasADistinctName) {
  std::set<std::string> names;
  for (int value = static_cast<int>(ErrorCode::kInvalidArgument); value <= static_cast<int>(ErrorCode::kInternal);
       ++value) {
    const std::string name(error_code_name(static_cast<ErrorCode>(value)));
    EXPECT_NE(name, "unknown") << "code " << value;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), static_cast<std::size_t>(ErrorCode::kInternal));
}

TEST(ErrorTest, ErrorIsAStdException) {
  try {
    SG_CHECK(false, "plain");
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("plain"), std::string::npos);
  }
}

}  // namespace
}  // namespace stepgraph
