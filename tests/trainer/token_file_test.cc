#include "trainer/token_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/trainer/test_support.h"
#include "trainer/memory_budget.h"
#include "trainer/options.h"

namespace stepgraph::trainer {
namespace {

using testing::expect_error;
using testing::fresh_path;
using testing::read_bytes;
using testing::write_bytes;

// Every example is a contiguous run of the data: window then label.
void expect_runs_of(const std::vector<std::int32_t>& data, const Batch& batch, std::int64_t context) {
  for (std::size_t r = 0; r < batch.labels.size(); ++r) {
    std::vector<std::int32_t> run(batch.windows.begin() + r * context, batch.windows.begin() + (r + 1) * context);
    run.push_back(batch.labels[r]);
    EXPECT_NE(std::search(data.begin(), data.end(), run.begin(), run.end()), data.end()) << "row " << r;
  }
}

TEST(TokenFileTest, TextFileBytesAreTokens) {
  const auto path = fresh_path("corpus.txt");
  const std::string text = "the quick brown fox jumps over the lazy dog \xff\x01";
  write_bytes(path, text);
  auto source = open_token_data(path);
  EXPECT_EQ(source->vocab(), 256);
  EXPECT_FALSE(source->entropy_rate().has_value());
  EXPECT_NE(source->describe().find("text file"), std::string::npos) << source->describe();
  std::vector<std::int32_t> data(text.size());
  std::transform(text.begin(), text.end(), data.begin(), [](char c) { return static_cast<unsigned char>(c); });
  Batch batch;
  source->next_batch(64, 7, batch);
  ASSERT_EQ(batch.windows.size(), 64u * 7);
  ASSERT_EQ(batch.labels.size(), 64u);
  expect_runs_of(data, batch, 7);
}

TEST(TokenFileTest, TokenFileRoundTripsBothWidths) {
  for (const std::int64_t vocab : {1000, 70000}) {
    const auto path = fresh_path("tokens" + std::to_string(vocab) + ".sgt");
    std::vector<std::int32_t> data(500);
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::int32_t>((i * 7919) % vocab);
    write_token_file(path, vocab, data);
    EXPECT_EQ(read_bytes(path).size(), 24 + data.size() * (vocab <= 65536 ? 2 : 4));
    auto source = open_token_data(path);
    EXPECT_EQ(source->vocab(), vocab);
    EXPECT_NE(source->describe().find("500 tokens"), std::string::npos) << source->describe();
    Batch batch;
    source->next_batch(32, 16, batch);
    expect_runs_of(data, batch, 16);
  }
}

TEST(TokenFileTest, OffsetsCoverTheWholeFile) {
  const auto path = fresh_path("five.sgt");
  write_token_file(path, 5, std::vector<std::int32_t>{0, 1, 2, 3, 4});
  auto source = open_token_data(path);
  std::set<std::int32_t> labels;
  Batch batch;
  for (int step = 0; step < 20; ++step) {
    source->next_batch(8, 2, batch);
    labels.insert(batch.labels.begin(), batch.labels.end());
  }
  EXPECT_EQ(labels, (std::set<std::int32_t>{2, 3, 4}));  // offsets 0, 1 and 2, no further
  source->next_batch(3, 4, batch);                       // the longest context this file allows
  EXPECT_EQ(batch.labels, (std::vector<std::int32_t>{4, 4, 4}));
}

TEST(TokenFileTest, DeterministicAndSeekable) {
  const auto path = fresh_path("data.sgt");
  std::vector<std::int32_t> data(1000);
  std::iota(data.begin(), data.end(), 0);
  write_token_file(path, 1000, data);
  auto first = open_token_data(path, 9);
  auto second = open_token_data(path, 9);
  auto other_seed = open_token_data(path, 10);
  Batch a, b, c;
  for (int step = 0; step < 4; ++step) first->next_batch(16, 8, a);
  second->seek(3);
  second->next_batch(16, 8, b);
  EXPECT_EQ(a.windows, b.windows);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(second->position(), 4u);
  other_seed->seek(3);
  other_seed->next_batch(16, 8, c);
  EXPECT_NE(a.windows, c.windows);
}

TEST(TokenFileTest, MissingEmptyAndTooShortFilesAreClearErrors) {
  const auto missing = fresh_path("missing.txt");
  expect_error([&] { open_token_data(missing); }, ErrorCode::kIo, {missing.string(), "does not exist"});
  const auto empty = fresh_path("empty.txt");
  write_bytes(empty, "");
  expect_error([&] { open_token_data(empty); }, ErrorCode::kIo, {empty.string(), "empty"});
  const auto one = fresh_path("one.txt");
  write_bytes(one, "x");
  expect_error([&] { open_token_data(one); }, ErrorCode::kIo, {one.string(), "at least 2"});
  const auto directory = fresh_path("directory");
  std::filesystem::create_directory(directory);
  expect_error([&] { open_token_data(directory); }, ErrorCode::kIo, {"directory"});

  const auto ten = fresh_path("ten.txt");
  write_bytes(ten, "0123456789");
  auto source = open_token_data(ten);
  Batch batch;
  expect_error([&] { source->next_batch(4, 10, batch); }, ErrorCode::kInvalidArgument,
               {ten.string(), "too short for a context of 10"});
  source->next_batch(4, 9, batch);
}

TEST(TokenFileTest, DamagedTokenFilesAreClearErrors) {
  const auto path = fresh_path("good.sgt");
  write_token_file(path, 300, std::vector<std::int32_t>{1, 2, 299, 4});
  const std::string good = read_bytes(path);
  const auto damaged = fresh_path("damaged.sgt");

  write_bytes(damaged, good.substr(0, good.size() - 1));
  expect_error([&] { open_token_data(damaged); }, ErrorCode::kIo, {damaged.string(), "truncated"});
  write_bytes(damaged, good.substr(0, 20));
  expect_error([&] { open_token_data(damaged); }, ErrorCode::kIo, {"truncated", "header"});

  std::string bad_width = good;
  bad_width[8] = 3;
  write_bytes(damaged, bad_width);
  expect_error([&] { open_token_data(damaged); }, ErrorCode::kIo, {"3 bytes per token"});

  std::string bad_token = good;
  bad_token[24 + 2 * 2] = 0x2c;  // 299 = 0x012b -> 0x012c = 300, outside the vocab
  write_bytes(damaged, bad_token);
  expect_error([&] { open_token_data(damaged); }, ErrorCode::kIo, {"token 2 is 300", "[0, 300)"});

  expect_error(
      [&] {
        write_token_file(damaged, 10, std::vector<std::int32_t>{3, 10});
      },
      ErrorCode::kInvalidArgument, {"write_token_file: token 1 is 10, outside the vocab [0, 10)"});
}

// A token file's 24-byte header: magic, bytes per token, vocab, count.
std::string header(std::uint32_t width, std::uint32_t vocab, std::uint64_t count, const char* magic = "SGTOKEN1") {
  std::string bytes(24, '\0');
  std::memcpy(bytes.data(), magic, 8);
  std::memcpy(bytes.data() + 8, &width, 4);
  std::memcpy(bytes.data() + 12, &vocab, 4);
  std::memcpy(bytes.data() + 16, &count, 8);
  return bytes;
}

TEST(TokenFileTest, MalformedHeadersAreClearErrorsNamingTheFile) {
  const auto path = fresh_path("bad.sgt");
  // Another version of the format is not text.
  write_bytes(path, header(2, 10, 4, "SGTOKEN2") + std::string(8, '\0'));
  expect_error([&] { open_token_data(path); }, ErrorCode::kIo, {path.string(), "bad magic", "version byte is 50"});
  // A count that overflows count x width.
  write_bytes(path, header(4, 10, std::uint64_t{1} << 62) + std::string(16, '\0'));
  expect_error([&] { inspect_data_file(path); }, ErrorCode::kIo, {path.string(), "damaged or truncated", "16 bytes"});
  write_bytes(path, header(2, 0, 2) + std::string(4, '\0'));
  expect_error([&] { inspect_data_file(path); }, ErrorCode::kIo, {path.string(), "vocab 0"});
  write_bytes(path, header(2, 10, 1) + std::string(2, '\0'));
  expect_error([&] { open_token_data(path); }, ErrorCode::kIo, {path.string(), "1 tokens", "at least 2"});
  // int32 tokens below 0.
  std::string negative = header(4, 10, 2) + std::string(8, '\0');
  negative[28] = negative[29] = negative[30] = negative[31] = '\xff';
  write_bytes(path, negative);
  expect_error([&] { open_token_data(path); }, ErrorCode::kIo, {path.string(), "token 1 is -1", "[0, 10)"});
  expect_error([&] { open_token_data("/dev/null"); }, ErrorCode::kIo, {"/dev/null", "not a regular file"});
}

// The header alone says what a file holds: a file of any size is inspected
// without reading its tokens.
TEST(TokenFileTest, InspectReadsTheHeaderOnly) {
  const auto tokens = fresh_path("tokens.sgt");
  write_token_file(tokens, 70000, std::vector<std::int32_t>{1, 69999, 3});
  const DataFileInfo info = inspect_data_file(tokens);
  EXPECT_TRUE(info.token_file);
  EXPECT_EQ(info.bytes_per_token, 4u);
  EXPECT_EQ(info.vocab, 70000);
  EXPECT_EQ(info.tokens, 3u);
  const auto text = fresh_path("text.txt");
  write_bytes(text, "hello");
  const DataFileInfo text_info = inspect_data_file(text);
  EXPECT_FALSE(text_info.token_file);
  EXPECT_EQ(text_info.vocab, 256);
  EXPECT_EQ(text_info.tokens, 5u);
}

// A 16 KB token file that claims a vocabulary of 100 M: the embedding, head
// and logits it implies are refused before any of it is allocated (the
// trainer grew to 23.4 GB before the kernel killed it).
TEST(TokenFileTest, AVocabularyLargerThanMemoryIsRefusedNamingTheFile) {
  const auto path = fresh_path("claims_100M.sgt");
  write_bytes(path, header(2, 100'000'000, 8000) + std::string(16000, '\0'));
  TrainerOptions flags;
  flags.data = path.string();
  const TrainerOptions o = resolve_defaults(flags, Device::kHost);
  const MemoryNeed need = estimate_memory(o, inspect_data_file(path).vocab, 1);
  // 100 M x (32-wide embedding + 64-wide head) x 16 bytes, and 256 x 100 M fp32 logits.
  EXPECT_GE(need.vocab_bytes, 100e6 * 96 * 16 + 256 * 100e6 * 4);
  expect_error([&] { check_memory(need, o, 100'000'000, MemoryLimit{.bytes = 64e9, .what = "host memory (64 GiB)"}); },
               ErrorCode::kOutOfMemory, {path.string(), "vocabulary of 100000000", "--hidden 64", "host memory"});
  expect_error([&] { check_run_memory(o, Device::kHost, 1, 0); }, ErrorCode::kOutOfMemory,
               {path.string(), "vocabulary of 100000000"});
  // The default host run fits anywhere.
  const TrainerOptions defaults = resolve_defaults(TrainerOptions{}, Device::kHost);
  EXPECT_LT(estimate_memory(defaults, 8, 1).total(), 64e6);
  check_run_memory(defaults, Device::kHost, 1, 0);
  // Flags alone can ask for too much: named as flags.
  TrainerOptions big = defaults;
  big.hidden = 1 << 20;
  big.ffn = 1 << 20;
  expect_error([&] { check_run_memory(big, Device::kHost, 1, 0); }, ErrorCode::kOutOfMemory,
               {"these flags", "--hidden", "--layers"});
}

// Each tensor-parallel rank holds its share of the weights (the embedding
// table and the head are vocabulary-parallel, attention is split by heads)
// and each context-parallel rank its share of the tokens: the estimate of a
// rank shrinks accordingly, so a model split over ranks is not refused for
// the memory one rank would need.
TEST(TokenFileTest, TensorAndContextParallelRanksNeedTheirShare) {
  TrainerOptions flags;
  flags.heads = 8;
  const TrainerOptions one = resolve_defaults(flags, Device::kHost);
  TrainerOptions tp2 = one;
  tp2.tp = 2;
  TrainerOptions cp2 = one;
  cp2.cp = 2;
  const MemoryNeed whole = estimate_memory(one, 50'000, 1);
  const MemoryNeed split = estimate_memory(tp2, 50'000, 1);
  // The embedding and head halve; the logits are [tokens, vocab / tp] already.
  EXPECT_NEAR(split.vocab_bytes, whole.vocab_bytes / 2, 1e-9 * whole.vocab_bytes);
  EXPECT_LT(split.other_bytes, whole.other_bytes);
  const MemoryNeed context = estimate_memory(cp2, 50'000, 1);
  EXPECT_LT(context.vocab_bytes, whole.vocab_bytes);  // half the logits
  EXPECT_LT(context.other_bytes, whole.other_bytes);  // half the activations
}

// A pipeline stage holds 1/pp of the blocks and the embedding or the head
// (not both), and at least one microbatch's activations: a model split into
// stages is not refused for the memory one rank would need for all of it.
TEST(TokenFileTest, PipelineStagesNeedTheirShare) {
  TrainerOptions flags;
  flags.heads = 8;
  flags.layers = 4;
  const TrainerOptions one = resolve_defaults(flags, Device::kHost);
  TrainerOptions pp2 = flags;
  pp2.pp = 2;
  pp2 = resolve_defaults(pp2, Device::kHost);
  const MemoryNeed whole = estimate_memory(one, 50'000, 1);
  const MemoryNeed stage = estimate_memory(pp2, 50'000, 1);
  EXPECT_LT(stage.vocab_bytes, whole.vocab_bytes);
  EXPECT_GT(stage.vocab_bytes, whole.vocab_bytes / 4);  // the larger of the embedding and the head
  EXPECT_LT(stage.other_bytes, whole.other_bytes / 2 + 2 * pp2.batch * (pp2.context + 1) * 4);
}

std::int64_t resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// Files are read in place, not copied into a widened token array (5 bytes of
// memory a byte of text before): opening one and drawing batches keeps next
// to nothing of it in this process.
TEST(TokenFileTest, LargeFilesAreReadInPlaceNotCopied) {
  constexpr std::size_t kBytes = std::size_t{96} << 20;
  const auto text = fresh_path("large.txt");
  {
    std::ofstream out(text, std::ios::binary);
    const std::string block(1 << 20, 'a');
    for (std::size_t i = 0; i < kBytes / block.size(); ++i) out.write(block.data(), static_cast<std::streamsize>(block.size()));
  }
  const std::int64_t before = resident_kib();
  auto source = open_token_data(text);
  Batch batch;
  for (int step = 0; step < 10; ++step) source->next_batch(256, 32, batch);
  EXPECT_LT(resident_kib() - before, 8 * 1024) << "KiB resident after opening a 96 MiB text file and drawing batches";

  const auto tokens = fresh_path("large.sgt");
  {
    std::ofstream out(tokens, std::ios::binary);
    const std::string head = header(2, 50000, kBytes / 2);
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    const std::string block(1 << 20, '\x01');  // token 257
    for (std::size_t i = 0; i < kBytes / block.size(); ++i) out.write(block.data(), static_cast<std::streamsize>(block.size()));
  }
  const std::int64_t before_tokens = resident_kib();
  auto token_source = open_token_data(tokens);
  EXPECT_EQ(token_source->vocab(), 50000);
  token_source->next_batch(4, 8, batch);
  EXPECT_EQ(batch.labels, (std::vector<std::int32_t>{257, 257, 257, 257}));
  EXPECT_LT(resident_kib() - before_tokens, 8 * 1024) << "KiB resident after checking a 96 MiB token file";
}

// A file cut short during the run: an error naming it, not a fault.
TEST(TokenFileTest, AFileThatShrinksDuringTheRunIsAClearError) {
  const auto path = fresh_path("shrinks.txt");
  write_bytes(path, std::string(4096, 'x'));
  auto source = open_token_data(path);
  std::filesystem::resize_file(path, 3);
  Batch batch;
  expect_error([&] { source->next_batch(64, 16, batch); }, ErrorCode::kIo,
               {path.string(), "of the 4096 it had when opened"});
}

}  // namespace
}  // namespace stepgraph::trainer
