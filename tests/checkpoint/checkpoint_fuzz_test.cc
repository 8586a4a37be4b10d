// A fuzz of read_checkpoint (Note [Checkpoint integrity]): deep nesting,
// duplicate and unknown keys, extra or missing tensors, integers that would
// wrap, truncations at every length, every single-bit flip, random bytes and
// random header edits with a recomputed checksum. Every case is an
// Error(kIo) whose message is printable ASCII, or (for an edit that keeps
// the layout valid) a checkpoint that reads back; nothing crashes. Runs as
// plain GoogleTest, and under AddressSanitizer where the build has that config.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/checkpoint/checkpoint_files.h"
#include "tests/trainer/test_support.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/strict_decimal.h"

namespace stepgraph::trainer {
namespace {

using testing::fresh_path;
using testing::read_bytes;
using testing::sealed_file;
using testing::write_bytes;

Checkpoint small_checkpoint() {
  Checkpoint checkpoint;
  checkpoint.metadata = {{"stepgraph.step", "3"}, {"config.layers", "2"}};
  for (int t = 0; t < 3; ++t) {
    CheckpointTensor tensor{"w" + std::to_string(t), DType::kFloat32, {2, 3}, std::vector<std::byte>(24)};
    for (std::size_t i = 0; i < tensor.bytes.size(); ++i) tensor.bytes[i] = static_cast<std::byte>(i * 7 + t);
    checkpoint.tensors.push_back(std::move(tensor));
  }
  checkpoint.tensors.push_back({"empty", DType::kInt64, {0}, {}});
  return checkpoint;
}

bool printable_ascii(const std::string& text) {
  for (const char c : text) {
    if (c != '\n' && (c < 0x20 || c > 0x7e)) return false;
  }
  return true;
}

// The outcome of reading `bytes`: "" when it reads, else the error message.
std::string read_outcome(const std::filesystem::path& path, const std::string& bytes) {
  write_bytes(path, bytes);
  try {
    read_checkpoint(path);
    return "";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo) << error.message();
    EXPECT_TRUE(printable_ascii(error.message())) << error.message();
    return error.message();
  }
}

void expect_refused(const std::filesystem::path& path, const std::string& bytes,
                    std::initializer_list<std::string> words) {
  const std::string message = read_outcome(path, bytes);
  EXPECT_FALSE(message.empty()) << "accepted";
  for (const std::string& word : words) EXPECT_NE(message.find(word), std::string::npos) << message;
}

TEST(CheckpointFuzzTest, DeepNestingIsAnErrorNotACrash) {
  const auto path = fresh_path("nested.safetensors");
  const std::string deep = std::string(60000, '[') + std::string(60000, ']');
  // Behind a correct checksum: refused at the first level the schema has no
  // list or object for, or past the third level (a shape's), never recursed into.
  expect_refused(path, sealed_file(R"(,"x":)" + deep + "}}", ""), {"metadata 'x' is a list, not a string"});
  expect_refused(path, sealed_file(R"(},"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", ""),
                 {"nests deeper than the 3 levels"});
  std::string objects;
  for (int i = 0; i < 60000; ++i) objects += R"({"a":)";
  objects += "1" + std::string(60000, '}');
  expect_refused(path, sealed_file(R"(},"w":)" + objects + "}", ""), {"unknown key 'a'"});
  expect_refused(path, sealed_file(R"(},"w":{"dtype":"F32","shape":[)" + objects + "]}}", ""), {"nests deeper"});
  // The 536 KB file of the report: no checksum at the front, refused before parsing.
  std::string raw(8, '\0');
  const std::uint64_t length = deep.size();
  std::memcpy(raw.data(), &length, 8);
  expect_refused(path, raw + deep, {"does not begin with a StepGraph checksum"});
}

TEST(CheckpointFuzzTest, DuplicateAndUnknownKeysAreRefused) {
  const auto path = fresh_path("keys.safetensors");
  const std::string w = R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  expect_refused(path, sealed_file("}," + w + "," + w + "}", "abcd"), {"tensor 'w' appears twice"});
  expect_refused(path, sealed_file(R"(,"step":"1","step":"2"},)" + w + "}", "abcd"), {"metadata 'step' appears twice"});
  expect_refused(path, sealed_file(R"(,"stepgraph.checksum":"fnv1a64:0000000000000000"},)" + w + "}", "abcd"),
                 {"metadata 'stepgraph.checksum' appears twice"});
  expect_refused(path, sealed_file(R"(},"__metadata__":{},)" + w + "}", "abcd"), {"two __metadata__ objects"});
  expect_refused(path, sealed_file(R"(},"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcd"),
                 {"tensor 'w' has dtype twice"});
  expect_refused(path, sealed_file(R"(},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", "abcd"),
                 {"unknown key 'extra'"});
  expect_refused(path, sealed_file(R"(},"w":{"dtype":"F32","shape":[1]}})", ""),
                 {"lacks dtype, shape or data_offsets"});
  expect_refused(path, sealed_file(R"(,"n":1},)" + w + "}", "abcd"), {"metadata 'n' is a number, not a string"});
  expect_refused(path, sealed_file(R"(},"w":[1]})", ""), {"tensor 'w' is a list, not an object"});
  expect_refused(path, sealed_file(R"(},"":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", ""), {"empty name"});
  expect_refused(path, sealed_file("}} []", ""), {"not valid JSON"});
}

TEST(CheckpointFuzzTest, ExtraOrMissingTensorBytesAreRefused) {
  const auto path = fresh_path("tiles.safetensors");
  const std::string a = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  expect_refused(path,
                 sealed_file("}," + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", "0123456789ab"),
                 {"tensor 'b' starts at 8, expected 4"});
  expect_refused(path, sealed_file("}," + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})", "01234567"),
                 {"gap or overlap"});
  expect_refused(path,
                 sealed_file("}," + a + "}",
                             "0123"
                             "4567"),
                 {"8 bytes of tensor data, its header describes 4"});
  expect_refused(path, sealed_file("}," + a + "}", "01"),
                 {"2 bytes of tensor data, its header describes 4", "truncated"});
}

TEST(CheckpointFuzzTest, IntegersThatWouldWrapAreRefused) {
  const auto path = fresh_path("integers.safetensors");
  const auto entry = [](const std::string& shape, const std::string& offsets) {
    return sealed_file(R"(},"w":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}", "");
  };
  expect_refused(path, entry("[1]", "[0,18446744073709551616]"), {"18446744073709551616", "not an integer below 2^64"});
  expect_refused(path, entry("[1]", "[-1,3]"), {"negative number -1 in its data_offsets"});
  expect_refused(path, entry("[-1]", "[0,0]"), {"negative number -1 in its shape"});
  expect_refused(path, entry("[1.5]", "[0,0]"), {"1.5"});
  expect_refused(path, entry("[4611686018427387905]", "[0,0]"), {"past 2^62"});
  expect_refused(path, entry("[2147483648,2147483648,2147483648]", "[0,0]"), {"too large for any file"});
  expect_refused(path, entry("[1]", "[18446744073709551615,3]"), {"data_offsets [18446744073709551615, 3]"});
  expect_refused(path, entry("[1]", "[0,4,8]"), {"more than 2 data_offsets"});
  expect_refused(path, entry("[1]", "[4]"), {"1 data_offsets, not 2"});
  expect_refused(path, entry("[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", "[0,4]"), {"more than 16 dimensions"});
  // The length prefix.
  std::string huge(8, '\xff');
  expect_refused(path, huge + "{}", {"header length 18446744073709551615 does not fit"});

  // Counts in metadata (the step, the data position) are strict decimals.
  constexpr std::uint64_t kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  for (const char* bad : {"-1", "-100", " +2", "+2", "2 ", " 2", "007", "", "1e3", "0x10", "18446744073709551615",
                          "18446744073709551616", "99999999999999999999999", "9223372036854775808", "1\n"}) {
    EXPECT_FALSE(parse_decimal(bad, kMax).has_value()) << "'" << bad << "'";
  }
  EXPECT_EQ(parse_decimal("0", kMax), 0u);
  EXPECT_EQ(parse_decimal("42", kMax), 42u);
  EXPECT_EQ(parse_decimal("9223372036854775807", kMax), kMax);
  EXPECT_EQ(parse_decimal("18446744073709551615", UINT64_MAX), UINT64_MAX);
  EXPECT_FALSE(parse_decimal("43", 42).has_value());
}

TEST(CheckpointFuzzTest, NamesInErrorsAreEscaped) {
  const auto path = fresh_path("escaped.safetensors");
  // A terminal escape and a long name in a key: escaped and cut short.
  const std::string message = read_outcome(
      path,
      sealed_file(R"(},"\u001b[2J)" + std::string(500, 'x') + R"(":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
                  "abcdefgh"));
  EXPECT_NE(message.find("\\x1b[2J"), std::string::npos) << message;
  EXPECT_NE(message.find("..."), std::string::npos) << message;
  EXPECT_LT(message.size(), path.string().size() + 250) << message;
  // Bytes that are not UTF-8 are no JSON string.
  expect_refused(path, sealed_file("},\"\xff\xfe\":{}}", ""), {"not valid JSON"});
}

TEST(CheckpointFuzzTest, EveryTruncationIsAClearError) {
  const auto path = fresh_path("truncations.safetensors");
  write_checkpoint(path, small_checkpoint());
  const std::string good = read_bytes(path);
  for (std::size_t size = 0; size < good.size(); ++size) {
    EXPECT_FALSE(read_outcome(path, good.substr(0, size)).empty()) << "truncated to " << size << " bytes";
  }
  EXPECT_TRUE(read_outcome(path, good).empty());
}

TEST(CheckpointFuzzTest, EveryBitFlipIsAClearError) {
  const auto path = fresh_path("flips.safetensors");
  write_checkpoint(path, small_checkpoint());
  const std::string good = read_bytes(path);
  int refused = 0;
  for (std::size_t byte = 0; byte < good.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = good;
      flipped[byte] = static_cast<char>(flipped[byte] ^ (1 << bit));
      const std::string message = read_outcome(path, flipped);
      EXPECT_FALSE(message.empty()) << "byte " << byte << " bit " << bit << " was accepted";
      refused += !message.empty();
    }
  }
  EXPECT_EQ(refused, static_cast<int>(good.size() * 8));
}

TEST(CheckpointFuzzTest, RandomBytesAreClearErrors) {
  const auto path = fresh_path("random.safetensors");
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 500; ++i) {
    std::string bytes(rng() % 300, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    if (i % 2 == 0 && bytes.size() >= 8) {  // a plausible length
      const std::uint64_t length = rng() % (bytes.size() - 7);
      std::memcpy(bytes.data(), &length, 8);
    }
    EXPECT_FALSE(read_outcome(path, bytes).empty()) << "random file " << i;
  }
}

// Random edits of the header with the length and checksum recomputed, as a
// writer that knows the format would make them: each reads back as a valid
// checkpoint or is a clear error.
TEST(CheckpointFuzzTest, RandomHeaderEditsWithAValidChecksum) {
  const auto path = fresh_path("edits.safetensors");
  write_checkpoint(path, small_checkpoint());
  const std::string good = read_bytes(path);
  std::uint64_t length = 0;
  std::memcpy(&length, good.data(), 8);
  const std::string header = good.substr(8, length);
  const std::string data = good.substr(8 + length);
  const std::size_t fixed = testing::kHeaderStart.size() + 17;  // the start, the digits, the quote
  const std::string alphabet = "{}[]\",:0123456789-+.eE \\atrufnlsF3IBU_";
  std::mt19937_64 rng(777);
  int accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string rest = header.substr(fixed);
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      const std::size_t at = rng() % rest.size();
      switch (rng() % 3) {
        case 0: rest[at] = alphabet[rng() % alphabet.size()]; break;
        case 1: rest.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: rest.erase(at, 1 + rng() % 8); break;
      }
      if (rest.empty()) rest = "}";
    }
    const std::string message = read_outcome(path, sealed_file(rest, data, /*pad=*/false));
    accepted += message.empty();
  }
  // Most edits break the layout; a few (a digit in a name, a space) keep it.
  EXPECT_LT(accepted, 3000);
}

// Symlinks planted beside the target (at the old fixed temporary name, at
// names like the new ones, dangling) are never written through.
TEST(CheckpointFuzzTest, PlantedSymlinksAreNeverWrittenThrough) {
  const auto path = fresh_path("planted.safetensors");
  const auto victim = fresh_path("victim");
  const auto absent = fresh_path("absent");
  write_bytes(victim, "victim");
  const std::string name = path.filename().string();
  for (const std::string& planted : {name + ".tmp", "." + name + ".tmp", "." + name + ".tmp-1-0000000000000000"}) {
    std::filesystem::create_symlink(victim, path.parent_path() / planted);
  }
  std::filesystem::create_symlink(absent, path.parent_path() / (name + ".tmp.dangling"));
  const Checkpoint written = small_checkpoint();
  for (int i = 0; i < 20; ++i) write_checkpoint(path, written);
  EXPECT_EQ(read_bytes(victim), "victim");
  EXPECT_FALSE(std::filesystem::exists(absent));
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  EXPECT_EQ(read_checkpoint(path).tensors.size(), written.tensors.size());
}

TEST(CheckpointFuzzTest, ManyEmptyTensorsStayWithinTheFileSize) {
  // 100k empty tensors: a valid layout (the trainer then refuses the extra
  // tensors); reading it allocates about what the header holds.
  std::string rest = "}";
  for (int i = 0; i < 100000; ++i)
    rest += fmt::format(R"(,"e{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", i);
  rest += "}";
  const auto path = fresh_path("empties.safetensors");
  write_bytes(path, sealed_file(rest, ""));
  const Checkpoint checkpoint = read_checkpoint(path);
  EXPECT_EQ(checkpoint.tensors.size(), 100000u);
}

}  // namespace
}  // namespace stepgraph::trainer
