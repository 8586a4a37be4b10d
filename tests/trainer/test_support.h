// For the trainer tests: a fresh path under the test's temporary directory,
// whole-file reads and writes, and a check for a clear error.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <string_view>

#include "engine/error.h"

namespace stepgraph::trainer::testing {

// TEST_TMPDIR/<suite>.<test>.<name>, removed first if it exists.
inline std::filesystem::path fresh_path(std::string_view name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::filesystem::path path = std::filesystem::path(::testing::TempDir()) /
                               (std::string(info->test_suite_name()) + "." + info->name() + "." + std::string(name));
  std::filesystem::remove_all(path);
  return path;
}

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Expects `call` to throw Error(code) whose message contains every one of `words`.
template <typename Call>
void expect_error(Call&& call, ErrorCode code, std::initializer_list<std::string> words) {
  try {
    call();
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.message();
    for (const std::string& word : words) EXPECT_NE(error.message().find(word), std::string::npos) << error.message();
  }
}

}  // namespace stepgraph::trainer::testing
