#include "core/fileio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/env.h"
#include "core/error.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

fs::file_type type_of(mode_t mode) {
  if (S_ISREG(mode)) return fs::file_type::regular;
  if (S_ISDIR(mode)) return fs::file_type::directory;
  if (S_ISFIFO(mode)) return fs::file_type::fifo;
  if (S_ISCHR(mode)) return fs::file_type::character;
  if (S_ISBLK(mode)) return fs::file_type::block;
  if (S_ISSOCK(mode)) return fs::file_type::socket;
  if (S_ISLNK(mode)) return fs::file_type::symlink;
  return fs::file_type::unknown;
}

// Writes ranges to a new file at path and fsyncs it; on failure removes it and rethrows.
void write_new_file(Env& env, const std::string& path, std::span<const ByteRange> ranges) {
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
  const ByteRange range{data, bytes};
  write_new_file(Env::get(), path, std::span<const ByteRange>(&range, 1));
}

void write_file_atomic(const std::string& path, std::initializer_list<ByteRange> ranges) {
  write_file_atomic(path, std::span<const ByteRange>(ranges.begin(), ranges.size()));
}

void write_file_atomic(const std::string& path, std::span<const ByteRange> ranges) {
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

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

std::string file_kind(fs::file_type type) {
  switch (type) {
    case fs::file_type::regular: return "";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::symlink: return "a symbolic link";
    case fs::file_type::not_found: return "nothing";
    default: return "a special file";
  }
}

std::string not_regular_file_message(const std::string& what, const std::string& path, fs::file_type type) {
  return what + " " + path + ": not a regular file (" + file_kind(type) + ")";
}

namespace {

// Opens path with `flags` (plus O_NONBLOCK, cleared before returning) if it is a regular file, or
// creates one when `flags` say so; anything else is refused in one line, before opening it when it
// can be (opening a device may act on it: a tape rewinds) and on the open descriptor in any case.
FileDescriptor open_checked(const std::string& path, int flags, const std::string& what, uint64_t* bytes) {
  struct stat st = {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    throw Error(not_regular_file_message(what, path, type_of(st.st_mode)));
  }
  // O_NONBLOCK: a FIFO put here after the stat is opened without waiting for the other end.
  FileDescriptor fd(::open(path.c_str(), flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    const std::string why = std::strerror(errno);
    // (A socket, or a FIFO opened for writing, cannot be opened at all: it is named as what it is.)
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      throw Error(not_regular_file_message(what, path, type_of(st.st_mode)));
    }
    throw Error(what + " " + path + ": cannot " + ((flags & O_CREAT) != 0 ? "create" : "open") + " (" + why + ")");
  }
  if (::fstat(fd.get(), &st) != 0) throw Error(what + " " + path + ": cannot stat (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) throw Error(not_regular_file_message(what, path, type_of(st.st_mode)));
  const int now = ::fcntl(fd.get(), F_GETFL);
  if (now < 0 || ::fcntl(fd.get(), F_SETFL, now & ~O_NONBLOCK) != 0) {
    throw Error(what + " " + path + ": cannot clear O_NONBLOCK (" + std::strerror(errno) + ")");
  }
  if (bytes != nullptr) *bytes = static_cast<uint64_t>(st.st_size);
  return fd;
}

}  // namespace

FileDescriptor open_regular_file(const std::string& path, const std::string& what, uint64_t* bytes) {
  return open_checked(path, O_RDONLY, what, bytes);
}

FileDescriptor create_regular_file(const std::string& path, const std::string& what) {
  return open_checked(path, O_WRONLY | O_CREAT | O_TRUNC, what, nullptr);
}

FileStream open_regular_stream(const std::string& path, const std::string& what, uint64_t* bytes) {
  FileDescriptor fd = open_regular_file(path, what, bytes);
  FILE* f = ::fdopen(fd.get(), "rb");
  if (f == nullptr) throw Error(what + " " + path + ": cannot open (" + std::strerror(errno) + ")");
  fd.release();  // the stream owns it now
  return FileStream(f, &std::fclose);
}

std::vector<char> read_file(const std::string& path) { return Env::get().read(path); }

std::string read_text_file(const std::string& path) {
  std::vector<char> bytes = read_file(path);
  return std::string(bytes.begin(), bytes.end());
}

void sync_directory(const std::string& path) { Env::get().sync_dir(path); }

}  // namespace keel
