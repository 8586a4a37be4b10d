#include "engine/logging.h"

#include <gtest/gtest.h>

namespace stepgraph {
namespace {

TEST(LoggingTest, LoggerIsNamedStepgraph) { EXPECT_EQ(logger().name(), "stepgraph"); }

TEST(LoggingTest, ParsesEveryLevelCaseInsensitively) {
  EXPECT_EQ(parse_log_level("trace"), spdlog::level::trace);
  EXPECT_EQ(parse_log_level("DEBUG"), spdlog::level::debug);
  EXPECT_EQ(parse_log_level("Info"), spdlog::level::info);
  EXPECT_EQ(parse_log_level("warn"), spdlog::level::warn);
  EXPECT_EQ(parse_log_level("warning"), spdlog::level::warn);
  EXPECT_EQ(parse_log_level("error"), spdlog::level::err);
  EXPECT_EQ(parse_log_level("critical"), spdlog::level::critical);
  EXPECT_EQ(parse_log_level("off"), spdlog::level::off);
  EXPECT_EQ(parse_log_level("verbose"), std::nullopt);
  EXPECT_EQ(parse_log_level(""), std::nullopt);
}

TEST(LoggingTest, EnvironmentValueSelectsTheLevel) {
  EXPECT_EQ(log_level_from_env(nullptr), kDefaultLogLevel);
  EXPECT_EQ(log_level_from_env(""), kDefaultLogLevel);
  EXPECT_EQ(log_level_from_env("debug"), spdlog::level::debug);
  EXPECT_EQ(log_level_from_env("loud"), kDefaultLogLevel);  // warns on stderr
}

}  // namespace
}  // namespace stepgraph
