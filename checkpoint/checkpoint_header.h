// The strict parser of a checkpoint's JSON header (Note [Checkpoint
// integrity] in checkpoint/checkpoint.h), internal to the checkpoint library.
// A SAX handler: no JSON tree is built, nesting past the schema's 3 levels
// stops the parse at once, and every value is checked where it is read.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/dtype.h"

namespace stepgraph::checkpoint_detail {

struct HeaderEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct ParsedHeader {
  std::map<std::string, std::string> metadata;  // with the checksum entry
  std::vector<HeaderEntry> entries;             // in header order
};

// What is wrong with a header, in words safe to print (values escaped).
struct HeaderError {
  std::string what;
};

inline constexpr int kMaxHeaderDepth = 3;  // the root, an entry, its shape
inline constexpr std::size_t kMaxDimensions = 16;

// Throws HeaderError for anything but the schema: a JSON object of
// "__metadata__" (an object of strings) and tensor entries, each exactly
// {"dtype": name, "shape": [unsigned...], "data_offsets": [begin, end]}
// whose offsets span the bytes its shape and dtype need.
ParsedHeader parse_checkpoint_header(std::string_view text);

// Bytes of a tensor of `shape` and `dtype`; nullopt for a negative
// dimension or a product past 2^62 bytes (the reader and the writer agree).
std::optional<std::uint64_t> byte_size(const std::vector<std::int64_t>& shape, DType dtype);

}  // namespace stepgraph::checkpoint_detail
