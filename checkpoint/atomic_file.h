// A file that appears whole or not at all.
//
// Note [Atomic file writes]
// AtomicFile creates a temporary file with a fresh name in the target's
// directory (".NAME.tmp-<pid>-<random>"), opened with O_CREAT | O_EXCL |
// O_NOFOLLOW: a file or symlink planted under any name is never opened or
// followed, and two writers never share a temporary. commit() fsyncs the
// file, renames it over the target (rename replaces a symlink at the target
// by the file, it never writes through one) and fsyncs the directory, so
// after commit() returns the new file survives a power loss, and a crash
// at any earlier point leaves the target as it was. An uncommitted
// temporary is removed by the destructor; a killed process can leave one
// behind, which no reader ever opens and which may be deleted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace stepgraph {

// The points of a write, in order: a test kills the writer at each one and
// checks that the target is still the old file (before kRenamed) or the new
// one (from kRenamed on).
enum class WritePoint {
  kCreated,          // the temporary exists, empty
  kPartlyWritten,    // some of the bytes are written
  kWritten,          // every byte is written, not yet synced
  kSynced,           // the temporary is fsync'd and closed
  kRenamed,          // the temporary is renamed over the target
  kDirectorySynced,  // the directory is fsync'd: done
};
std::string_view write_point_name(WritePoint point);

// Called at each point; tests use it to fail or kill the writer there.
using WriteObserver = std::function<void(WritePoint)>;

class AtomicFile {
 public:
  // Creates the temporary beside `target` (nothing is written to `target`
  // until commit). Error(kIo) naming the directory when it cannot.
  explicit AtomicFile(std::filesystem::path target, WriteObserver observer = {});
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();  // removes an uncommitted temporary; never throws

  // Appends bytes; Error(kIo) naming the target.
  void write(const void* data, std::size_t size);
  // Overwrites bytes already written at `offset` (a checksum known last).
  void write_at(std::uint64_t offset, const void* data, std::size_t size);
  std::uint64_t size() const { return size_; }

  // fsync, rename over the target, fsync the directory. After an error the
  // target is unchanged (or already the new file where only the directory's
  // sync failed, which the error says).
  void commit();
  // The same, renamed over `target` instead (a file named after its
  // checksum, known once written); it must be in the same directory.
  void commit_as(const std::filesystem::path& target);

  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& temporary() const { return temporary_; }

 private:
  void notify(WritePoint point) const;

  std::filesystem::path target_;
  std::filesystem::path temporary_;
  WriteObserver observer_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  bool partly_notified_ = false;
  bool committed_ = false;
};

// Checks that files can be created in `path`'s directory (it exists, is a
// directory, and a temporary can be made and removed there). `flag` names
// the option in the error, e.g. "--checkpoint".
void check_writable_directory(const std::filesystem::path& path, std::string_view flag);

}  // namespace stepgraph
