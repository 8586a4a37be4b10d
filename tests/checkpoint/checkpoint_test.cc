#include "checkpoint/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/error.h"
#include "tests/checkpoint/checkpoint_files.h"
#include "tests/trainer/test_support.h"
#include "checkpoint/atomic_file.h"

namespace stepgraph::trainer {
namespace {

using testing::expect_error;
using testing::fresh_path;
using testing::read_bytes;
using testing::sealed_file;
using testing::write_bytes;

// Temporary files a writer left beside `path` (Note [Atomic file writes]).
int leftover_temporaries(const std::filesystem::path& path) {
  int count = 0;
  const std::string prefix = "." + path.filename().string() + ".tmp-";
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path())) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) ++count;
  }
  return count;
}

CheckpointTensor make_tensor(std::string name, DType dtype, std::vector<std::int64_t> shape, int salt) {
  std::int64_t count = 1;
  for (std::int64_t dim : shape) count *= dim;
  CheckpointTensor tensor{std::move(name), dtype, std::move(shape), {}};
  tensor.bytes.resize(static_cast<std::size_t>(count) * dtype_size(dtype));
  for (std::size_t i = 0; i < tensor.bytes.size(); ++i) tensor.bytes[i] = static_cast<std::byte>(i * 31 + salt);
  return tensor;
}

Checkpoint sample_checkpoint(int salt) {
  Checkpoint checkpoint;
  checkpoint.metadata = {{"step", std::to_string(100 + salt)}, {"data_position", "7"}, {"note", "caf\xc3\xa9"}};
  checkpoint.tensors.push_back(make_tensor("layers.0.weight", DType::kFloat32, {3, 5}, salt));
  checkpoint.tensors.push_back(make_tensor("layers.0.bias", DType::kBFloat16, {5}, salt));
  checkpoint.tensors.push_back(make_tensor("adam.m", DType::kFloat16, {2, 3, 1}, salt));
  checkpoint.tensors.push_back(make_tensor("fp8", DType::kFloat8E4M3, {7}, salt));
  checkpoint.tensors.push_back(make_tensor("fp8b", DType::kFloat8E5M2, {1}, salt));
  checkpoint.tensors.push_back(make_tensor("ids", DType::kInt32, {4}, salt));
  checkpoint.tensors.push_back(make_tensor("step", DType::kInt64, {}, salt));  // a scalar
  checkpoint.tensors.push_back(make_tensor("empty", DType::kFloat32, {0, 4}, salt));
  return checkpoint;
}

void expect_same(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype) << a.tensors[i].name;
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape) << a.tensors[i].name;
    EXPECT_EQ(a.tensors[i].bytes, b.tensors[i].bytes) << a.tensors[i].name;
  }
}

TEST(CheckpointTest, RoundTripKeepsOrderMetadataAndBytes) {
  const auto path = fresh_path("model.safetensors");
  const Checkpoint written = sample_checkpoint(1);
  write_checkpoint(path, written);
  expect_same(read_checkpoint(path), written);
  EXPECT_EQ(leftover_temporaries(path), 0);
  // Overwriting replaces it.
  const Checkpoint second = sample_checkpoint(2);
  write_checkpoint(path, second);
  expect_same(read_checkpoint(path), second);
  EXPECT_EQ(leftover_temporaries(path), 0);
}

TEST(CheckpointTest, FileHasTheSafetensorsLayout) {
  const auto path = fresh_path("layout.safetensors");
  const Checkpoint written = sample_checkpoint(3);
  write_checkpoint(path, written);
  const std::string file = read_bytes(path);
  std::uint64_t length = 0;
  std::memcpy(&length, file.data(), 8);
  EXPECT_EQ(length % 8, 0u);
  EXPECT_EQ(file.substr(8, testing::kHeaderStart.size()), testing::kHeaderStart) << "the checksum comes first";
  const auto header = nlohmann::json::parse(file.substr(8, length));
  EXPECT_EQ(header["__metadata__"]["step"], "103");
  EXPECT_EQ(header["__metadata__"][std::string(kChecksumKey)].get<std::string>().rfind("fnv1a64:", 0), 0u);
  EXPECT_EQ(header["layers.0.bias"]["dtype"], "BF16");
  EXPECT_EQ(header["layers.0.weight"]["shape"], nlohmann::json({3, 5}));
  EXPECT_EQ(header["layers.0.weight"]["data_offsets"], nlohmann::json({0, 60}));
  EXPECT_EQ(header["layers.0.bias"]["data_offsets"], nlohmann::json({60, 70}));
  EXPECT_EQ(header["step"]["shape"], nlohmann::json::array());
  const std::size_t data = 8 + length;
  EXPECT_EQ(file.size(), data + 60 + 10 + 12 + 7 + 1 + 16 + 8 + 0);
  EXPECT_EQ(std::memcmp(file.data() + data + 60, written.tensors[1].bytes.data(), 10), 0);
}

TEST(CheckpointTest, CorruptBytesAreDetected) {
  const auto path = fresh_path("corrupt.safetensors");
  write_checkpoint(path, sample_checkpoint(4));
  const std::string good = read_bytes(path);
  std::uint64_t length = 0;
  std::memcpy(&length, good.data(), 8);

  std::string bad_data = good;
  bad_data[8 + length + 61] ^= 0x01;  // one bit of a tensor
  write_bytes(path, bad_data);
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "checksum mismatch"});

  std::string bad_metadata = good;
  bad_metadata.replace(bad_metadata.find("\"104\""), 5, "\"105\"");  // the stored step
  write_bytes(path, bad_metadata);
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "checksum mismatch"});

  std::string bad_shape = good;
  bad_shape.replace(bad_shape.find("[2,3,1]"), 7, "[3,2,1]");  // same size, other shape
  write_bytes(path, bad_shape);
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {"checksum mismatch"});

  std::string bad_start = good;
  bad_start[9] = '[';
  write_bytes(path, bad_start);
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "StepGraph checksum"});

  // A header that is not JSON, with a checksum that matches it.
  write_bytes(path, sealed_file(R"(},"w":{"dtype":"F32",)", ""));
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "not valid JSON"});
}

TEST(CheckpointTest, TruncatedFilesAreDetected) {
  const auto path = fresh_path("truncated.safetensors");
  write_checkpoint(path, sample_checkpoint(5));
  const std::string good = read_bytes(path);
  write_bytes(path, good.substr(0, good.size() - 1));
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "checksum mismatch", "truncated"});
  write_bytes(path, good.substr(0, 100));
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "header length"});
  write_bytes(path, good.substr(0, 5));
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {path.string(), "fewer than the 8-byte"});
  write_bytes(path, good + "extra");
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {"checksum mismatch"});
  // The same with a checksum over the extra bytes: the header does not describe them.
  write_bytes(path, sealed_file(R"(},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcdextra"));
  expect_error([&] { read_checkpoint(path); }, ErrorCode::kIo, {"9 bytes of tensor data, its header describes 4"});
}

TEST(CheckpointTest, MissingAndForeignFilesAreClearErrors) {
  const auto missing = fresh_path("missing.safetensors");
  expect_error([&] { read_checkpoint(missing); }, ErrorCode::kIo, {missing.string(), "does not exist"});
  const auto text = fresh_path("text.safetensors");
  write_bytes(text, "this is not a checkpoint at all, just some text");
  expect_error([&] { read_checkpoint(text); }, ErrorCode::kIo, {text.string(), "header length"});
  // A safetensors file from elsewhere: valid layout, no StepGraph checksum.
  const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string foreign(8, '\0');
  const std::uint64_t length = header.size();
  std::memcpy(foreign.data(), &length, 8);
  write_bytes(text, foreign + header + "abcd");
  expect_error([&] { read_checkpoint(text); }, ErrorCode::kIo, {"does not begin with a StepGraph checksum"});
  write_bytes(text, sealed_file(R"(},"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", "abcdefgh"));
  expect_error([&] { read_checkpoint(text); }, ErrorCode::kIo, {text.string(), "'F64'"});
  const auto directory = fresh_path("dir.safetensors");
  std::filesystem::create_directory(directory);
  expect_error([&] { read_checkpoint(directory); }, ErrorCode::kIo, {"is a directory"});
}

TEST(CheckpointTest, OldCheckpointSurvivesAFailedWrite) {
  const auto path = fresh_path("kept.safetensors");
  const Checkpoint old = sample_checkpoint(6);
  write_checkpoint(path, old);
  // A write that fails at any point before the rename leaves the old file
  // and no temporary behind.
  for (const WritePoint point :
       {WritePoint::kCreated, WritePoint::kPartlyWritten, WritePoint::kWritten, WritePoint::kSynced}) {
    expect_error(
        [&] {
          write_checkpoint(path, sample_checkpoint(7), [&](WritePoint at) {
            SG_CHECK_CODE(at != point, ErrorCode::kIo, "injected failure at ", write_point_name(at));
          });
        },
        ErrorCode::kIo, {"injected failure"});
    expect_same(read_checkpoint(path), old);
    EXPECT_EQ(leftover_temporaries(path), 0) << write_point_name(point);
  }
  // A directory where the old fixed temporary name was does not matter.
  std::filesystem::create_directory(path.string() + ".tmp");
  write_checkpoint(path, old);
  expect_same(read_checkpoint(path), old);
  // A directory in PATH's place: the rename fails, the temporary file goes.
  const auto blocked = fresh_path("blocked.safetensors");
  std::filesystem::create_directory(blocked);
  write_bytes(blocked / "inside", "keep me");
  expect_error([&] { write_checkpoint(blocked, old); }, ErrorCode::kIo, {"cannot rename"});
  EXPECT_EQ(leftover_temporaries(blocked), 0);
  EXPECT_EQ(read_bytes(blocked / "inside"), "keep me");
}

TEST(CheckpointTest, MalformedCheckpointsAreNotWritten) {
  const auto path = fresh_path("never.safetensors");
  Checkpoint wrong_size;
  wrong_size.tensors.push_back(make_tensor("w", DType::kFloat32, {2}, 0));
  wrong_size.tensors[0].bytes.pop_back();
  expect_error([&] { write_checkpoint(path, wrong_size); }, ErrorCode::kInvalidArgument, {"'w'", "7 bytes"});
  Checkpoint duplicate;
  duplicate.tensors = {make_tensor("w", DType::kFloat32, {1}, 0), make_tensor("w", DType::kInt32, {1}, 0)};
  expect_error([&] { write_checkpoint(path, duplicate); }, ErrorCode::kInvalidArgument, {"two tensors named 'w'"});
  Checkpoint reserved;
  reserved.metadata[std::string(kChecksumKey)] = "x";
  expect_error([&] { write_checkpoint(path, reserved); }, ErrorCode::kInvalidArgument, {"reserved"});
  Checkpoint negative;
  negative.tensors.push_back(CheckpointTensor{"n", DType::kFloat32, {2, -1}, {}});
  expect_error([&] { write_checkpoint(path, negative); }, ErrorCode::kInvalidArgument, {"'n'", "negative"});
  Checkpoint bad_name;
  bad_name.tensors.push_back(make_tensor("__metadata__", DType::kFloat32, {1}, 0));
  expect_error([&] { write_checkpoint(path, bad_name); }, ErrorCode::kInvalidArgument, {"not allowed"});
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(leftover_temporaries(path), 0);
}

// A symlink planted where a fixed temporary name would be, or at the target,
// is never written through (Note [Atomic file writes]).
TEST(CheckpointTest, PlantedSymlinksAreNotFollowed) {
  const auto path = fresh_path("planted.safetensors");
  const auto victim = fresh_path("victim.txt");
  write_bytes(victim, "do not overwrite");
  std::filesystem::create_symlink(victim, path.string() + ".tmp");
  const Checkpoint written = sample_checkpoint(9);
  write_checkpoint(path, written);
  EXPECT_EQ(read_bytes(victim), "do not overwrite");
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  EXPECT_TRUE(std::filesystem::is_symlink(path.string() + ".tmp"));
  expect_same(read_checkpoint(path), written);

  // A symlink at the target itself is replaced by the file, its target untouched.
  const auto linked = fresh_path("linked.safetensors");
  std::filesystem::create_symlink(victim, linked);
  write_checkpoint(linked, written);
  EXPECT_FALSE(std::filesystem::is_symlink(linked));
  EXPECT_EQ(read_bytes(victim), "do not overwrite");
  expect_same(read_checkpoint(linked), written);
}

TEST(CheckpointTest, TemporariesHaveFreshNames) {
  const auto path = fresh_path("fresh.safetensors");
  AtomicFile first(path);
  AtomicFile second(path);
  EXPECT_NE(first.temporary(), second.temporary());
  EXPECT_EQ(first.temporary().parent_path(), path.parent_path());
  EXPECT_EQ(leftover_temporaries(path), 2);
  first.write("a", 1);
  first.commit();
  EXPECT_EQ(read_bytes(path), "a");
  EXPECT_EQ(leftover_temporaries(path), 1);
}

TEST(CheckpointTest, WritableDirectoryIsCheckedUpFront) {
  const auto path = fresh_path("ok.safetensors");
  check_writable_directory(path, "--checkpoint");
  EXPECT_EQ(leftover_temporaries(path), 0);
  EXPECT_FALSE(std::filesystem::exists(path));
  expect_error([&] { check_writable_directory(path.parent_path() / "no-such-dir" / "c.safetensors", "--checkpoint"); },
               ErrorCode::kIo, {"--checkpoint", "no-such-dir", "does not exist"});
  const auto file = fresh_path("a-file");
  write_bytes(file, "x");
  expect_error([&] { check_writable_directory(file / "c.safetensors", "--checkpoint"); }, ErrorCode::kIo,
               {"--checkpoint", "is not a directory"});
  expect_error([&] { check_writable_directory(path.parent_path(), "--checkpoint"); }, ErrorCode::kIo,
               {"--checkpoint", "is a directory; name a file in it"});
  // Unwritable: a read-only directory (for root, which writes anywhere, /proc).
  const auto read_only = fresh_path("read-only");
  std::filesystem::create_directory(read_only);
  ::chmod(read_only.c_str(), 0555);
  const std::filesystem::path unwritable = ::geteuid() == 0 ? "/proc/c.safetensors" : read_only / "c.safetensors";
  expect_error([&] { check_writable_directory(unwritable, "--checkpoint"); }, ErrorCode::kIo,
               {"--checkpoint", "cannot create files in", "before training"});
  ::chmod(read_only.c_str(), 0755);
}

TEST(CheckpointTest, FindTensorNamesWhatIsThere) {
  const Checkpoint checkpoint = sample_checkpoint(8);
  EXPECT_EQ(&find_tensor(checkpoint, "ids"), &checkpoint.tensors[5]);
  expect_error([&] { find_tensor(checkpoint, "layers.9.weight"); }, ErrorCode::kIo,
               {"layers.9.weight", "layers.0.bias"});
}

TEST(CheckpointTest, DTypeNamesRoundTrip) {
  for (DType dtype : kAllDTypes) EXPECT_EQ(parse_safetensors_dtype(safetensors_dtype(dtype)), dtype);
  EXPECT_EQ(safetensors_dtype(DType::kBFloat16), "BF16");
  expect_error([] { parse_safetensors_dtype("F64"); }, ErrorCode::kIo,
               {"checkpoint tensor dtype 'F64' is not one StepGraph reads", "BF16"});
}

}  // namespace
}  // namespace stepgraph::trainer
