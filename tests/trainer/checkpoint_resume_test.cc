// The trainer's checkpoints as a resume reads them (trainer/train_state.h):
// a checkpoint edited by hand (with its checksum recomputed, as anyone who
// can write the file can do), one of another run, or a directory that
// cannot hold one is a clear error naming what differs, never a silently
// different run. On the host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/test_support.h"
#include "checkpoint/checkpoint.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

using testing::expect_error;
using testing::fresh_path;

TrainerOptions small_options() {
  return resolve_defaults(
      testing::small_model_flags(testing::SmallModel::kSequence,
                                 {.steps = 3, .log_every = 1, .dtype = DType::kBFloat16, .seed = 11}),
      Device::kHost);
}

// Trains `o` for 3 steps into a fresh checkpoint and returns its path.
std::filesystem::path saved_run(TrainerOptions o, const std::string& name) {
  const std::filesystem::path path = fresh_path(name);
  o.checkpoint = path.string();
  o.steps = 3;
  std::ostringstream log;
  train(o, Device::kHost, log);
  return path;
}

// `o` resumed from `path` to step 5.
void resume(TrainerOptions o, const std::filesystem::path& path) {
  o.checkpoint = path.string();
  o.resume = true;
  o.steps = 5;
  std::ostringstream log;
  train(o, Device::kHost, log);
}

// The checkpoint at `path` with `edit` applied, written (checksum and all) to a new file.
std::filesystem::path edited(const std::filesystem::path& path, const std::string& name,
                             const std::function<void(Checkpoint&)>& edit) {
  Checkpoint checkpoint = read_checkpoint(path);
  edit(checkpoint);
  const std::filesystem::path out = fresh_path(name);
  write_checkpoint(out, checkpoint);
  return out;
}

CheckpointTensor& tensor_named(Checkpoint& checkpoint, const std::string& name) {
  for (CheckpointTensor& tensor : checkpoint.tensors) {
    if (tensor.name == name) return tensor;
  }
  throw std::runtime_error("no tensor " + name);
}

void set_int64(Checkpoint& checkpoint, const std::string& name, std::int64_t value) {
  std::memcpy(tensor_named(checkpoint, name).bytes.data(), &value, sizeof(value));
}

TEST(CheckpointResumeTest, ResumingWithoutTheScheduleTheCheckpointRecordedIsRefused) {
  TrainerOptions o = small_options();
  o.lr_schedule = kernels::LrScheduleKind::kCosine;
  o.warmup_steps = 2;
  o.min_lr = o.lr / 10;
  o.decay_steps = 10;
  const std::filesystem::path path = saved_run(o, "scheduled.safetensors");
  TrainerOptions constant = small_options();  // no --lr-schedule: a constant rate
  expect_error([&] { resume(constant, path); }, ErrorCode::kInvalidArgument,
               {"config.lr-schedule: checkpoint cosine", "this run (not set: pass --lr-schedule"});
  resume(o, path);  // the same schedule resumes
}

// The options hold a flag's value; a checkpoint records it as text (`key` =
// `recorded`). Another spelling of the same value resumes; another value, or
// a text that is no value, names the difference.
void expect_compared_as_values(const TrainerOptions& o, const std::string& key, const std::string& recorded,
                               const std::string& same, const std::vector<std::string>& others) {
  const std::filesystem::path path = saved_run(o, key + ".safetensors");
  EXPECT_EQ(read_checkpoint(path).metadata.at(key), recorded);
  const auto with_text = [&](const std::string& text) {
    return edited(path, key + "_edited.safetensors", [&](Checkpoint& c) { c.metadata[key] = text; });
  };
  resume(o, with_text(same));
  for (const std::string& other : others) {
    expect_error([&] { resume(o, with_text(other)); }, ErrorCode::kInvalidArgument,
                 {key + ": checkpoint " + other + ", this run " + recorded});
  }
}

TEST(CheckpointResumeTest, TheOverlapIsComparedAsModesNotSpelling) {
  expect_compared_as_values(small_options(), "config.overlap", "bulk", "bulk,bulk,bulk,bulk", {"none", "sideways"});
}

TEST(CheckpointResumeTest, TheBucketsAreComparedAsCountsNotSpelling) {
  TrainerOptions o = small_options();
  o.buckets = BucketSpec{.sizes = {16, 32}};
  o.min_seq_len = 3;
  expect_compared_as_values(o, "config.buckets", "16,32", "16, 032", {"16,64"});
}

TEST(CheckpointResumeTest, EditedCountsAreRefused) {
  const TrainerOptions o = small_options();
  const std::filesystem::path path = saved_run(o, "counts.safetensors");
  const auto with_metadata = [&](const std::string& key, const std::string& value) {
    return edited(path, "counts_edited.safetensors", [&](Checkpoint& c) { c.metadata[key] = value; });
  };
  for (const char* step : {"-1", "-100", " +2", "+2", "18446744073709551615", "3.0"}) {
    const auto file = with_metadata("stepgraph.step", step);
    expect_error([&] { resume(o, file); }, ErrorCode::kIo, {"'stepgraph.step' is '", "not a count"});
  }
  const auto huge_position = with_metadata("stepgraph.data_position", "18446744073709551615");
  expect_error([&] { resume(o, huge_position); }, ErrorCode::kIo, {"'stepgraph.data_position'", "not a count"});
  const auto other_position = with_metadata("stepgraph.data_position", "2");
  expect_error([&] { resume(o, other_position); }, ErrorCode::kIo,
               {"'stepgraph.data_position' is 2 but its 'stepgraph.step' is 3", "must be equal"});
  for (const std::int64_t count : {std::int64_t{-100}, std::int64_t{4}, std::numeric_limits<std::int64_t>::min()}) {
    const auto file = edited(path, "adamw_step.safetensors", [&](Checkpoint& c) { set_int64(c, "adamw.step", count); });
    expect_error([&] { resume(o, file); }, ErrorCode::kIo, {"'adamw.step'", "outside [0, 3]"});
  }
  const auto skipped =
      edited(path, "skipped.safetensors", [&](Checkpoint& c) { set_int64(c, "adamw.skipped_steps", -1); });
  expect_error([&] { resume(o, skipped); }, ErrorCode::kIo, {"'adamw.skipped_steps'", "outside [0, 3]"});
}

TEST(CheckpointResumeTest, NonFiniteMastersAreRefused) {
  const TrainerOptions o = small_options();
  const std::filesystem::path path = saved_run(o, "masters.safetensors");
  for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    std::string master;
    const auto file = edited(path, "nan_master.safetensors", [&](Checkpoint& c) {
      for (CheckpointTensor& tensor : c.tensors) {
        if (tensor.name.size() > 7 && tensor.name.ends_with(".master")) {
          std::memcpy(tensor.bytes.data() + 4, &bad, sizeof(bad));  // element 1
          master = tensor.name;
          return;
        }
      }
    });
    ASSERT_FALSE(master.empty());
    expect_error([&] { resume(o, file); }, ErrorCode::kIo, {"'" + master + "'", "NaN or infinite value (element 1)"});
  }
}

TEST(CheckpointResumeTest, UnknownEntriesAndExtraTensorsAreRefused) {
  const TrainerOptions o = small_options();
  const std::filesystem::path path = saved_run(o, "extras.safetensors");
  const auto extra = edited(path, "extra_tensor.safetensors", [](Checkpoint& c) {
    c.tensors.push_back({"bogus", DType::kFloat32, {2}, std::vector<std::byte>(8)});
  });
  expect_error([&] { resume(o, extra); }, ErrorCode::kIo, {"1 tensor(s) this model does not have: 'bogus'"});
  const auto unknown = edited(path, "unknown_key.safetensors", [](Checkpoint& c) { c.metadata["stepgraph.x"] = "1"; });
  expect_error([&] { resume(o, unknown); }, ErrorCode::kIo, {"unknown metadata entry 'stepgraph.x'"});
  const auto setting = edited(path, "setting.safetensors", [](Checkpoint& c) { c.metadata["config.new-flag"] = "on"; });
  expect_error([&] { resume(o, setting); }, ErrorCode::kInvalidArgument,
               {"config.new-flag: checkpoint on, this run (not set"});
  const auto manifest = edited(path, "manifest.safetensors", [](Checkpoint& c) {
    c.tensors.clear();
    c.metadata = {{"stepgraph.checkpoint_set", "1"}, {"stepgraph.step", "3"}};
  });
  expect_error([&] { resume(o, manifest); }, ErrorCode::kIo, {"manifest of per-rank files", "--dp-mode zero1"});
  const auto missing = edited(path, "missing.safetensors", [](Checkpoint& c) {
    std::erase_if(c.tensors, [](const CheckpointTensor& t) { return t.name == "adamw.step"; });
  });
  expect_error([&] { resume(o, missing); }, ErrorCode::kIo, {"no tensor 'adamw.step'"});
}

// A 2-layer checkpoint whose configuration was edited to say 1 layer: the
// second layer's tensors are left over.
TEST(CheckpointResumeTest, AnEditedLayerCountIsRefused) {
  const TrainerOptions o = small_options();
  const std::filesystem::path path = saved_run(o, "layers.safetensors");
  const auto one_layer =
      edited(path, "one_layer.safetensors", [](Checkpoint& c) { c.metadata["config.layers"] = "1"; });
  TrainerOptions smaller = o;
  smaller.layers = 1;
  expect_error([&] { resume(smaller, one_layer); }, ErrorCode::kIo, {"this model does not have", "block1"});
}

TEST(CheckpointResumeTest, AnotherDtypeOrModelNamesTheDifference) {
  const TrainerOptions o = small_options();
  const std::filesystem::path path = saved_run(o, "foreign.safetensors");
  TrainerOptions fp32 = o;
  fp32.dtype = DType::kFloat32;
  expect_error([&] { resume(fp32, path); }, ErrorCode::kInvalidArgument,
               {"config.dtype: checkpoint bf16, this run fp32"});
  TrainerOptions wider = o;
  wider.hidden = 64;
  wider.ffn = 128;
  expect_error([&] { resume(wider, path); }, ErrorCode::kInvalidArgument,
               {"config.hidden: checkpoint 32, this run 64", "config.ffn: checkpoint 64, this run 128"});
}

TEST(CheckpointResumeTest, AnUnwritableCheckpointDirectoryStopsTheRunBeforeTraining) {
  TrainerOptions o = small_options();
  o.checkpoint = (fresh_path("no-such-dir") / "run.safetensors").string();
  std::ostringstream log;
  expect_error([&] { train(o, Device::kHost, log); }, ErrorCode::kIo,
               {"--checkpoint", "no-such-dir", "does not exist"});
  EXPECT_EQ(log.str().find("step 1 "), std::string::npos) << "it trained first:\n" << log.str();
  o.checkpoint = "/proc/run.safetensors";  // no process may create files there
  std::ostringstream proc_log;
  expect_error([&] { train(o, Device::kHost, proc_log); }, ErrorCode::kIo, {"--checkpoint", "cannot create files in"});
  EXPECT_EQ(proc_log.str().find("step 1 "), std::string::npos) << proc_log.str();
}

}  // namespace
}  // namespace stepgraph::trainer
