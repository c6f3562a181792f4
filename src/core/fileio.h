// File access for Keel's own formats. Every failure is a keel::Error naming the file.
// They go through Env::get() (core/env.h), the seam where tests inject faults.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace keel {

// Writes bytes to path (created or truncated) and fsyncs it.
void write_file(const std::string& path, const void* data, size_t bytes);
inline void write_file(const std::string& path, const std::string& text) { write_file(path, text.data(), text.size()); }
struct ByteRange {
  const void* data;
  size_t bytes;
};
// Writes the ranges in order to path.tmp, fsyncs it and renames it over path, so path holds either
// its old content or all of the new. On failure path.tmp is removed and the error names path.
void write_file_atomic(const std::string& path, std::initializer_list<ByteRange> ranges);
// The same for a number of ranges known only at run time.
void write_file_atomic(const std::string& path, std::span<const ByteRange> ranges);
// A file descriptor, closed when it dies.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& o) noexcept : fd_(o.release()) {}
  FileDescriptor& operator=(FileDescriptor&& o) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Opens path (following links) for reading if it is a regular file. Anything else (a FIFO, a
// device, a socket, a directory) is refused with "WHAT PATH: not a regular file (a FIFO)" and is
// never waited on: the open cannot block (O_NONBLOCK, cleared again before returning), and the
// type is checked on the open descriptor, so what is read is what was checked. Every reader of a
// file from outside (checkpoints, data, images, configs, imports, metrics) opens through this.
// With `bytes`, also gives the file's size when it was opened.
FileDescriptor open_regular_file(const std::string& path, const std::string& what = "file", uint64_t* bytes = nullptr);
// Creates path, or truncates it if it is a regular file, for writing; anything else is refused the
// same way (a FIFO would block the writer, a device would take the bytes).
FileDescriptor create_regular_file(const std::string& path, const std::string& what = "file");
using FileStream = std::unique_ptr<FILE, int (*)(FILE*)>;
// The same, as a stdio stream ("rb"), for libraries that read through FILE*.
FileStream open_regular_stream(const std::string& path, const std::string& what = "file", uint64_t* bytes = nullptr);
// "a FIFO", "a character device", "a block device", "a socket", "a directory", ...: the kind of a
// file that is not a regular file, for messages; "" for a regular file.
std::string file_kind(std::filesystem::file_type type);
// The one-line refusal of a file that is not a regular file: "WHAT PATH: not a regular file (a FIFO)".
std::string not_regular_file_message(const std::string& what, const std::string& path, std::filesystem::file_type type);

// Reads a whole file. Throws if it is missing, unreadable or not a regular file.
std::vector<char> read_file(const std::string& path);
std::string read_text_file(const std::string& path);
// fsyncs a directory so renames inside it are durable.
void sync_directory(const std::string& path);

}  // namespace keel
