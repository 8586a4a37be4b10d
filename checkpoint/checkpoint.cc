#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "engine/error.h"
#include "engine/printable_text.h"
#include "checkpoint/checkpoint_header.h"

namespace stepgraph {
namespace {

static_assert(std::endian::native == std::endian::little, "the safetensors layout is little-endian");

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kChecksumPrefix = "fnv1a64:";
// The header's first bytes; the checksum's 16 hex digits and a quote follow.
constexpr std::string_view kHeaderStart = R"({"__metadata__":{"stepgraph.checksum":"fnv1a64:)";
constexpr std::size_t kDigits = 16;
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the safetensors limit
constexpr std::size_t kChunk = std::size_t{1} << 20;

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

// FNV-1a, 64 bits: catches accidents, not tampering (Note [Checkpoint integrity]).
class Fnv1a64 {
 public:
  void update(const void* data, std::size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    std::uint64_t hash = hash_;
    for (std::size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ULL;
    hash_ = hash;
  }
  std::string digits() const { return fmt::format("{:016x}", hash_); }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
};

// A JSON string of our own (trusted) text; Error for text that is not UTF-8.
std::string json_string(const std::string& text) {
  try {
    return Json(text).dump();
  } catch (const Json::exception&) {
    SG_THROW(ErrorCode::kInvalidArgument, "checkpoint metadata or tensor name ", printable(text),
             " is not valid UTF-8");
  }
}

// The header, the checksum's digits as zeros, padded so the data starts
// 8-byte aligned. See Note [Checkpoint integrity].
std::string header_text(const Checkpoint& checkpoint) {
  std::string text(kHeaderStart);
  text.append(kDigits, '0');
  text += '"';
  for (const auto& [key, value] : checkpoint.metadata) {
    SG_CHECK(key != kChecksumKey, "checkpoint metadata key '", kChecksumKey, "' is reserved for the checksum");
    text += "," + json_string(key) + ":" + json_string(value);
  }
  text += "}";
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (const CheckpointTensor& tensor : checkpoint.tensors) {
    SG_CHECK(!tensor.name.empty() && tensor.name != kMetadataKey, "checkpoint tensor name '", tensor.name,
             "' is not allowed");
    SG_CHECK(names.insert(tensor.name).second, "checkpoint has two tensors named '", tensor.name, "'");
    SG_CHECK(tensor.shape.size() <= checkpoint_detail::kMaxDimensions, "checkpoint tensor '", tensor.name, "' has ",
             tensor.shape.size(), " dimensions; at most ", checkpoint_detail::kMaxDimensions, " are written");
    const std::optional<std::uint64_t> size = checkpoint_detail::byte_size(tensor.shape, tensor.dtype);
    SG_CHECK(size.has_value(), "checkpoint tensor '", tensor.name, "' has a negative or huge dimension");
    SG_CHECK(tensor.bytes.size() == *size, "checkpoint tensor '", tensor.name, "' has ", tensor.bytes.size(),
             " bytes; its shape and dtype ", dtype_name(tensor.dtype), " need ", *size);
    text += fmt::format(R"(,{}:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})", json_string(tensor.name),
                        safetensors_dtype(tensor.dtype), fmt::join(tensor.shape, ","), offset, offset + *size);
    offset += *size;
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

[[noreturn]] void corrupt(const std::filesystem::path& path, const std::string& what) {
  SG_THROW(ErrorCode::kIo, "checkpoint ", path, " is not a valid StepGraph checkpoint: ", what);
}

// Owns a descriptor for reading; closing never throws.
class ReadFd {
 public:
  explicit ReadFd(int fd) : fd_(fd) {}
  ReadFd(const ReadFd&) = delete;
  ReadFd& operator=(const ReadFd&) = delete;
  ~ReadFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// `size` bytes at `offset`; false where the file ends first.
bool read_at(int fd, std::uint64_t offset, void* data, std::size_t size, const std::filesystem::path& path) {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::pread(fd, bytes, size, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(got >= 0, ErrorCode::kIo, "cannot read checkpoint ", path, ": ", std::strerror(errno));
    if (got == 0) return false;
    bytes += got;
    size -= static_cast<std::size_t>(got);
    offset += static_cast<std::uint64_t>(got);
  }
  return true;
}

bool is_hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

}  // namespace

std::string printable(std::string_view text, std::size_t limit) { return quoted(text, limit); }

std::string_view safetensors_dtype(DType dtype) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  SG_THROW(ErrorCode::kInternal, "no safetensors name for dtype ", static_cast<int>(dtype));
}

std::optional<DType> find_safetensors_dtype(std::string_view name) {
  for (const DTypeName& entry : kDTypeNames) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

DType parse_safetensors_dtype(std::string_view name) {
  const std::optional<DType> found = find_safetensors_dtype(name);
  SG_CHECK_CODE(found.has_value(), ErrorCode::kIo, "checkpoint tensor dtype ", printable(name),
                " is not one StepGraph reads (", kSafetensorsDTypeList, ")");
  return *found;
}

std::string write_checkpoint_to(AtomicFile& file, const Checkpoint& checkpoint) {
  const std::string text = header_text(checkpoint);
  const std::uint64_t length = text.size();
  Fnv1a64 checksum;
  checksum.update(&length, sizeof(length));
  checksum.update(text.data(), text.size());
  file.write(&length, sizeof(length));
  file.write(text.data(), text.size());
  for (const CheckpointTensor& tensor : checkpoint.tensors) {
    checksum.update(tensor.bytes.data(), tensor.bytes.size());
    file.write(tensor.bytes.data(), tensor.bytes.size());
  }
  const std::string digits = checksum.digits();
  file.write_at(sizeof(length) + kHeaderStart.size(), digits.data(), digits.size());
  return std::string(kChecksumPrefix) + digits;
}

std::string write_checkpoint(const std::filesystem::path& path, const Checkpoint& checkpoint,
                             const WriteObserver& observer) {
  const std::string text = header_text(checkpoint);  // a malformed checkpoint creates no file
  AtomicFile file(path, observer);
  const std::string checksum = write_checkpoint_to(file, checkpoint);
  file.commit();
  return checksum;
}

Checkpoint read_checkpoint(const std::filesystem::path& path) {
  ReadFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    SG_CHECK_CODE(errno != ENOENT, ErrorCode::kIo, "checkpoint ", path, " does not exist");
    SG_THROW(ErrorCode::kIo, "cannot open checkpoint ", path, ": ", std::strerror(errno));
  }
  struct stat status {};
  SG_CHECK_CODE(::fstat(fd.get(), &status) == 0, ErrorCode::kIo, "cannot stat checkpoint ", path, ": ",
                std::strerror(errno));
  SG_CHECK_CODE(!S_ISDIR(status.st_mode), ErrorCode::kIo, "checkpoint ", path, " is a directory");
  SG_CHECK_CODE(S_ISREG(status.st_mode), ErrorCode::kIo, "checkpoint ", path, " is not a regular file");
  const auto size = static_cast<std::uint64_t>(status.st_size);

  if (size < 8) corrupt(path, fmt::format("it has {} bytes, fewer than the 8-byte header length", size));
  std::uint64_t length = 0;
  if (!read_at(fd.get(), 0, &length, sizeof(length), path)) corrupt(path, "it ended early");
  if (length > size - 8 || length > kMaxHeaderBytes) {
    corrupt(path, fmt::format("its header length {} does not fit its {} bytes (truncated, or not safetensors)", length,
                              size));
  }
  std::string text(length, '\0');
  if (!read_at(fd.get(), 8, text.data(), text.size(), path)) corrupt(path, "it ended early");

  // The checksum over the raw bytes, before anything in the header is read.
  if (text.size() < kHeaderStart.size() + kDigits + 1 || text.compare(0, kHeaderStart.size(), kHeaderStart) != 0 ||
      !std::all_of(text.begin() + kHeaderStart.size(), text.begin() + kHeaderStart.size() + kDigits, is_hex_digit) ||
      text[kHeaderStart.size() + kDigits] != '"') {
    corrupt(path,
            "its header does not begin with a StepGraph checksum (a safetensors file from elsewhere, or one "
            "written by an older StepGraph)");
  }
  const std::string stored = text.substr(kHeaderStart.size(), kDigits);
  std::fill_n(text.begin() + kHeaderStart.size(), kDigits, '0');
  Fnv1a64 header_checksum;
  header_checksum.update(&length, sizeof(length));
  header_checksum.update(text.data(), text.size());
  Fnv1a64 checksum = header_checksum;
  {
    std::vector<char> chunk(kChunk);
    std::uint64_t offset = 8 + length;
    while (offset < size) {
      const auto part = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, size - offset));
      if (!read_at(fd.get(), offset, chunk.data(), part, path)) corrupt(path, "it ended early");
      checksum.update(chunk.data(), part);
      offset += part;
    }
  }
  if (checksum.digits() != stored) {
    corrupt(path, fmt::format("checksum mismatch: stored {}{}, computed {}{} (the file is corrupt or truncated)",
                              kChecksumPrefix, stored, kChecksumPrefix, checksum.digits()));
  }
  std::copy(stored.begin(), stored.end(), text.begin() + static_cast<std::ptrdiff_t>(kHeaderStart.size()));

  checkpoint_detail::ParsedHeader header;
  try {
    header = checkpoint_detail::parse_checkpoint_header(text);
  } catch (const checkpoint_detail::HeaderError& error) {
    corrupt(path, error.what);
  }
  Checkpoint checkpoint;
  checkpoint.checksum = std::string(kChecksumPrefix) + stored;
  header.metadata.erase(std::string(kChecksumKey));
  checkpoint.metadata = std::move(header.metadata);

  // File order; an empty tensor sorts before the one that starts where it does.
  std::vector<checkpoint_detail::HeaderEntry>& entries = header.entries;
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return std::pair(a.begin, a.end) < std::pair(b.begin, b.end); });
  std::uint64_t offset = 0;
  for (const checkpoint_detail::HeaderEntry& entry : entries) {
    if (entry.begin != offset) {
      corrupt(path, fmt::format("tensor {} starts at {}, expected {} (gap or overlap)", printable(entry.name),
                                entry.begin, offset));
    }
    offset = entry.end;
  }
  const std::uint64_t data_size = size - 8 - length;
  if (data_size != offset) {
    corrupt(path, fmt::format("it has {} bytes of tensor data, its header describes {}{}", data_size, offset,
                              data_size < offset ? " (truncated)" : ""));
  }

  // The bytes again, hashed again: a file changed since the check is refused.
  Fnv1a64 again = header_checksum;
  checkpoint.tensors.reserve(entries.size());
  for (checkpoint_detail::HeaderEntry& entry : entries) {
    CheckpointTensor& tensor = checkpoint.tensors.emplace_back();
    tensor.name = std::move(entry.name);
    tensor.dtype = entry.dtype;
    tensor.shape = std::move(entry.shape);
    tensor.bytes.resize(entry.end - entry.begin);
    if (!read_at(fd.get(), 8 + length + entry.begin, tensor.bytes.data(), tensor.bytes.size(), path)) {
      corrupt(path, "it ended early (changed while being read)");
    }
    again.update(tensor.bytes.data(), tensor.bytes.size());
  }
  if (again.digits() != stored) corrupt(path, "it changed while being read; read it again");
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
  constexpr std::size_t kShown = 12;
  std::string names;
  for (std::size_t i = 0; i < std::min(kShown, checkpoint.tensors.size()); ++i) {
    names += (names.empty() ? "" : ", ") + printable(checkpoint.tensors[i].name);
  }
  if (checkpoint.tensors.size() > kShown) names += fmt::format(" and {} more", checkpoint.tensors.size() - kShown);
  SG_THROW(ErrorCode::kIo, "the checkpoint has no tensor '", name, "' (it has: ", names.empty() ? "none" : names,
           "); was it written by a different model?");
}

}  // namespace stepgraph
