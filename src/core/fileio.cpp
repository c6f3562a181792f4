#include "core/fileio.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace keel {

namespace {
std::string os_error() { return std::strerror(errno); }
}  // namespace

namespace {

// Writes ranges to a new file at path and fsyncs it; on failure removes it and throws naming `name`.
void write_new_file(const std::string& path, std::initializer_list<ByteRange> ranges, const std::string& name) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check(fd >= 0, "file " + name + ": cannot create " + path + " (" + os_error() + ")");
  auto fail = [&](const std::string& what) {
    const std::string why = os_error();
    ::close(fd);
    ::unlink(path.c_str());
    throw Error("file " + name + ": " + what + " (" + why + ")");
  };
  size_t total = 0;
  for (const ByteRange& r : ranges) {
    const char* p = static_cast<const char*>(r.data);
    size_t left = r.bytes;
    while (left > 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write failed after " + std::to_string(total) + " bytes");
      p += n;
      left -= static_cast<size_t>(n);
      total += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) fail("fsync failed");
  check(::close(fd) == 0, "file " + name + ": close failed (" + os_error() + ")");
}

}  // namespace

void write_file(const std::string& path, const void* data, size_t bytes) {
  write_new_file(path, {ByteRange{data, bytes}}, path);
}

void write_file_atomic(const std::string& path, std::initializer_list<ByteRange> ranges) {
  const std::string tmp = path + ".tmp";
  write_new_file(tmp, ranges, path);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = os_error();
    ::unlink(tmp.c_str());
    throw Error("file " + path + ": cannot rename " + tmp + " into place (" + why + ")");
  }
}

std::vector<char> read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd >= 0, "file " + path + ": cannot open (" + os_error() + ")");
  std::vector<char> out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = os_error();
      ::close(fd);
      throw Error("file " + path + ": read failed (" + why + ")");
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

std::string read_text_file(const std::string& path) {
  std::vector<char> bytes = read_file(path);
  return std::string(bytes.begin(), bytes.end());
}

void sync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace keel
