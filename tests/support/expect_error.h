// Checks that a bad input raises a stepgraph::Error whose message names the
// problem, not only that some Error was raised.
//
//   EXPECT_ERROR_CONTAINS(shape.dim(2), "dim 2", "rank 2");
//   EXPECT_ERROR_CONTAINS(StreamCapture capture(cudaStreamLegacy), "legacy");
//
// Fails (non-fatally, at the caller's line) when the statement raises
// nothing, raises something other than stepgraph::Error, or raises an Error
// whose message() lacks one of the words (case-sensitive substrings).
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>

#include "engine/error.h"

namespace stepgraph::testing {

template <typename Call>
::testing::AssertionResult raises_error_containing(const char* statement, Call&& call,
                                                   std::initializer_list<std::string_view> words) {
  try {
    call();
  } catch (const Error& error) {
    std::string missing;
    for (const std::string_view word : words) {
      if (error.message().find(word) == std::string::npos) missing += (missing.empty() ? "'" : ", '") + std::string(word) + "'";
    }
    if (missing.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << statement << "\n  raised: " << error.what() << "\n  without " << missing;
  } catch (const std::exception& other) {
    return ::testing::AssertionFailure() << statement << "\n  raised a non-stepgraph exception: " << other.what();
  }
  return ::testing::AssertionFailure() << statement << "\n  raised nothing; expected a stepgraph::Error";
}

// Throws stepgraph::Error with `code` and a message containing `mentions`
// (a non-fatal failure otherwise).
template <typename Call>
void expect_error_code(Call&& call, ErrorCode code, std::string_view mentions) {
  try {
    call();
    ADD_FAILURE() << "no error; expected " << error_code_name(code) << " mentioning '" << mentions << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.what();
    EXPECT_NE(error.message().find(mentions), std::string::npos) << error.what();
  }
}

}  // namespace stepgraph::testing

// The statement may be a declaration (it runs as the body of a lambda).
#define EXPECT_ERROR_CONTAINS(statement, ...)                                                         \
  do {                                                                                                \
    const ::testing::AssertionResult sg_raised_ = ::stepgraph::testing::raises_error_containing(      \
        #statement, [&] { statement; }, {__VA_ARGS__});                                               \
    if (!sg_raised_) ADD_FAILURE() << sg_raised_.message();                                           \
  } while (false)
