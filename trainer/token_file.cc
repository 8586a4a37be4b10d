#include "trainer/token_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "trainer/counter_rng.h"
#include "trainer/mapped_file.h"

namespace stepgraph::trainer {
namespace {

static_assert(std::endian::native == std::endian::little, "token files are read as little-endian memory");

constexpr std::uint64_t kOffsetStream = 3;
constexpr std::size_t kHeaderBytes = 24;
constexpr std::size_t kMagicPrefix = 7;  // "SGTOKEN": the format's name; the 8th byte is its version
// Tokens are checked this many bytes at a time, each window's pages released
// after its check, so opening a large file never holds it all resident.
constexpr std::size_t kCheckWindowBytes = std::size_t{64} << 20;

template <typename T>
T load(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

DataFileInfo parse_header(const std::filesystem::path& path, std::span<const unsigned char> bytes) {
  const bool named_token_file =
      bytes.size() >= kMagicPrefix && std::memcmp(bytes.data(), kTokenFileMagic, kMagicPrefix) == 0;
  if (!named_token_file) {
    SG_CHECK_CODE(bytes.size() >= 2, ErrorCode::kIo, "text file ", path, " has ", bytes.size(),
                  " byte; an example needs at least 2 (a window and its label)");
    return DataFileInfo{.token_file = false, .bytes_per_token = 1, .vocab = 256, .tokens = bytes.size()};
  }
  SG_CHECK_CODE(bytes.size() >= kHeaderBytes, ErrorCode::kIo, "token file ", path, " is truncated: ", bytes.size(),
                " bytes, less than its ", kHeaderBytes, "-byte header");
  SG_CHECK_CODE(bytes[kMagicPrefix] == static_cast<unsigned char>(kTokenFileMagic[kMagicPrefix]), ErrorCode::kIo,
                "token file ", path, " has a bad magic: it starts with \"SGTOKEN\" but its version byte is ",
                static_cast<int>(bytes[kMagicPrefix]), ", not '1' (\"SGTOKEN1\", the only version this trainer reads)");
  const auto width = load<std::uint32_t>(bytes.data() + 8);
  const auto vocab = load<std::uint32_t>(bytes.data() + 12);
  const auto count = load<std::uint64_t>(bytes.data() + 16);
  SG_CHECK_CODE(width == 2 || width == 4, ErrorCode::kIo, "token file ", path, " has ", width,
                " bytes per token; the format allows 2 (uint16) or 4 (int32)");
  SG_CHECK_CODE(vocab >= 1 && vocab <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()),
                ErrorCode::kIo, "token file ", path, " has vocab ", vocab, "; it must be in [1, 2^31)");
  const std::size_t payload = bytes.size() - kHeaderBytes;
  SG_CHECK_CODE(count <= payload / width && count * width == payload, ErrorCode::kIo, "token file ", path,
                " is damaged or truncated: its header says ", count, " tokens of ", width, " bytes, but ", payload,
                " bytes follow the header");
  SG_CHECK_CODE(count >= 2, ErrorCode::kIo, "token file ", path, " has ", count,
                " tokens; an example needs at least 2 (a window and its label)");
  return DataFileInfo{.token_file = true, .bytes_per_token = width, .vocab = vocab, .tokens = count};
}

// Every token of a mapped token file in [0, vocab), or Error(kIo) naming the first that is not.
void check_tokens(const std::filesystem::path& path, const MappedFile& file, const DataFileInfo& info) {
  const unsigned char* tokens = file.bytes().data() + kHeaderBytes;
  const std::size_t per_window = kCheckWindowBytes / info.bytes_per_token;
  for (std::uint64_t first = 0; first < info.tokens; first += per_window) {
    const std::uint64_t last = std::min<std::uint64_t>(first + per_window, info.tokens);
    for (std::uint64_t i = first; i < last; ++i) {
      const unsigned char* at = tokens + i * info.bytes_per_token;
      const std::int64_t token = info.bytes_per_token == 2 ? load<std::uint16_t>(at) : load<std::int32_t>(at);
      SG_CHECK_CODE(token >= 0 && token < info.vocab, ErrorCode::kIo, "token file ", path, ": token ", i, " is ",
                    token, ", outside the vocab [0, ", info.vocab, ")");
    }
    file.release_pages(kHeaderBytes + first * info.bytes_per_token, (last - first) * info.bytes_per_token);
  }
}

// Tokens read in place from the mapping: 1 (text), 2 or 4 bytes each.
class MappedTokens final : public DataSource {
 public:
  MappedTokens(std::string description, std::string name, MappedFile file, DataFileInfo info, std::uint64_t seed)
      : description_(std::move(description)),
        name_(std::move(name)),
        file_(std::move(file)),
        info_(info),
        tokens_(file_.bytes().data() + (info.token_file ? kHeaderBytes : 0)),
        seed_(seed) {}

  std::int64_t vocab() const override { return info_.vocab; }
  std::string describe() const override { return description_; }
  std::optional<double> entropy_rate() const override { return std::nullopt; }
  std::uint64_t position() const override { return position_; }
  void seek(std::uint64_t position) override { position_ = position; }

  void next_batch(std::int64_t batch, std::int64_t context, Batch& out) override {
    SG_CHECK(batch >= 1, "next_batch: batch must be >= 1, got ", batch);
    SG_CHECK(context >= 1, "next_batch: context must be >= 1, got ", context);
    const std::uint64_t count = info_.tokens;
    SG_CHECK(count > static_cast<std::uint64_t>(context), "data file ", name_, " has ", count,
             " tokens: too short for a context of ", context, " (an example needs context + 1 = ", context + 1, ")");
    out.windows.resize(static_cast<std::size_t>(batch) * static_cast<std::size_t>(context));
    out.labels.resize(static_cast<std::size_t>(batch));
    const auto width = static_cast<std::size_t>(context);
    for (std::int64_t r = 0; r < batch; ++r) {
      CounterRng rng(seed_, kOffsetStream, position_, static_cast<std::uint64_t>(r));
      const std::uint64_t offset = rng.next_below(count - static_cast<std::uint64_t>(context));
      std::int32_t* row = out.windows.data() + static_cast<std::size_t>(r) * width;
      for (std::size_t i = 0; i < width; ++i) row[i] = token(offset + i);
      out.labels[static_cast<std::size_t>(r)] = token(offset + width);
    }
    ++position_;
  }

 private:
  std::int32_t token(std::uint64_t i) const {
    switch (info_.bytes_per_token) {
      case 1:
        return tokens_[i];
      case 2:
        return load<std::uint16_t>(tokens_ + 2 * i);
      default:
        return load<std::int32_t>(tokens_ + 4 * i);
    }
  }

  std::string description_;
  std::string name_;
  MappedFile file_;
  DataFileInfo info_;
  const unsigned char* tokens_;
  std::uint64_t seed_;
  std::uint64_t position_ = 0;
};

}  // namespace

DataFileInfo inspect_data_file(const std::filesystem::path& path) {
  const MappedFile file = MappedFile::open(path, "data file");  // maps; reads only the pages touched
  return parse_header(path, file.bytes());
}

std::unique_ptr<DataSource> open_token_data(const std::filesystem::path& path, std::uint64_t seed) {
  MappedFile file = MappedFile::open(path, "data file");
  const DataFileInfo info = parse_header(path, file.bytes());
  std::string description;
  if (info.token_file) {
    check_tokens(path, file, info);
    description = fmt::format("token file {}: {} tokens, vocab {}", path.string(), info.tokens, info.vocab);
  } else {
    description = fmt::format("text file {}: {} bytes as tokens (vocab 256)", path.string(), info.tokens);
  }
  return std::make_unique<MappedTokens>(std::move(description), path.string(), std::move(file), info, seed);
}

void write_token_file(const std::filesystem::path& path, std::int64_t vocab, std::span<const std::int32_t> tokens) {
  SG_CHECK(vocab >= 1 && vocab <= std::numeric_limits<std::int32_t>::max(),
           "write_token_file: vocab must be in [1, 2^31), got ", vocab);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    SG_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "write_token_file: token ", i, " is ", tokens[i],
             ", outside the vocab [0, ", vocab, ")");
  }
  const std::uint32_t width = vocab <= 65536 ? 2 : 4;
  std::vector<char> bytes(kHeaderBytes + tokens.size() * width);
  std::memcpy(bytes.data(), kTokenFileMagic, sizeof(kTokenFileMagic));
  const auto vocab32 = static_cast<std::uint32_t>(vocab);
  const auto count = static_cast<std::uint64_t>(tokens.size());
  std::memcpy(bytes.data() + 8, &width, 4);
  std::memcpy(bytes.data() + 12, &vocab32, 4);
  std::memcpy(bytes.data() + 16, &count, 8);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    char* at = bytes.data() + kHeaderBytes + i * width;
    if (width == 2) {
      const auto token = static_cast<std::uint16_t>(tokens[i]);
      std::memcpy(at, &token, 2);
    } else {
      std::memcpy(at, &tokens[i], 4);
    }
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  SG_CHECK_CODE(out.good(), ErrorCode::kIo, "cannot create token file ", path, ": ", std::strerror(errno));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  SG_CHECK_CODE(out.good(), ErrorCode::kIo, "cannot write token file ", path);
}

}  // namespace stepgraph::trainer
