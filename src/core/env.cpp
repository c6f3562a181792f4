#include "core/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

std::string os_error() { return std::strerror(errno); }

class PosixFile final : public WritableFile {
 public:
  PosixFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const void* data, size_t bytes) override {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        throw Error("file " + path_ + ": write failed after " + std::to_string(written_) + " bytes (" + os_error() + ")");
      }
      p += n;
      bytes -= static_cast<size_t>(n);
      written_ += static_cast<uint64_t>(n);
    }
  }
  // (Each call's result is taken before its message is built: the order in which a function's
  // arguments are evaluated is unspecified, and errno must be the failed call's.)
  void sync() override {
    const bool ok = ::fsync(fd_) == 0;
    check(ok, "file " + path_ + ": fsync failed (" + os_error() + ")");
  }
  void close() override {
    const int fd = fd_;
    fd_ = -1;
    const bool ok = ::close(fd) == 0;
    check(ok, "file " + path_ + ": close failed (" + os_error() + ")");
  }

 private:
  std::string path_;
  int fd_;
  uint64_t written_ = 0;
};

class PosixEnv final : public Env {
 public:
  std::unique_ptr<WritableFile> create(const std::string& path) override {
    return std::make_unique<PosixFile>(path, create_regular_file(path).release());
  }

  std::vector<char> read(const std::string& path) override {
    uint64_t size = 0;
    const FileDescriptor file = open_regular_file(path, "file", &size);
    const int fd = file.get();
    std::vector<char> out;
    out.reserve(static_cast<size_t>(size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error("file " + path + ": read failed (" + os_error() + ")");
      if (n == 0) break;
      out.insert(out.end(), buf, buf + n);
    }
    return out;
  }

  std::vector<char> read_range(const std::string& path, uint64_t offset, size_t bytes) override {
    uint64_t size = 0;
    const FileDescriptor file = open_regular_file(path, "file", &size);
    const int fd = file.get();
    // A range past the end is refused before anything is allocated for it (a damaged manifest
    // may claim any size).
    if (offset > size || bytes > size - offset) {
      throw Error("file " + path + ": cannot read " + std::to_string(bytes) + " bytes at offset " +
                  std::to_string(offset) + " (the file ends at " + std::to_string(size) + ")");
    }
    std::vector<char> out(bytes);
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = ::pread(fd, out.data() + got, bytes - got, static_cast<off_t>(offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string why = n < 0 ? os_error() : "the file ends";
        throw Error("file " + path + ": cannot read " + std::to_string(bytes) + " bytes at offset " +
                    std::to_string(offset) + " (" + why + " after " + std::to_string(got) + ")");
      }
      got += static_cast<size_t>(n);
    }
    return out;
  }

  bool exists(const std::string& path) override {
    struct stat st = {};
    return ::stat(path.c_str(), &st) == 0;
  }

  uint64_t file_size(const std::string& path) override {
    struct stat st = {};
    const bool ok = ::stat(path.c_str(), &st) == 0;
    check(ok, "file " + path + ": cannot stat (" + os_error() + ")");
    return static_cast<uint64_t>(st.st_size);
  }

  void rename(const std::string& from, const std::string& to) override {
    const bool ok = ::rename(from.c_str(), to.c_str()) == 0;
    check(ok, "file " + to + ": cannot rename " + from + " into place (" + os_error() + ")");
  }

  void remove(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    check(!ec, "file " + path + ": cannot remove (" + ec.message() + ")");
  }

  void create_dirs(const std::string& path) override {
    std::error_code ec;
    fs::create_directories(path, ec);
    check(!ec, "directory " + path + ": cannot create (" + ec.message() + ")");
  }

  void sync_dir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    check(fd >= 0, "directory " + path + ": cannot open (" + os_error() + ")");
    const int rc = ::fsync(fd);
    const std::string why = os_error();
    ::close(fd);
    check(rc == 0, "directory " + path + ": fsync failed (" + why + ")");
  }

  std::vector<std::string> list_dir(const std::string& path) override {
    std::vector<std::string> names;
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return names;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  }
};

class FaultFile final : public WritableFile {
 public:
  FaultFile(FaultEnv& env, std::string path, std::unique_ptr<WritableFile> base)
      : env_(env), path_(std::move(path)), base_(std::move(base)) {}
  void append(const void* data, size_t bytes) override {
    env_.before("append", path_, bytes);
    base_->append(data, bytes);
  }
  void sync() override {
    env_.before("sync", path_);
    base_->sync();
  }
  void close() override {
    env_.before("close", path_);
    base_->close();
  }

 private:
  FaultEnv& env_;
  std::string path_;
  std::unique_ptr<WritableFile> base_;
};

std::mutex g_env_mutex;
Env* g_env = nullptr;

Env& default_env() {
  static Env& env = []() -> Env& {
    const char* spec = std::getenv("KEEL_FAULT");
    if (spec == nullptr || *spec == '\0') return Env::posix();
    static FaultEnv fault(Env::posix(), FaultPlan::parse(spec));
    return fault;
  }();
  return env;
}

int this_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return 0;
}

}  // namespace

Env& Env::posix() {
  static PosixEnv env;
  return env;
}

Env& Env::get() {
  std::lock_guard<std::mutex> lock(g_env_mutex);
  return g_env != nullptr ? *g_env : default_env();
}

void Env::set(Env* env) {
  std::lock_guard<std::mutex> lock(g_env_mutex);
  g_env = env;
}

FaultPlan FaultPlan::parse(const std::string& text) {
  auto bad = [&](const std::string& why) { return Error("KEEL_FAULT='" + text + "': " + why); };
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  FaultPlan plan;
  if (parts[0] == "fail") {
    plan.action = Action::fail;
  } else if (parts[0] == "full") {
    plan.action = Action::disk_full;
  } else if (parts[0] == "kill") {
    plan.action = Action::kill;
  } else {
    throw bad("expected fail, full or kill, found '" + parts[0] + "'");
  }
  auto number = [&](const std::string& key, const std::string& v) {
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < 0) throw bad(key + ": expected a number >= 0, found '" + v + "'");
    return n;
  };
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    if (eq == std::string::npos) throw bad("expected key=value, found '" + parts[i] + "'");
    const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
    if (key == "op") {
      plan.at_op = number(key, value);
    } else if (key == "bytes") {
      plan.capacity = static_cast<uint64_t>(number(key, value));
    } else if (key == "path") {
      plan.path_contains = value;
    } else if (key == "rank") {
      plan.rank = static_cast<int>(number(key, value));
    } else if (key == "once") {
      plan.once = value;
    } else {
      throw bad("unknown key '" + key + "' (expected op, bytes, path, rank or once)");
    }
  }
  if (plan.action != Action::disk_full && plan.at_op < 1) throw bad("needs op=N with N >= 1");
  return plan;
}

FaultEnv::FaultEnv(Env& base, FaultPlan plan) : base_(base), plan_(std::move(plan)) {
  armed_ = plan_.rank < 0 || plan_.rank == this_rank();
  if (!plan_.once.empty() && base_.exists(plan_.once)) armed_ = false;
}

void FaultEnv::before(const char* op, const std::string& path, uint64_t bytes) {
  if (!armed_ || path.find(plan_.path_contains) == std::string::npos) return;
  const int64_t n = ++ops_;
  switch (plan_.action) {
    case FaultPlan::Action::none:
      return;
    case FaultPlan::Action::fail:
      if (n == plan_.at_op) throw Error("file " + path + ": " + op + " failed (injected I/O error)");
      return;
    case FaultPlan::Action::disk_full:
      if (bytes > 0 && (appended_ += bytes) > plan_.capacity) {
        throw Error("file " + path + ": write failed (" + std::strerror(ENOSPC) + ")");
      }
      return;
    case FaultPlan::Action::kill:
      if (n == plan_.at_op) {
        if (!plan_.once.empty()) {
          const int fd = ::open(plan_.once.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
          if (fd >= 0) {
            ::fsync(fd);
            ::close(fd);
          }
        }
        ::raise(SIGKILL);
      }
      return;
  }
}

std::unique_ptr<WritableFile> FaultEnv::create(const std::string& path) {
  before("create", path);
  return std::make_unique<FaultFile>(*this, path, base_.create(path));
}

void FaultEnv::rename(const std::string& from, const std::string& to) {
  before("rename", to);
  base_.rename(from, to);
}

void FaultEnv::remove(const std::string& path) {
  before("remove", path);
  base_.remove(path);
}

void FaultEnv::create_dirs(const std::string& path) {
  before("create_dirs", path);
  base_.create_dirs(path);
}

void FaultEnv::sync_dir(const std::string& path) {
  before("sync_dir", path);
  base_.sync_dir(path);
}

}  // namespace keel
