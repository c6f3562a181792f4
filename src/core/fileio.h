// File access for Keel's own formats. Every failure is a keel::Error naming the file.
// (A later issue routes these through an injectable environment for fault-injection tests.)
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace keel {

// Writes bytes to path (created or truncated) and fsyncs it.
void write_file(const std::string& path, const void* data, size_t bytes);
inline void write_file(const std::string& path, const std::string& text) { write_file(path, text.data(), text.size()); }
// Reads a whole file. Throws if it is missing or unreadable.
std::vector<char> read_file(const std::string& path);
std::string read_text_file(const std::string& path);
// fsyncs a directory so renames inside it are durable.
void sync_directory(const std::string& path);

}  // namespace keel
