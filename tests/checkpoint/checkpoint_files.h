// For the checkpoint tests: files built byte by byte with a correct
// checksum (Note [Checkpoint integrity]), so a test reaches the parser with
// any header it likes, as a writer that recomputes the checksum would.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

namespace stepgraph::trainer::testing {

inline constexpr std::string_view kHeaderStart = R"({"__metadata__":{"stepgraph.checksum":"fnv1a64:)";

inline std::uint64_t fnv1a64(std::string_view bytes, std::uint64_t hash = 0xcbf29ce484222325ULL) {
  for (const char c : bytes) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return hash;
}

// A checkpoint file whose header is kHeaderStart, the checksum, and `rest`
// (what follows the checksum's closing quote: `,"k":"v"},"w":{...}}`), then
// `data`; `pad` pads the header to 8 bytes as the writer does.
inline std::string sealed_file(std::string_view rest, std::string_view data, bool pad = true) {
  std::string header = std::string(kHeaderStart) + std::string(16, '0') + "\"" + std::string(rest);
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const std::uint64_t length = header.size();
  std::memcpy(file.data(), &length, 8);
  file += header;
  file += data;
  const std::string digits = fmt::format("{:016x}", fnv1a64(file));
  file.replace(8 + kHeaderStart.size(), 16, digits);
  return file;
}

// The same checksum over `file` recomputed in place (after an edit).
inline std::string resealed(std::string file) {
  file.replace(8 + kHeaderStart.size(), 16, std::string(16, '0'));
  const std::string digits = fmt::format("{:016x}", fnv1a64(file));
  file.replace(8 + kHeaderStart.size(), 16, digits);
  return file;
}

}  // namespace stepgraph::trainer::testing
