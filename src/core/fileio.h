// File access for Keel's own formats. Every failure is a keel::Error naming the file.
// They go through Env::get() (core/env.h), the seam where tests inject faults.
#pragma once

#include <cstddef>
#include <initializer_list>
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
// Reads a whole file. Throws if it is missing or unreadable.
std::vector<char> read_file(const std::string& path);
std::string read_text_file(const std::string& path);
// fsyncs a directory so renames inside it are durable.
void sync_directory(const std::string& path);

}  // namespace keel
