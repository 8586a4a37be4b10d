// A data file read in place with pread: the trainer keeps no copy of a text or
// token file, only the bytes of the examples it draws, so a file of any size
// costs its readers a few kilobytes (the kernel's page cache holds what it
// likes, reclaimably). A file that shrinks while the run reads it is an
// Error naming it, not a SIGBUS as a mapping's would be.
//
//   FileReader file = FileReader::open(path, "data file");
//   file.read(offset, std::span(buffer));   // every byte, or Error(kIo)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace stepgraph::trainer {

class FileReader {
 public:
  // Opens `path` (a non-empty regular file). Throws Error(kIo) naming `what`
  // and the path for a missing, unreadable, empty or non-regular file.
  static FileReader open(const std::filesystem::path& path, const std::string& what);

  FileReader() = default;
  FileReader(FileReader&& other) noexcept;
  FileReader& operator=(FileReader&& other) noexcept;
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  ~FileReader();

  std::uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  // Fills `out` with the bytes at `offset`, or throws Error(kIo).
  void read(std::uint64_t offset, std::span<unsigned char> out) const;

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::filesystem::path path_;
  std::string what_;
};

}  // namespace stepgraph::trainer
