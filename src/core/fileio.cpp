#include "core/fileio.h"

#include "core/env.h"
#include "core/error.h"

namespace keel {

namespace {

// Writes ranges to a new file at path and fsyncs it; on failure removes it and rethrows.
void write_new_file(Env& env, const std::string& path, std::initializer_list<ByteRange> ranges) {
  std::unique_ptr<WritableFile> file = env.create(path);
  try {
    for (const ByteRange& r : ranges) file->append(r.data, r.bytes);
    file->sync();
    file->close();
  } catch (...) {
    file.reset();
    try {
      env.remove(path);
    } catch (const Error&) {
    }
    throw;
  }
}

}  // namespace

void write_file(const std::string& path, const void* data, size_t bytes) {
  write_new_file(Env::get(), path, {ByteRange{data, bytes}});
}

void write_file_atomic(const std::string& path, std::initializer_list<ByteRange> ranges) {
  Env& env = Env::get();
  const std::string tmp = path + ".tmp";
  write_new_file(env, tmp, ranges);
  try {
    env.rename(tmp, path);
  } catch (...) {
    try {
      env.remove(tmp);
    } catch (const Error&) {
    }
    throw;
  }
}

std::vector<char> read_file(const std::string& path) { return Env::get().read(path); }

std::string read_text_file(const std::string& path) {
  std::vector<char> bytes = read_file(path);
  return std::string(bytes.begin(), bytes.end());
}

void sync_directory(const std::string& path) { Env::get().sync_dir(path); }

}  // namespace keel
