#include "trainer/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph::trainer {
namespace {

// Closes the descriptor when the mapping is made (or on an error): the
// mapping keeps the file open by itself.
struct Descriptor {
  int fd = -1;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

MappedFile MappedFile::open(const std::filesystem::path& path, const std::string& what) {
  Descriptor file;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd < 0) {
    const int error = errno;
    SG_CHECK_CODE(error != ENOENT, ErrorCode::kIo, what, " ", path, " does not exist");
    SG_THROW(ErrorCode::kIo, "cannot open ", what, " ", path, ": ", std::strerror(error));
  }
  struct stat info {};
  SG_CHECK_CODE(::fstat(file.fd, &info) == 0, ErrorCode::kIo, "cannot stat ", what, " ", path, ": ",
                std::strerror(errno));
  SG_CHECK_CODE(!S_ISDIR(info.st_mode), ErrorCode::kIo, what, " ", path, " is a directory; pass a text or token file");
  SG_CHECK_CODE(S_ISREG(info.st_mode), ErrorCode::kIo, what, " ", path,
                " is not a regular file (a pipe or a device); pass a text or token file");
  SG_CHECK_CODE(info.st_size > 0, ErrorCode::kIo, what, " ", path, " is empty");
  const auto size = static_cast<std::size_t>(info.st_size);
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, file.fd, 0);
  SG_CHECK_CODE(data != MAP_FAILED, ErrorCode::kIo, "cannot map ", what, " ", path, " (", size,
                " bytes) into memory: ", std::strerror(errno));
  return MappedFile(static_cast<const unsigned char*>(data), size);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    MappedFile old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr && ::munmap(const_cast<unsigned char*>(data_), size_) != 0) {
    logger().warn("munmap of a {}-byte data file failed: {}", size_, std::strerror(errno));
  }
}

void MappedFile::release_pages(std::size_t offset, std::size_t length) const {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  // Whole pages inside the range only: madvise wants a page-aligned start.
  const std::size_t begin = (offset + page - 1) / page * page;
  const std::size_t end = std::min(offset + length, size_) / page * page;
  if (begin >= end) return;
  // Only a hint: a failure costs memory, never correctness.
  ::madvise(const_cast<unsigned char*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace stepgraph::trainer
