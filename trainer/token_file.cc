#include "trainer/token_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "trainer/counter_rng.h"
#include "trainer/file_reader.h"

namespace stepgraph::trainer {
namespace {

static_assert(std::endian::native == std::endian::little, "token files are read as little-endian memory");

constexpr std::uint64_t kOffsetStream = 3;
constexpr std::size_t kHeaderBytes = 24;
constexpr std::size_t kMagicPrefix = 7;  // "SGTOKEN": the format's name; the 8th byte is its version
// Tokens are checked this many bytes at a time.
constexpr std::size_t kCheckChunkBytes = std::size_t{1} << 20;

template <typename T>
T load(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

// `bytes`: the file's first min(size, 24) bytes.
DataFileInfo parse_header(const std::filesystem::path& path, std::span<const unsigned char> bytes,
                          std::uint64_t file_size) {
  const bool named_token_file =
      bytes.size() >= kMagicPrefix && std::memcmp(bytes.data(), kTokenFileMagic, kMagicPrefix) == 0;
  if (!named_token_file) {
    SG_CHECK_CODE(file_size >= 2, ErrorCode::kIo, "text file ", path, " has ", file_size,
                  " byte; an example needs at least 2 (a window and its label)");
    return DataFileInfo{.token_file = false, .bytes_per_token = 1, .vocab = 256, .tokens = file_size};
  }
  SG_CHECK_CODE(file_size >= kHeaderBytes, ErrorCode::kIo, "token file ", path, " is truncated: ", file_size,
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
  const std::uint64_t payload = file_size - kHeaderBytes;
  SG_CHECK_CODE(count <= payload / width && count * width == payload, ErrorCode::kIo, "token file ", path,
                " is damaged or truncated: its header says ", count, " tokens of ", width, " bytes, but ", payload,
                " bytes follow the header");
  SG_CHECK_CODE(count >= 2, ErrorCode::kIo, "token file ", path, " has ", count,
                " tokens; an example needs at least 2 (a window and its label)");
  return DataFileInfo{.token_file = true, .bytes_per_token = width, .vocab = vocab, .tokens = count};
}

// Every token of a token file in [0, vocab), or Error(kIo) naming the first that is not.
void check_tokens(const FileReader& file, const DataFileInfo& info) {
  std::vector<unsigned char> chunk(kCheckChunkBytes);
  const std::uint64_t per_chunk = kCheckChunkBytes / info.bytes_per_token;
  for (std::uint64_t first = 0; first < info.tokens; first += per_chunk) {
    const std::uint64_t count = std::min<std::uint64_t>(per_chunk, info.tokens - first);
    const std::span<unsigned char> bytes(chunk.data(), count * info.bytes_per_token);
    file.read(kHeaderBytes + first * info.bytes_per_token, bytes);
    for (std::uint64_t i = 0; i < count; ++i) {
      const unsigned char* at = bytes.data() + i * info.bytes_per_token;
      const std::int64_t token = info.bytes_per_token == 2 ? load<std::uint16_t>(at) : load<std::int32_t>(at);
      SG_CHECK_CODE(token >= 0 && token < info.vocab, ErrorCode::kIo, "token file ", file.path(), ": token ",
                    first + i, " is ", token, ", outside the vocab [0, ", info.vocab, ")");
    }
  }
}

// Tokens read from the file as examples are drawn: 1 (text), 2 or 4 bytes each.
class FileTokens final : public DataSource {
 public:
  FileTokens(std::string description, FileReader file, DataFileInfo info, std::uint64_t seed)
      : description_(std::move(description)),
        file_(std::move(file)),
        info_(info),
        first_byte_(info.token_file ? kHeaderBytes : 0),
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
    SG_CHECK(count > static_cast<std::uint64_t>(context), "data file ", file_.path(), " has ", count,
             " tokens: too short for a context of ", context, " (an example needs context + 1 = ", context + 1, ")");
    const auto width = static_cast<std::size_t>(context);
    out.windows.resize(static_cast<std::size_t>(batch) * width);
    out.labels.resize(static_cast<std::size_t>(batch));
    example_.resize((width + 1) * info_.bytes_per_token);
    for (std::int64_t r = 0; r < batch; ++r) {
      CounterRng rng(seed_, kOffsetStream, position_, static_cast<std::uint64_t>(r));
      const std::uint64_t offset = rng.next_below(count - static_cast<std::uint64_t>(context));
      file_.read(first_byte_ + offset * info_.bytes_per_token, example_);
      std::int32_t* row = out.windows.data() + static_cast<std::size_t>(r) * width;
      for (std::size_t i = 0; i < width; ++i) row[i] = token(i);
      const std::int32_t label = token(width);
      out.labels[static_cast<std::size_t>(r)] = label;
      // Checked at open; a file rewritten since then must not feed the model a token outside its vocabulary.
      SG_CHECK_CODE(label < info_.vocab && *std::max_element(row, row + width) < info_.vocab &&
                        *std::min_element(row, row + width) >= 0 && label >= 0,
                    ErrorCode::kIo, "data file ", file_.path(), " changed during the run: a token at ", offset,
                    " is outside its vocab [0, ", info_.vocab, ")");
    }
    ++position_;
  }

 private:
  // Token i of the example just read.
  std::int32_t token(std::size_t i) const {
    const unsigned char* at = example_.data() + i * info_.bytes_per_token;
    switch (info_.bytes_per_token) {
      case 1:
        return *at;
      case 2:
        return load<std::uint16_t>(at);
      default:
        return load<std::int32_t>(at);
    }
  }

  std::string description_;
  FileReader file_;
  DataFileInfo info_;
  std::uint64_t first_byte_;
  std::uint64_t seed_;
  std::uint64_t position_ = 0;
  std::vector<unsigned char> example_;  // one example's bytes, reused
};

}  // namespace

namespace {

DataFileInfo read_header(const FileReader& file) {
  std::array<unsigned char, kHeaderBytes> header{};
  const auto length = static_cast<std::size_t>(std::min<std::uint64_t>(file.size(), kHeaderBytes));
  file.read(0, std::span(header.data(), length));
  return parse_header(file.path(), std::span(header.data(), length), file.size());
}

}  // namespace

DataFileInfo inspect_data_file(const std::filesystem::path& path) {
  return read_header(FileReader::open(path, "data file"));
}

std::unique_ptr<DataSource> open_token_data(const std::filesystem::path& path, std::uint64_t seed) {
  FileReader file = FileReader::open(path, "data file");
  const DataFileInfo info = read_header(file);
  std::string description;
  if (info.token_file) {
    check_tokens(file, info);
    description = fmt::format("token file {}: {} tokens, vocab {}", path.string(), info.tokens, info.vocab);
  } else {
    description = fmt::format("text file {}: {} bytes as tokens (vocab 256)", path.string(), info.tokens);
  }
  return std::make_unique<FileTokens>(std::move(description), std::move(file), info, seed);
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
