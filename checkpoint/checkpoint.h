// Checkpoints in the safetensors layout, so Python tools can read them:
//   8 bytes   little-endian uint64 N: the header's length
//   N bytes   JSON: {"__metadata__": {string: string},
//                    name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
//             padded with spaces to a multiple of 8
//   the data  tensors back to back, offsets relative to the data's start
// dtypes: F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64.
//
// Note [Checkpoint integrity]
// The header begins with the checksum, always at the same bytes:
//   {"__metadata__":{"stepgraph.checksum":"fnv1a64:<16 hex digits>", ...
// It is FNV-1a (64 bits) over the whole file (the length, the header with its
// padding, the data) with those 16 digits read as '0'. read_checkpoint
// verifies it over the raw bytes before it interprets the header, then
// parses the header strictly: at most 3 levels of nesting, no duplicate
// keys, only dtype/shape/data_offsets in an entry, offsets that tile the
// data. So a corrupt, truncated or foreign file is Error(kIo) naming the file
// and what is wrong, and no input crashes the reader or makes it allocate
// more than the file's size implies. FNV-1a catches accidents (a torn or
// truncated write, a flipped bit, an edited byte), not tampering: anyone
// who can write the file can recompute it. Errors never print a header's
// values raw: names are escaped and cut short.
//
// write_checkpoint writes through an AtomicFile (Note [Atomic file writes]
// in checkpoint/atomic_file.h): a crash or a failed write leaves the old
// checkpoint whole. The trainer's per-rank files commit together through a
// manifest (Note [Checkpoint sets] in checkpoint/checkpoint_set.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/dtype.h"
#include "checkpoint/atomic_file.h"

namespace stepgraph {

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;  // numel * dtype_size(dtype), little-endian
};

struct Checkpoint {
  std::map<std::string, std::string> metadata;  // "stepgraph.checksum" is reserved
  std::vector<CheckpointTensor> tensors;        // written in this order
  std::string checksum;                         // set by read_checkpoint; write ignores it
};

inline constexpr std::string_view kChecksumKey = "stepgraph.checksum";

// Throws Error(kInvalidArgument) for a malformed checkpoint (duplicate or
// empty names, bytes that do not match the shape, the reserved key) and
// Error(kIo) when the file cannot be written; PATH is then unchanged.
// Returns the checksum ("fnv1a64:<16 hex digits>"). `observer` sees each
// point of the write (tests kill the writer there).
std::string write_checkpoint(const std::filesystem::path& path, const Checkpoint& checkpoint,
                             const WriteObserver& observer = {});
// The same into `file`, left uncommitted (the caller names it, then commits).
std::string write_checkpoint_to(AtomicFile& file, const Checkpoint& checkpoint);

// The metadata comes back without the checksum entry (it is in .checksum);
// tensors in file order.
Checkpoint read_checkpoint(const std::filesystem::path& path);

// A name or value read from a checkpoint, for an error message: quoted() of
// engine/printable_text.h, cut at the checkpoint messages' `limit`.
std::string printable(std::string_view text, std::size_t limit = 80);

// The tensor called `name`; Error(kIo) naming what is there when missing.
const CheckpointTensor& find_tensor(const Checkpoint& checkpoint, std::string_view name);
bool has_tensor(const Checkpoint& checkpoint, std::string_view name);

// "F32", "BF16", ... and back; parse throws Error(kIo) for other names,
// find returns nullopt.
std::string_view safetensors_dtype(DType dtype);
DType parse_safetensors_dtype(std::string_view name);
std::optional<DType> find_safetensors_dtype(std::string_view name);
inline constexpr std::string_view kSafetensorsDTypeList = "F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64";

}  // namespace stepgraph
