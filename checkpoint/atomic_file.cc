#include "checkpoint/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {

std::filesystem::path directory_of(const std::filesystem::path& path) {
  return path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
}

std::string error_text(int error) { return std::strerror(error); }

// Owns a descriptor for the scope; closing never throws.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Creates a new file with a fresh name in `directory`; never opens an
// existing file or follows a symlink (O_EXCL | O_NOFOLLOW). Returns the fd.
int create_fresh(const std::filesystem::path& directory, const std::string& stem, std::filesystem::path& out) {
  std::random_device device;
  std::uniform_int_distribution<std::uint64_t> draw;
  int error = 0;
  for (int attempt = 0; attempt < 16; ++attempt) {
    out = directory / fmt::format(".{}.tmp-{}-{:016x}", stem, ::getpid(), draw(device));
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    error = errno;
    if (error != EEXIST && error != EINTR) break;
  }
  SG_THROW(ErrorCode::kIo, "cannot create a temporary file in ", directory, " to write ", stem, ": ", error_text(error),
           "; check that the directory exists and is writable");
}

void fsync_directory(const std::filesystem::path& directory, const std::filesystem::path& target) {
  ScopedFd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  SG_CHECK_CODE(fd.get() >= 0 && ::fsync(fd.get()) == 0, ErrorCode::kIo, "wrote ", target,
                " but cannot sync its directory ", directory, ": ", error_text(errno),
                "; the file may not survive a power loss");
}

}  // namespace

std::string_view write_point_name(WritePoint point) {
  switch (point) {
    case WritePoint::kCreated: return "created";
    case WritePoint::kPartlyWritten: return "partly-written";
    case WritePoint::kWritten: return "written";
    case WritePoint::kSynced: return "synced";
    case WritePoint::kRenamed: return "renamed";
    case WritePoint::kDirectorySynced: return "directory-synced";
  }
  return "unknown";
}

AtomicFile::AtomicFile(std::filesystem::path target, WriteObserver observer)
    : target_(std::move(target)), observer_(std::move(observer)) {
  SG_CHECK_CODE(!target_.filename().empty(), ErrorCode::kInvalidArgument, "cannot write ", target_,
                ": the path names a directory, not a file");
  fd_ = create_fresh(directory_of(target_), target_.filename().string(), temporary_);
  try {
    notify(WritePoint::kCreated);
  } catch (...) {  // no destructor runs for a constructor that throws
    ::close(std::exchange(fd_, -1));
    ::unlink(temporary_.c_str());
    throw;
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && ::unlink(temporary_.c_str()) != 0 && errno != ENOENT) {
    logger().warn("cannot remove the temporary file {}: {}", temporary_.string(), error_text(errno));
  }
}

void AtomicFile::notify(WritePoint point) const {
  if (observer_) observer_(point);
}

void AtomicFile::write(const void* data, std::size_t size) {
  SG_CHECK_CODE(fd_ >= 0, ErrorCode::kInvalidState, "AtomicFile::write after commit of ", target_);
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(written > 0, ErrorCode::kIo, "cannot write ", target_, " (through ", temporary_,
                  "): ", error_text(errno), "; the previous file is unchanged");
    bytes += written;
    size -= static_cast<std::size_t>(written);
    size_ += static_cast<std::uint64_t>(written);
  }
  if (!partly_notified_ && size_ > 0) {
    partly_notified_ = true;
    notify(WritePoint::kPartlyWritten);
  }
}

void AtomicFile::write_at(std::uint64_t offset, const void* data, std::size_t size) {
  SG_CHECK_CODE(fd_ >= 0, ErrorCode::kInvalidState, "AtomicFile::write_at after commit of ", target_);
  SG_CHECK_CODE(offset + size <= size_, ErrorCode::kInternal, "AtomicFile::write_at past the written bytes of ",
                target_);
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::pwrite(fd_, bytes, size, static_cast<off_t>(offset));
    if (written < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(written > 0, ErrorCode::kIo, "cannot write ", target_, " (through ", temporary_,
                  "): ", error_text(errno), "; the previous file is unchanged");
    bytes += written;
    size -= static_cast<std::size_t>(written);
    offset += static_cast<std::uint64_t>(written);
  }
}

void AtomicFile::commit_as(const std::filesystem::path& target) {
  SG_CHECK_CODE(directory_of(target) == directory_of(target_), ErrorCode::kInternal, "AtomicFile::commit_as: ", target,
                " is not in the directory of ", target_);
  target_ = target;
  commit();
}

void AtomicFile::commit() {
  SG_CHECK_CODE(fd_ >= 0, ErrorCode::kInvalidState, "AtomicFile::commit twice for ", target_);
  notify(WritePoint::kWritten);
  const int fd = std::exchange(fd_, -1);
  const bool synced = ::fsync(fd) == 0;
  const int sync_error = errno;
  const bool closed = ::close(fd) == 0;
  SG_CHECK_CODE(synced && closed, ErrorCode::kIo, "cannot sync ", temporary_, " to write ", target_, ": ",
                error_text(synced ? errno : sync_error), "; the previous file is unchanged");
  notify(WritePoint::kSynced);
  SG_CHECK_CODE(::rename(temporary_.c_str(), target_.c_str()) == 0, ErrorCode::kIo, "cannot rename ", temporary_,
                " over ", target_, ": ", error_text(errno), "; the previous file is unchanged");
  committed_ = true;
  notify(WritePoint::kRenamed);
  fsync_directory(directory_of(target_), target_);
  notify(WritePoint::kDirectorySynced);
}

void check_writable_directory(const std::filesystem::path& path, std::string_view flag) {
  const std::filesystem::path directory = directory_of(path);
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(directory, error);
  SG_CHECK_CODE(std::filesystem::exists(status), ErrorCode::kIo, flag, " ", path, ": the directory ", directory,
                " does not exist; create it or choose another path");
  SG_CHECK_CODE(std::filesystem::is_directory(status), ErrorCode::kIo, flag, " ", path, ": ", directory,
                " is not a directory");
  SG_CHECK_CODE(!path.filename().empty() && !std::filesystem::is_directory(path, error), ErrorCode::kIo, flag, " ",
                path, " is a directory; name a file in it, e.g. ", path / "checkpoint.safetensors");
  std::filesystem::path probe;
  try {
    const int fd = create_fresh(directory, path.filename().string(), probe);
    ::close(fd);
  } catch (const Error& failure) {
    SG_THROW(ErrorCode::kIo, flag, " ", path, ": cannot create files in ", directory, " (", failure.message(),
             "); make it writable or choose another path before training");
  }
  ::unlink(probe.c_str());
}

}  // namespace stepgraph
