// A whole file mapped read-only into memory, for the training data: the
// trainer reads text and token files through the mapping, so a file costs at
// most its own size in (reclaimable, file-backed) memory instead of a copy
// and a widened token array.
//
//   MappedFile file = MappedFile::open(path, "data file");
//   std::span<const unsigned char> bytes = file.bytes();
//   file.release_pages(0, 64 << 20);  // done with them: drop from memory
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>

namespace stepgraph::trainer {

class MappedFile {
 public:
  // Maps `path` (a non-empty regular file). Throws Error(kIo) naming `what`
  // and the path for a missing, unreadable, empty or non-regular file.
  static MappedFile open(const std::filesystem::path& path, const std::string& what);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const unsigned char> bytes() const { return {data_, size_}; }
  std::size_t size() const { return size_; }

  // A hint that bytes [offset, offset + length) are not needed soon: their
  // pages leave this process's resident set (they are read again from the
  // file, or the page cache, if touched later).
  void release_pages(std::size_t offset, std::size_t length) const;

 private:
  MappedFile(const unsigned char* data, std::size_t size) : data_(data), size_(size) {}

  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace stepgraph::trainer
