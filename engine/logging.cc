#include "engine/logging.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

namespace stepgraph {
namespace {

spdlog::logger* make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto* made = new spdlog::logger("stepgraph", std::move(sink));
  made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [stepgraph] [%l] %v");
  made->set_level(log_level_from_env(std::getenv("STEPGRAPH_LOG")));
  return made;
}

}  // namespace

spdlog::level::level_enum log_level_from_env(const char* value) {
  if (value == nullptr || *value == '\0') return kDefaultLogLevel;
  if (auto level = parse_log_level(value)) return *level;
  std::fprintf(stderr,
               "[stepgraph] [warning] STEPGRAPH_LOG='%s' is not a level (trace, debug, info, warn, error, "
               "critical, off); using warn\n",
               value);
  return kDefaultLogLevel;
}

spdlog::logger& logger() {
  // Deliberately leaked: errors raised from static destructors may still log.
  static spdlog::logger* const instance = make_logger();
  return *instance;
}

std::optional<spdlog::level::level_enum> parse_log_level(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "warning") return spdlog::level::warn;
  if (lower == "trace") return spdlog::level::trace;
  if (lower == "debug") return spdlog::level::debug;
  if (lower == "info") return spdlog::level::info;
  if (lower == "warn") return spdlog::level::warn;
  if (lower == "error" || lower == "err") return spdlog::level::err;
  if (lower == "critical") return spdlog::level::critical;
  if (lower == "off") return spdlog::level::off;
  return std::nullopt;
}

}  // namespace stepgraph
