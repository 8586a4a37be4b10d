#include "trainer/file_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "engine/error.h"

namespace stepgraph::trainer {

FileReader FileReader::open(const std::filesystem::path& path, const std::string& what) {
  FileReader file;
  file.path_ = path;
  file.what_ = what;
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) {
    const int error = errno;
    SG_CHECK_CODE(error != ENOENT, ErrorCode::kIo, what, " ", path, " does not exist");
    SG_THROW(ErrorCode::kIo, "cannot open ", what, " ", path, ": ", std::strerror(error));
  }
  struct stat info {};
  SG_CHECK_CODE(::fstat(file.fd_, &info) == 0, ErrorCode::kIo, "cannot stat ", what, " ", path, ": ",
                std::strerror(errno));
  SG_CHECK_CODE(!S_ISDIR(info.st_mode), ErrorCode::kIo, what, " ", path, " is a directory; pass a text or token file");
  SG_CHECK_CODE(S_ISREG(info.st_mode), ErrorCode::kIo, what, " ", path,
                " is not a regular file (a pipe or a device); pass a text or token file");
  SG_CHECK_CODE(info.st_size > 0, ErrorCode::kIo, what, " ", path, " is empty");
  file.size_ = static_cast<std::uint64_t>(info.st_size);
  return file;
}

FileReader::FileReader(FileReader&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      size_(std::exchange(other.size_, 0)),
      path_(std::move(other.path_)),
      what_(std::move(other.what_)) {}

FileReader& FileReader::operator=(FileReader&& other) noexcept {
  if (this != &other) {
    FileReader old(std::move(*this));
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
    path_ = std::move(other.path_);
    what_ = std::move(other.what_);
  }
  return *this;
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);  // read-only: nothing to lose
}

void FileReader::read(std::uint64_t offset, std::span<unsigned char> out) const {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(got >= 0, ErrorCode::kIo, "cannot read ", what_, " ", path_, " at byte ", offset + done, ": ",
                  std::strerror(errno));
    SG_CHECK_CODE(got > 0, ErrorCode::kIo, what_, " ", path_, " ended at byte ", offset + done, " of the ", size_,
                  " it had when opened: was it changed during the run?");
    done += static_cast<std::size_t>(got);
  }
}

}  // namespace stepgraph::trainer
