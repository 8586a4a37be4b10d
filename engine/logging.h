// The `stepgraph` spdlog logger. Its level comes from the environment variable
// STEPGRAPH_LOG (trace, debug, info, warn, error, critical, off; default warn),
// read once when the logger is first used. Output goes to stderr.
//
//   stepgraph::logger().info("captured {} nodes in {:.2f} ms", n, ms);
#pragma once

#include <spdlog/logger.h>

#include <optional>
#include <string_view>

namespace stepgraph {

inline constexpr spdlog::level::level_enum kDefaultLogLevel = spdlog::level::warn;

spdlog::logger& logger();

// "debug" -> debug; case-insensitive; "warning" is accepted for warn.
// nullopt for anything else.
std::optional<spdlog::level::level_enum> parse_log_level(std::string_view text);

// The level a value of STEPGRAPH_LOG selects: unset or empty gives the
// default; a value that is no level gives the default and a warning.
spdlog::level::level_enum log_level_from_env(const char* value);

}  // namespace stepgraph
