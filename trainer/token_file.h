// Training data from a file (--data PATH): a text file, whose bytes are the
// tokens (vocab 256), or a StepGraph token file.
//
// Token file format (little-endian):
//   offset 0   8 bytes  magic "SGTOKEN1"
//   offset 8   uint32   bytes per token: 2 (uint16) or 4 (int32)
//   offset 12  uint32   vocab V >= 1 (every token is in [0, V))
//   offset 16  uint64   token count N
//   offset 24  N tokens
// A file that does not start with "SGTOKEN" is read as text; one that starts
// with it but not with the magic (another version) is an error.
//
// Both are read in place (trainer/file_reader.h), never copied into memory:
// each example's bytes are read as it is drawn, and a token file's tokens are
// checked once at open, a megabyte at a time.
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

// What a data file holds, from its header (token file) or its size (text).
struct DataFileInfo {
  bool token_file = false;           // false: text, a token per byte
  std::uint32_t bytes_per_token = 1;  // 1 (text), 2 or 4
  std::int64_t vocab = 256;          // every token is in [0, vocab)
  std::uint64_t tokens = 0;
};

// Reads only the header: cheap for any size, so the vocabulary a file claims
// can be checked against memory before anything is allocated. Throws
// Error(kIo) naming the file and what is wrong for a missing, unreadable,
// empty, non-regular or malformed file (bad magic, bytes per token, vocab, a
// token count that disagrees with the size, fewer than 2 tokens).
DataFileInfo inspect_data_file(const std::filesystem::path& path);

// Everything inspect_data_file checks, and every token in [0, vocab).
std::unique_ptr<DataSource> open_token_data(const std::filesystem::path& path, std::uint64_t seed = 0);

// Writes `tokens` (each in [0, vocab)) as a token file, uint16 when vocab <=
// 65536. Throws Error(kInvalidArgument) for bad tokens, Error(kIo) on failure.
void write_token_file(const std::filesystem::path& path, std::int64_t vocab, std::span<const std::int32_t> tokens);

}  // namespace stepgraph::trainer
