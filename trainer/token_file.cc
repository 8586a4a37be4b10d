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

namespace stepgraph::trainer {
namespace {

static_assert(std::endian::native == std::endian::little, "token files are read as little-endian memory");

constexpr std::uint64_t kOffsetStream = 3;
constexpr std::size_t kHeaderBytes = 24;

template <typename T>
T load(const std::vector<char>& bytes, std::size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

std::vector<char> read_all(const std::filesystem::path& path) {
  std::error_code error;
  SG_CHECK_CODE(std::filesystem::exists(path, error), ErrorCode::kIo, "data file ", path, " does not exist");
  SG_CHECK_CODE(!std::filesystem::is_directory(path, error), ErrorCode::kIo, "data file ", path,
                " is a directory; pass a text or token file");
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  SG_CHECK_CODE(!error, ErrorCode::kIo, "cannot stat data file ", path, ": ", error.message());
  std::ifstream in(path, std::ios::binary);
  SG_CHECK_CODE(in.good(), ErrorCode::kIo, "cannot open data file ", path, ": ", std::strerror(errno));
  std::vector<char> bytes(size);
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  SG_CHECK_CODE(in.gcount() == static_cast<std::streamsize>(size), ErrorCode::kIo, "cannot read data file ", path,
                ": got ", in.gcount(), " of its ", size, " bytes");
  return bytes;
}

class TokenData final : public DataSource {
 public:
  TokenData(std::string description, std::int64_t vocab, std::vector<std::int32_t> tokens, std::string name,
            std::uint64_t seed)
      : description_(std::move(description)),
        vocab_(vocab),
        tokens_(std::move(tokens)),
        name_(std::move(name)),
        seed_(seed) {}

  std::int64_t vocab() const override { return vocab_; }
  std::string describe() const override { return description_; }
  std::optional<double> entropy_rate() const override { return std::nullopt; }
  std::uint64_t position() const override { return position_; }
  void seek(std::uint64_t position) override { position_ = position; }

  void next_batch(std::int64_t batch, std::int64_t context, Batch& out) override {
    SG_CHECK(batch >= 1, "next_batch: batch must be >= 1, got ", batch);
    SG_CHECK(context >= 1, "next_batch: context must be >= 1, got ", context);
    const auto count = static_cast<std::int64_t>(tokens_.size());
    SG_CHECK(count > context, "data file ", name_, " has ", count, " tokens: too short for a context of ", context,
             " (an example needs context + 1 = ", context + 1, ")");
    out.windows.resize(static_cast<std::size_t>(batch * context));
    out.labels.resize(static_cast<std::size_t>(batch));
    for (std::int64_t r = 0; r < batch; ++r) {
      CounterRng rng(seed_, kOffsetStream, position_, static_cast<std::uint64_t>(r));
      const auto offset = static_cast<std::int64_t>(rng.next_below(static_cast<std::uint64_t>(count - context)));
      std::copy_n(tokens_.begin() + offset, context, out.windows.begin() + r * context);
      out.labels[static_cast<std::size_t>(r)] = tokens_[static_cast<std::size_t>(offset + context)];
    }
    ++position_;
  }

 private:
  std::string description_;
  std::int64_t vocab_;
  std::vector<std::int32_t> tokens_;
  std::string name_;
  std::uint64_t seed_;
  std::uint64_t position_ = 0;
};

std::unique_ptr<DataSource> parse_token_file(const std::filesystem::path& path, const std::vector<char>& bytes,
                                             std::uint64_t seed) {
  SG_CHECK_CODE(bytes.size() >= kHeaderBytes, ErrorCode::kIo, "token file ", path, " is truncated: ", bytes.size(),
                " bytes, less than its ", kHeaderBytes, "-byte header");
  const auto width = load<std::uint32_t>(bytes, 8);
  const auto vocab = load<std::uint32_t>(bytes, 12);
  const auto count = load<std::uint64_t>(bytes, 16);
  SG_CHECK_CODE(width == 2 || width == 4, ErrorCode::kIo, "token file ", path, " has ", width,
                " bytes per token; the format allows 2 (uint16) or 4 (int32)");
  SG_CHECK_CODE(vocab >= 1 && vocab <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()),
                ErrorCode::kIo, "token file ", path, " has vocab ", vocab, "; it must be in [1, 2^31)");
  const std::size_t payload = bytes.size() - kHeaderBytes;
  SG_CHECK_CODE(count <= payload / width && count * width == payload, ErrorCode::kIo, "token file ", path,
                " is damaged or truncated: its header says ", count, " tokens of ", width, " bytes, but ", payload,
                " bytes follow the header");
  std::vector<std::int32_t> tokens(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t at = kHeaderBytes + i * width;
    const std::int64_t token = width == 2 ? load<std::uint16_t>(bytes, at) : load<std::int32_t>(bytes, at);
    SG_CHECK_CODE(token >= 0 && token < vocab, ErrorCode::kIo, "token file ", path, ": token ", i, " is ", token,
                  ", outside the vocab [0, ", vocab, ")");
    tokens[i] = static_cast<std::int32_t>(token);
  }
  SG_CHECK_CODE(count >= 2, ErrorCode::kIo, "token file ", path, " has ", count,
                " tokens; an example needs at least 2 (a window and its label)");
  std::string description = fmt::format("token file {}: {} tokens, vocab {}", path.string(), count, vocab);
  return std::make_unique<TokenData>(std::move(description), vocab, std::move(tokens), path.string(), seed);
}

}  // namespace

std::unique_ptr<DataSource> open_token_data(const std::filesystem::path& path, std::uint64_t seed) {
  const std::vector<char> bytes = read_all(path);
  if (bytes.size() >= sizeof(kTokenFileMagic) &&
      std::memcmp(bytes.data(), kTokenFileMagic, sizeof(kTokenFileMagic)) == 0) {
    return parse_token_file(path, bytes, seed);
  }
  SG_CHECK_CODE(!bytes.empty(), ErrorCode::kIo, "data file ", path, " is empty");
  SG_CHECK_CODE(bytes.size() >= 2, ErrorCode::kIo, "text file ", path, " has ", bytes.size(),
                " byte; an example needs at least 2 (a window and its label)");
  std::vector<std::int32_t> tokens(bytes.size());
  std::transform(bytes.begin(), bytes.end(), tokens.begin(),
                 [](char c) { return static_cast<std::int32_t>(static_cast<unsigned char>(c)); });
  std::string description = fmt::format("text file {}: {} bytes as tokens (vocab 256)", path.string(), bytes.size());
  return std::make_unique<TokenData>(std::move(description), 256, std::move(tokens), path.string(), seed);
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
