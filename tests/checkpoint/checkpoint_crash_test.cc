// A process killed at any point of a save leaves the previous checkpoint
// loadable and exact (Note [Atomic file writes], Note [Checkpoint sets]):
// a forked child writes a new checkpoint and SIGKILLs itself at one write
// point (before, during and after the rename); the parent then loads.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "tests/trainer/test_support.h"
#include "checkpoint/atomic_file.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_set.h"

namespace stepgraph::trainer {
namespace {

using testing::fresh_path;

constexpr WritePoint kPoints[] = {WritePoint::kCreated, WritePoint::kPartlyWritten, WritePoint::kWritten,
                                  WritePoint::kSynced,  WritePoint::kRenamed,       WritePoint::kDirectorySynced};

Checkpoint state(int step, int rank) {
  Checkpoint checkpoint;
  checkpoint.metadata = {{"stepgraph.step", std::to_string(step)}, {"rank", std::to_string(rank)}};
  CheckpointTensor tensor{"w", DType::kFloat32, {64, 64}, std::vector<std::byte>(64 * 64 * 4)};
  for (std::size_t i = 0; i < tensor.bytes.size(); ++i)
    tensor.bytes[i] = static_cast<std::byte>(i * 13 + step * 7 + rank);
  checkpoint.tensors.push_back(std::move(tensor));
  return checkpoint;
}

bool same(const Checkpoint& a, const Checkpoint& b) {
  return a.metadata == b.metadata && a.tensors.size() == b.tensors.size() && a.tensors[0].bytes == b.tensors[0].bytes;
}

// Runs `body` in a child process and expects the child to die by SIGKILL.
void expect_killed(const std::function<void()>& body, const std::string& where) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      body();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);  // the kill point was never reached
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << where << ": the child was not killed (exit " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";
}

TEST(CheckpointCrashTest, AKilledSaveLeavesTheOldOrTheNewFileWhole) {
  const auto path = fresh_path("single.safetensors");
  const Checkpoint old_state = state(1, 0);
  const Checkpoint new_state = state(2, 0);
  for (const WritePoint point : kPoints) {
    write_checkpoint(path, old_state);
    expect_killed(
        [&] {
          write_checkpoint(path, new_state, [&](WritePoint at) {
            if (at == point) ::raise(SIGKILL);
          });
        },
        std::string(write_point_name(point)));
    const Checkpoint loaded = read_checkpoint(path);  // loadable, and exactly one of the two
    const bool renamed = point == WritePoint::kRenamed || point == WritePoint::kDirectorySynced;
    EXPECT_TRUE(same(loaded, renamed ? new_state : old_state)) << "killed at " << write_point_name(point);
  }
}

// An all-gather between threads standing in for ranks.
class ThreadExchange {
 public:
  explicit ThreadExchange(int ranks) : values_(static_cast<std::size_t>(ranks)) {}
  std::vector<std::string> exchange(int rank, const std::string& value) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int generation = generation_;
    values_[static_cast<std::size_t>(rank)] = value;
    if (++arrived_ == static_cast<int>(values_.size())) {
      result_ = values_;
      arrived_ = 0;
      ++generation_;
      ready_.notify_all();
    } else {
      ready_.wait(lock, [&] { return generation_ != generation; });
    }
    return result_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<std::string> values_;
  std::vector<std::string> result_;
  int arrived_ = 0;
  int generation_ = 0;
};

// Every rank's write_checkpoint_set of `step`, each on a thread; `observer`
// sees (rank, file, point).
void write_set(const std::filesystem::path& path, int step, int ranks,
               const std::function<void(int, SetFile, WritePoint)>& observer = {}) {
  ThreadExchange exchange(ranks);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        write_checkpoint_set(
            path, step, r, ranks, state(step, r), [&](const std::string& value) { return exchange.exchange(r, value); },
            [&](SetFile file, WritePoint point) {
              if (observer) observer(r, file, point);
            });
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

TEST(CheckpointCrashTest, AKilledSetSaveLeavesACompleteSet) {
  constexpr int kRanks = 2;
  const auto path = fresh_path("set.safetensors");
  int old_sets = 0;
  int new_sets = 0;
  for (int rank = 0; rank < kRanks; ++rank) {
    for (const SetFile file : {SetFile::kPart, SetFile::kManifest}) {
      for (const WritePoint point : kPoints) {
        const std::string where = "rank " + std::to_string(rank) + (file == SetFile::kPart ? " part " : " manifest ") +
                                  std::string(write_point_name(point));
        write_set(path, 1, kRanks);
        expect_killed(
            [&] {
              write_set(path, 2, kRanks, [&](int r, SetFile f, WritePoint at) {
                if (r == rank && f == file && at == point) ::raise(SIGKILL);
              });
            },
            where);
        // Every rank loads its part of one complete set, old or new, exactly.
        const CheckpointSetPart first = read_checkpoint_set_part(path, 0, kRanks);
        for (int r = 0; r < kRanks; ++r) {
          const CheckpointSetPart part = read_checkpoint_set_part(path, r, kRanks);
          EXPECT_EQ(part.step, first.step) << where;
          EXPECT_TRUE(same(part.checkpoint, state(static_cast<int>(part.step), r))) << where << ", rank " << r;
        }
        if (file == SetFile::kPart) {
          EXPECT_EQ(first.step, 1) << where << ": no manifest of step 2 can exist before every part is written";
        }
        if (file == SetFile::kManifest && (point == WritePoint::kRenamed || point == WritePoint::kDirectorySynced)) {
          EXPECT_EQ(first.step, 2) << where << ": the manifest was renamed, the new set is committed";
        }
        (first.step == 1 ? old_sets : new_sets) += 1;
      }
    }
  }
  EXPECT_GE(old_sets, 12);  // every part point of both ranks, at least
  EXPECT_GE(new_sets, 4);   // every manifest point after its rename, at least
}

}  // namespace
}  // namespace stepgraph::trainer
