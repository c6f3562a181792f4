#include "ckpt/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockFile = ".keel.lock";

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

// What the lock file says about its holder: "pid host".
std::string holder_of(int fd, int64_t* pid) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::istringstream in(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0));
  long long p = 0;
  std::string host;
  in >> p >> host;
  *pid = p > 0 ? p : 1;
  return p > 0 ? "pid " + std::to_string(p) + (host.empty() ? "" : " on " + host) : "another process";
}

// Whether run_dir/config.toml (written by the earlier run at its start) is of this trajectory.
bool same_trajectory(const std::string& dir, const Config& config, int world_size) {
  try {
    Config earlier = Config::parse(read_text_file(dir + "/config.toml"), dir + "/config.toml");
    earlier.resolve(world_size);
    return earlier.trajectory_hash(world_size) == config.trajectory_hash(world_size);
  } catch (const std::exception&) {
    return false;
  }
}

// What an earlier run left in `dir` that this start from step 0 would overwrite ("" = nothing).
// `explicit_fresh` (train.resume = ""): any checkpoint counts. Otherwise (resume = "auto" found
// nothing usable) only another trajectory's work does: this run's own unusable checkpoints are
// what "auto" starts over from.
std::string earlier_run(const std::string& dir, const Config& config, int world_size, bool explicit_fresh) {
  const std::string root = dir + "/ckpt";
  std::vector<std::string> ckpts = fs::is_directory(root) ? list_checkpoints(root) : std::vector<std::string>{};
  if (fs::exists(root + "/manifest.json")) ckpts.push_back(root);
  const std::string metrics = dir + "/metrics.jsonl";
  std::error_code ec;
  const bool has_metrics = fs::is_regular_file(metrics) && fs::file_size(metrics, ec) > 0 && !ec;
  if (ckpts.empty() && !has_metrics) return "";
  // Metrics of the same trajectory with no checkpoint are a run that never got far enough to
  // save one: starting it again loses nothing that could be resumed.
  const bool same = same_trajectory(dir, config, world_size);
  if (same && (ckpts.empty() || !explicit_fresh)) return "";
  std::string found;
  if (!ckpts.empty()) {
    found = std::to_string(ckpts.size()) + " checkpoint(s), newest " + fs::path(ckpts.front()).filename().string();
  }
  if (has_metrics) found += std::string(found.empty() ? "" : " and ") + (same ? "its metrics.jsonl" : "metrics.jsonl of another run");
  return found;
}

}  // namespace

RunDirectory::RunDirectory(const Config& config, Communicator& world)
    : config_(config), world_(world), path_(config.train.run_dir) {
  int64_t outcome = 0;  // 0: locked; > 0: held by that pid; -1: could not lock
  std::string why;
  if (world_.is_root()) {
    try {
      fs::create_directories(path_);
      const std::string file = path_ + "/" + kLockFile;
      fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd_ < 0) {
        why = "cannot open " + file + " (" + std::strerror(errno) + ")";
        outcome = -1;
      } else if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        if (err == EWOULDBLOCK) {
          why = "in use by another keel run (" + holder_of(fd_, &outcome) +
                "); wait for it to end or choose another train.run_dir";
        } else {
          why = "cannot lock " + file + " (" + std::strerror(err) + ")";
          outcome = -1;
        }
        ::close(fd_);
        fd_ = -1;
      } else {
        const std::string me = std::to_string(::getpid()) + " " + host_name() + "\n";
        if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
          // The lock holds regardless; only the note of who holds it is missing.
          std::fprintf(stderr, "keel: train.run_dir %s: cannot write the holder into %s (%s)\n", path_.c_str(),
                       file.c_str(), std::strerror(errno));
        }
      }
    } catch (const fs::filesystem_error& e) {
      why = std::string("cannot create it (") + e.code().message() + ")";
      outcome = -1;
    }
  }
  outcome = world_.broadcast(outcome);
  if (outcome == 0) return;
  if (why.empty()) {
    why = outcome > 0 ? "in use by another keel run (pid " + std::to_string(outcome) + ")" : "cannot be locked (see rank 0)";
  }
  throw Error("train.run_dir " + path_ + ": " + why);
}

RunDirectory::~RunDirectory() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the lock
}

void RunDirectory::check_fresh_start(bool restarted) {
  // An explicit resume that found nothing has thrown already; a restarted job is this run.
  const bool explicit_fresh = config_.train.resume.empty();
  if ((!explicit_fresh && config_.train.resume != "auto") || restarted) return;
  int64_t refused = 0;
  std::string why;
  if (world_.is_root()) {
    const std::string found = earlier_run(path_, config_, world_.size(), explicit_fresh);
    if (!found.empty() && !config_.train.overwrite) {
      refused = 1;
      why = "holds an earlier run (" + found + "): continue it with --set train.resume=auto, choose a new " +
            "train.run_dir, or --set train.overwrite=true to move it aside";
    } else if (!found.empty()) {
      int n = 1;
      while (fs::exists(path_ + ".old-" + std::to_string(n))) n++;
      const std::string aside = path_ + ".old-" + std::to_string(n);
      try {
        fs::create_directories(aside);
        std::vector<fs::path> entries;
        for (const fs::directory_entry& e : fs::directory_iterator(path_)) {
          if (e.path().filename() != kLockFile) entries.push_back(e.path());
        }
        for (const fs::path& e : entries) fs::rename(e, fs::path(aside) / e.filename());
        std::printf("keel: train.overwrite: the earlier run in %s (%s) moved to %s\n", path_.c_str(), found.c_str(),
                    aside.c_str());
        std::fflush(stdout);
      } catch (const fs::filesystem_error& e) {
        refused = 1;
        why = "train.overwrite: cannot move the earlier run aside to " + aside + " (" + e.code().message() + ")";
      }
    }
  }
  if (world_.broadcast(refused) == 0) return;
  throw Error("train.run_dir " + path_ + ": " + (why.empty() ? std::string("holds an earlier run (see rank 0)") : why));
}

}  // namespace keel
