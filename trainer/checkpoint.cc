#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "engine/error.h"

namespace stepgraph::trainer {
namespace {

static_assert(std::endian::native == std::endian::little, "the safetensors layout is little-endian");

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kChecksumPrefix = "fnv1a64:";
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the safetensors limit

struct DTypeName {
  DType dtype;
  std::string_view name;
};
constexpr std::array<DTypeName, 7> kDTypeNames = {{
    {DType::kFloat32, "F32"},
    {DType::kBFloat16, "BF16"},
    {DType::kFloat16, "F16"},
    {DType::kFloat8E4M3, "F8_E4M3"},
    {DType::kFloat8E5M2, "F8_E5M2"},
    {DType::kInt32, "I32"},
    {DType::kInt64, "I64"},
}};

// FNV-1a, 64 bits: enough to catch corruption (not tampering).
class Fnv1a64 {
 public:
  void update(const void* data, std::size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < size; ++i) hash_ = (hash_ ^ bytes[i]) * 0x100000001b3ULL;
  }
  std::string hex() const { return fmt::format("{}{:016x}", kChecksumPrefix, hash_); }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
};

// Bytes of a tensor; nullopt for a negative dimension or one past 2^62 bytes.
std::optional<std::uint64_t> byte_size(const std::vector<std::int64_t>& shape, DType dtype) {
  constexpr std::uint64_t kLimit = std::uint64_t{1} << 62;
  std::uint64_t bytes = dtype_size(dtype);
  for (std::int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && bytes > kLimit / static_cast<std::uint64_t>(dim)) return std::nullopt;
    bytes *= static_cast<std::uint64_t>(dim);
  }
  return bytes;
}

std::optional<DType> find_dtype(std::string_view name) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

constexpr std::string_view kDTypeList = "F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64";

// Owns a file descriptor; closing in the destructor never throws.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

void write_all(int fd, const void* data, std::size_t size, const std::filesystem::path& path) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(written > 0, ErrorCode::kIo, "cannot write checkpoint ", path, ": ", std::strerror(errno));
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void fsync_directory(const std::filesystem::path& path) {
  const std::filesystem::path directory = path.parent_path().empty() ? "." : path.parent_path();
  Fd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  SG_CHECK_CODE(fd.get() >= 0 && ::fsync(fd.get()) == 0, ErrorCode::kIo, "cannot sync directory ", directory,
                " after writing checkpoint ", path, ": ", std::strerror(errno));
}

// The header and its checksum. See Note [Checkpoint integrity].
Json build_header(const Checkpoint& checkpoint) {
  Json header = Json::object();
  Json metadata = Json::object();
  for (const auto& [key, value] : checkpoint.metadata) {
    SG_CHECK(key != kChecksumKey, "checkpoint metadata key '", kChecksumKey, "' is reserved for the checksum");
    metadata[key] = value;
  }
  header[kMetadataKey] = std::move(metadata);
  std::uint64_t offset = 0;
  for (const CheckpointTensor& tensor : checkpoint.tensors) {
    SG_CHECK(!tensor.name.empty() && tensor.name != kMetadataKey, "checkpoint tensor name '", tensor.name,
             "' is not allowed");
    SG_CHECK(!header.contains(tensor.name), "checkpoint has two tensors named '", tensor.name, "'");
    const std::optional<std::uint64_t> size = byte_size(tensor.shape, tensor.dtype);
    SG_CHECK(size.has_value(), "checkpoint tensor '", tensor.name, "' has a negative or huge dimension");
    const std::uint64_t bytes = *size;
    SG_CHECK(tensor.bytes.size() == bytes, "checkpoint tensor '", tensor.name, "' has ", tensor.bytes.size(),
             " bytes; its shape and dtype ", dtype_name(tensor.dtype), " need ", bytes);
    header[tensor.name] = {{"dtype", safetensors_dtype(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  return header;
}

std::string header_text(const Json& header, const std::filesystem::path& path) {
  try {
    return header.dump();
  } catch (const Json::exception& error) {
    SG_THROW(ErrorCode::kInvalidArgument, "checkpoint ", path, ": metadata or names are not valid UTF-8 (",
             error.what(), ")");
  }
}

[[noreturn]] void corrupt(const std::filesystem::path& path, const std::string& what) {
  SG_THROW(ErrorCode::kIo, "checkpoint ", path, " is not a valid StepGraph checkpoint: ", what);
}

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin;
  std::uint64_t end;
};

TensorEntry parse_entry(const std::filesystem::path& path, const std::string& name, const Json& entry) {
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
    corrupt(path, fmt::format("tensor '{}' lacks dtype, shape or data_offsets", name));
  }
  const Json& dtype = entry["dtype"];
  const Json& shape = entry["shape"];
  const Json& offsets = entry["data_offsets"];
  if (!dtype.is_string()) corrupt(path, fmt::format("tensor '{}' has a dtype that is not a string", name));
  const std::optional<DType> found = find_dtype(dtype.get<std::string>());
  if (!found)
    corrupt(path, fmt::format("tensor '{}' has dtype {}; StepGraph reads {}", name, dtype.dump(), kDTypeList));
  TensorEntry out{name, *found, {}, 0, 0};
  if (!shape.is_array()) corrupt(path, fmt::format("tensor '{}' has a shape that is not a list", name));
  for (const Json& dim : shape) {
    if (!dim.is_number_unsigned() || dim.get<std::uint64_t>() > std::uint64_t{1} << 62) {
      corrupt(path, fmt::format("tensor '{}' has a bad dimension {}", name, dim.dump()));
    }
    out.shape.push_back(dim.get<std::int64_t>());
  }
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    corrupt(path, fmt::format("tensor '{}' has bad data_offsets {}", name, offsets.dump()));
  }
  out.begin = offsets[0].get<std::uint64_t>();
  out.end = offsets[1].get<std::uint64_t>();
  const std::optional<std::uint64_t> bytes = byte_size(out.shape, out.dtype);
  if (!bytes) corrupt(path, fmt::format("tensor '{}' has a shape too large for any file", name));
  if (out.end < out.begin || out.end - out.begin != *bytes) {
    corrupt(path, fmt::format("tensor '{}' has data_offsets [{}, {}] but its shape and dtype need {} bytes", name,
                              out.begin, out.end, *bytes));
  }
  return out;
}

void read_exact(std::ifstream& in, void* data, std::size_t size, const std::filesystem::path& path) {
  in.read(static_cast<char*>(data), static_cast<std::streamsize>(size));
  SG_CHECK_CODE(in.good() || (size == 0 && !in.bad()), ErrorCode::kIo, "cannot read checkpoint ", path,
                ": it ended early");
}

}  // namespace

std::string_view safetensors_dtype(DType dtype) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  SG_THROW(ErrorCode::kInternal, "no safetensors name for dtype ", static_cast<int>(dtype));
}

DType parse_safetensors_dtype(std::string_view name) {
  const std::optional<DType> found = find_dtype(name);
  SG_CHECK_CODE(found.has_value(), ErrorCode::kIo, "checkpoint tensor dtype '", name, "' is not one StepGraph reads (",
                kDTypeList, ")");
  return *found;
}

void write_checkpoint(const std::filesystem::path& path, const Checkpoint& checkpoint) {
  Json header = build_header(checkpoint);
  Fnv1a64 checksum;
  const std::string unsigned_text = header_text(header, path);
  checksum.update(unsigned_text.data(), unsigned_text.size());
  for (const CheckpointTensor& tensor : checkpoint.tensors) checksum.update(tensor.bytes.data(), tensor.bytes.size());
  header[kMetadataKey][kChecksumKey] = checksum.hex();
  std::string text = header_text(header, path);
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::uint64_t length = text.size();

  std::filesystem::path temporary = path;
  temporary += ".tmp";
  Fd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  SG_CHECK_CODE(fd.get() >= 0, ErrorCode::kIo, "cannot create ", temporary, " to write checkpoint ", path, ": ",
                std::strerror(errno), "; the previous checkpoint is unchanged");
  try {
    write_all(fd.get(), &length, sizeof(length), temporary);
    write_all(fd.get(), text.data(), text.size(), temporary);
    for (const CheckpointTensor& tensor : checkpoint.tensors) {
      write_all(fd.get(), tensor.bytes.data(), tensor.bytes.size(), temporary);
    }
    SG_CHECK_CODE(::fsync(fd.get()) == 0, ErrorCode::kIo, "cannot sync ", temporary, ": ", std::strerror(errno));
    SG_CHECK_CODE(::close(fd.release()) == 0, ErrorCode::kIo, "cannot close ", temporary, ": ", std::strerror(errno));
    SG_CHECK_CODE(::rename(temporary.c_str(), path.c_str()) == 0, ErrorCode::kIo, "cannot rename ", temporary, " over ",
                  path, ": ", std::strerror(errno));
  } catch (const Error&) {
    ::unlink(temporary.c_str());  // the old checkpoint, if any, is untouched
    throw;
  }
  fsync_directory(path);
}

Checkpoint read_checkpoint(const std::filesystem::path& path) {
  std::error_code error;
  const bool exists = std::filesystem::exists(path, error);
  SG_CHECK_CODE(exists && !std::filesystem::is_directory(path, error), ErrorCode::kIo, "checkpoint ", path,
                exists ? " is a directory" : " does not exist");
  const std::uint64_t size = std::filesystem::file_size(path, error);
  SG_CHECK_CODE(!error, ErrorCode::kIo, "cannot stat checkpoint ", path, ": ", error.message());
  std::ifstream in(path, std::ios::binary);
  SG_CHECK_CODE(in.good(), ErrorCode::kIo, "cannot open checkpoint ", path, ": ", std::strerror(errno));

  if (size < 8) corrupt(path, fmt::format("it has {} bytes, fewer than the 8-byte header length", size));
  std::uint64_t length = 0;
  read_exact(in, &length, sizeof(length), path);
  if (length > size - 8 || length > kMaxHeaderBytes) {
    corrupt(path, fmt::format("its header length {} does not fit its {} bytes (truncated, or not safetensors)", length,
                              size));
  }
  std::string text(length, '\0');
  read_exact(in, text.data(), text.size(), path);
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& parse_error) {
    corrupt(path, fmt::format("its header is not JSON ({})", parse_error.what()));
  }
  if (!header.is_object()) corrupt(path, "its header is not a JSON object");

  Checkpoint checkpoint;
  auto metadata = header.find(kMetadataKey);
  if (metadata == header.end() || !metadata->is_object()) corrupt(path, "it has no __metadata__ object");
  auto stored = metadata->find(kChecksumKey);
  if (stored == metadata->end() || !stored->is_string()) {
    corrupt(path, fmt::format("its __metadata__ has no {} (not written by StepGraph)", kChecksumKey));
  }
  const std::string stored_checksum = stored->get<std::string>();
  metadata->erase(stored);
  for (const auto& [key, value] : metadata->items()) {
    if (!value.is_string()) corrupt(path, fmt::format("metadata '{}' is not a string", key));
    checkpoint.metadata[key] = value.get<std::string>();
  }

  std::vector<TensorEntry> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name != kMetadataKey) entries.push_back(parse_entry(path, name, entry));
  }
  // File order; an empty tensor sorts before the one that starts where it does.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return std::pair(a.begin, a.end) < std::pair(b.begin, b.end); });
  std::uint64_t offset = 0;
  for (const TensorEntry& entry : entries) {
    if (entry.begin != offset) {
      corrupt(path,
              fmt::format("tensor '{}' starts at {}, expected {} (gap or overlap)", entry.name, entry.begin, offset));
    }
    offset = entry.end;
  }
  const std::uint64_t data_size = size - 8 - length;
  if (data_size != offset) {
    corrupt(path, fmt::format("it has {} bytes of tensor data, its header describes {}{}", data_size, offset,
                              data_size < offset ? " (truncated)" : ""));
  }

  Fnv1a64 checksum;
  const std::string unsigned_text = header.dump();
  checksum.update(unsigned_text.data(), unsigned_text.size());
  for (const TensorEntry& entry : entries) {
    CheckpointTensor& tensor = checkpoint.tensors.emplace_back();
    tensor.name = entry.name;
    tensor.dtype = entry.dtype;
    tensor.shape = entry.shape;
    tensor.bytes.resize(entry.end - entry.begin);
    read_exact(in, tensor.bytes.data(), tensor.bytes.size(), path);
    checksum.update(tensor.bytes.data(), tensor.bytes.size());
  }
  if (checksum.hex() != stored_checksum) {
    corrupt(path, fmt::format("checksum mismatch: stored {}, computed {} (the file is corrupt)", stored_checksum,
                              checksum.hex()));
  }
  return checkpoint;
}

bool has_tensor(const Checkpoint& checkpoint, std::string_view name) {
  for (const CheckpointTensor& tensor : checkpoint.tensors) {
    if (tensor.name == name) return true;
  }
  return false;
}

const CheckpointTensor& find_tensor(const Checkpoint& checkpoint, std::string_view name) {
  for (const CheckpointTensor& tensor : checkpoint.tensors) {
    if (tensor.name == name) return tensor;
  }
  std::string names;
  for (const CheckpointTensor& tensor : checkpoint.tensors) names += (names.empty() ? "" : ", ") + tensor.name;
  SG_THROW(ErrorCode::kIo, "the checkpoint has no tensor '", name, "' (it has: ", names.empty() ? "none" : names,
           "); was it written by a different model?");
}

}  // namespace stepgraph::trainer
