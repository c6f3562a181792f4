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

void write_file(const std::string& path, const void* data, size_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check(fd >= 0, "file " + path + ": cannot create (" + os_error() + ")");
  const char* p = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = os_error();
      ::close(fd);
      throw Error("file " + path + ": write failed after " + std::to_string(bytes - left) + " of " +
                  std::to_string(bytes) + " bytes (" + why + ")");
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const std::string why = os_error();
    ::close(fd);
    throw Error("file " + path + ": fsync failed (" + why + ")");
  }
  check(::close(fd) == 0, "file " + path + ": close failed (" + os_error() + ")");
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
