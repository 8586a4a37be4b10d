// Training data from a file (--data PATH): a text file, whose bytes are the
// tokens (vocab 256), or a StepGraph token file.
//
// Token file format (little-endian):
//   offset 0   8 bytes  magic "SGTOKEN1"
//   offset 8   uint32   bytes per token: 2 (uint16) or 4 (int32)
//   offset 12  uint32   vocab V >= 1 (every token is in [0, V))
//   offset 16  uint64   token count N
//   offset 24  N tokens
// A file that does not start with the magic is read as text.
//
// Example `row` of batch `position` starts at a uniform pseudo-random offset
// keyed by (seed, position, row): window = tokens[off, off + context), label =
// tokens[off + context].
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "trainer/data_source.h"

namespace stepgraph::trainer {

inline constexpr char kTokenFileMagic[8] = {'S', 'G', 'T', 'O', 'K', 'E', 'N', '1'};

// Throws Error(kIo) for a missing, unreadable, empty or malformed file.
std::unique_ptr<DataSource> open_token_data(const std::filesystem::path& path, std::uint64_t seed = 0);

// Writes `tokens` (each in [0, vocab)) as a token file, uint16 when vocab <=
// 65536. Throws Error(kInvalidArgument) for bad tokens, Error(kIo) on failure.
void write_token_file(const std::filesystem::path& path, std::int64_t vocab, std::span<const std::int32_t> tokens);

}  // namespace stepgraph::trainer
