// Per-rank checkpoint files committed by a manifest (Note [Checkpoint
// sets]): the files a save leaves, and a foreign, incomplete or edited set
// as a clear error naming what differs.
#include "checkpoint/checkpoint_set.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/trainer/test_support.h"

namespace stepgraph::trainer {
namespace {

using testing::expect_error;
using testing::fresh_path;

Checkpoint part(int step, int rank) {
  Checkpoint checkpoint;
  checkpoint.metadata = {{"step", std::to_string(step)}, {"rank", std::to_string(rank)}};
  checkpoint.tensors.push_back({"w", DType::kInt32, {1}, std::vector<std::byte>(4, static_cast<std::byte>(step))});
  return checkpoint;
}

// Two ranks' saves in one thread: rank 0's part, then rank 1's, whose
// exchange returns both checksums; then rank 0's manifest (identical).
void save_two(const std::filesystem::path& path, int step) {
  std::string first;
  std::string second;
  AtomicFile probe(path);  // the checksum rank 0's part will have
  first = write_checkpoint_to(probe, part(step, 0));
  write_checkpoint_set(path, step, 1, 2, part(step, 1), [&](const std::string& mine) {
    second = mine;
    return std::vector<std::string>{first, second};
  });
  write_checkpoint_set(path, step, 0, 2, part(step, 0), [&](const std::string&) {
    return std::vector<std::string>{first, second};
  });
}

std::vector<std::string> files_of(const std::filesystem::path& path) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path())) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(path.filename().string(), 0) == 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(CheckpointSetTest, ASaveLeavesTheManifestAndOnePartPerRank) {
  const auto path = fresh_path("set.safetensors");
  save_two(path, 3);
  save_two(path, 5);
  const std::vector<std::string> names = files_of(path);
  ASSERT_EQ(names.size(), 3u) << "the manifest and step 5's parts; step 3's are gone";
  EXPECT_EQ(names[0], path.filename().string());
  EXPECT_NE(names[1].find(".step5.rank0-of-2."), std::string::npos) << names[1];
  EXPECT_NE(names[2].find(".step5.rank1-of-2."), std::string::npos) << names[2];
  for (int r = 0; r < 2; ++r) {
    const CheckpointSetPart loaded = read_checkpoint_set_part(path, r, 2);
    EXPECT_EQ(loaded.step, 5);
    EXPECT_EQ(loaded.checkpoint.metadata.at("rank"), std::to_string(r));
  }
}

TEST(CheckpointSetTest, ForeignAndIncompleteSetsAreClearErrors) {
  const auto path = fresh_path("foreign.safetensors");
  save_two(path, 4);
  // Another world size.
  expect_error([&] { read_checkpoint_set_part(path, 0, 4); }, ErrorCode::kIo,
               {"was written by 2 ranks, but this run has 4"});
  // A single-file checkpoint where a manifest belongs.
  const auto single = fresh_path("single.safetensors");
  write_checkpoint(single, part(4, 0));
  expect_error([&] { read_checkpoint_set_part(single, 0, 2); }, ErrorCode::kIo,
               {"single-file checkpoint, not the manifest", "--dp-mode allreduce"});
  // A part replaced by another valid file.
  const std::filesystem::path rank1 = read_checkpoint_set_part(path, 1, 2).file;
  write_checkpoint(rank1, part(9, 1));
  expect_error([&] { read_checkpoint_set_part(path, 1, 2); }, ErrorCode::kIo,
               {rank1.filename().string(), "but its manifest", "names"});
  // A missing part.
  std::filesystem::remove(rank1);
  expect_error([&] { read_checkpoint_set_part(path, 1, 2); }, ErrorCode::kIo,
               {"(step 4) names", "for rank 1, which does not exist"});
  // A missing manifest.
  expect_error([&] { read_checkpoint_set_part(fresh_path("none.safetensors"), 0, 2); }, ErrorCode::kIo,
               {"does not exist"});
}

TEST(CheckpointSetTest, EditedManifestsAreRefused) {
  const auto path = fresh_path("edited.safetensors");
  save_two(path, 4);
  const Checkpoint manifest = read_checkpoint(path);
  const auto edited = [&](const std::string& key, const std::string& value) {
    Checkpoint copy = manifest;
    if (value.empty()) {
      copy.metadata.erase(key);
    } else {
      copy.metadata[key] = value;
    }
    write_checkpoint(path, copy);
  };
  edited("stepgraph.step", "-1");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo,
               {"'stepgraph.step' is '-1', not a count"});
  edited("stepgraph.step", " +4");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo, {"not a count"});
  edited("stepgraph.world_size", "18446744073709551617");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo,
               {"'stepgraph.world_size'", "not a count"});
  edited("stepgraph.extra", "1");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo, {"unknown entry 'stepgraph.extra'"});
  edited("stepgraph.rank1.checksum", "");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo, {"1 checksums for 2 ranks"});
  edited("stepgraph.rank1.checksum", "fnv1a64:../../etc");
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo, {"not a checksum"});
  Checkpoint with_tensor = manifest;
  with_tensor.tensors.push_back(part(1, 0).tensors[0]);
  write_checkpoint(path, with_tensor);
  expect_error([&] { read_checkpoint_set_part(path, 0, 2); }, ErrorCode::kIo, {"holds 1 tensors"});
}

}  // namespace
}  // namespace stepgraph::trainer
