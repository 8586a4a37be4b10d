#include "trainer/token_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/trainer/test_support.h"

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

}  // namespace
}  // namespace stepgraph::trainer
