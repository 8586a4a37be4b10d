// Checkpoints in the safetensors layout, so Python tools can read them:
//   8 bytes   little-endian uint64 N: the header's length
//   N bytes   JSON: {"__metadata__": {string: string},
//                    name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
//             padded with spaces to a multiple of 8
//   the data  tensors back to back, offsets relative to the data's start
// dtypes: F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64.
//
// Note [Checkpoint integrity]
// write_checkpoint writes PATH.tmp, fsyncs it, renames it over PATH and fsyncs
// the directory: a crash or a failed write leaves the old checkpoint whole.
// __metadata__["stepgraph.checksum"] = "fnv1a64:<16 hex digits>" covers the
// header without that entry (as compact JSON, keys sorted) and the data;
// read_checkpoint verifies it and every offset, so a corrupt, truncated or
// foreign file is Error(kIo) naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/dtype.h"

namespace stepgraph::trainer {

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;  // numel * dtype_size(dtype), little-endian
};

struct Checkpoint {
  std::map<std::string, std::string> metadata;  // "stepgraph.checksum" is reserved
  std::vector<CheckpointTensor> tensors;        // written in this order
};

inline constexpr std::string_view kChecksumKey = "stepgraph.checksum";

// Throws Error(kInvalidArgument) for a malformed checkpoint (duplicate or
// empty names, bytes that do not match the shape, the reserved key) and
// Error(kIo) when the file cannot be written; PATH is then unchanged.
void write_checkpoint(const std::filesystem::path& path, const Checkpoint& checkpoint);

// The metadata comes back without the checksum entry; tensors in file order.
Checkpoint read_checkpoint(const std::filesystem::path& path);

// The tensor called `name`; Error(kIo) naming what is there when missing.
const CheckpointTensor& find_tensor(const Checkpoint& checkpoint, std::string_view name);
bool has_tensor(const Checkpoint& checkpoint, std::string_view name);

// "F32", "BF16", ... and back; parse throws Error(kIo) for other names.
std::string_view safetensors_dtype(DType dtype);
DType parse_safetensors_dtype(std::string_view name);

}  // namespace stepgraph::trainer
