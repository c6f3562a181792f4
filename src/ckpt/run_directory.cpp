#include "ckpt/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockFile = kRunLockFile;

// A path as the filesystem resolves it (links followed as far as it exists).
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path), ec);
  return ec ? fs::absolute(path).lexically_normal() : p;
}

bool is_run_directory(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / kRunLockFile, ec) || fs::exists(dir / kRunIdFile, ec);
}

// The nearest directory above `p` (not p itself) that is a run directory ("" = none).
fs::path enclosing_run_directory(const fs::path& p) {
  for (fs::path dir = p.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    if (is_run_directory(dir)) return dir;
    if (dir == dir.parent_path()) break;
  }
  return {};
}

std::string new_run_id() {
  std::random_device entropy;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  return hex64(id);
}

bool is_run_id(const std::string& id) {
  return id.size() == 16 && std::all_of(id.begin(), id.end(), [](char c) { return std::isdigit(c) || (c >= 'a' && c <= 'f'); });
}

// The run id a checkpoint's manifest names ("" = none, or unreadable).
std::string writer_of(const std::string& checkpoint) {
  try {
    return read_manifest(checkpoint).run_id;
  } catch (const Error&) {
    return "";
  }
}

// What a run directory holds of a run: complete checkpoints (newest first; a format-1 root last)
// and a non-empty metrics.jsonl.
struct HeldRun {
  std::vector<std::string> checkpoints;
  bool metrics = false;
};

HeldRun held_run(const std::string& dir) {
  HeldRun held;
  const std::string root = dir + "/ckpt";
  if (fs::is_directory(root)) held.checkpoints = list_checkpoints(root);
  if (fs::exists(root + "/manifest.json")) held.checkpoints.push_back(root);
  const std::string metrics = dir + "/metrics.jsonl";
  std::error_code ec;
  held.metrics = fs::is_regular_file(metrics) && fs::file_size(metrics, ec) > 0 && !ec;
  return held;
}

std::string describe_checkpoints(const HeldRun& held) {
  return std::to_string(held.checkpoints.size()) + " checkpoint(s), newest " +
         fs::path(held.checkpoints.front()).filename().string();
}

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
  const HeldRun held = held_run(dir);
  const std::vector<std::string>& ckpts = held.checkpoints;
  const bool has_metrics = held.metrics;
  if (ckpts.empty() && !has_metrics) return "";
  // Metrics of the same trajectory with no checkpoint are a run that never got far enough to
  // save one: starting it again loses nothing that could be resumed.
  const bool same = same_trajectory(dir, config, world_size);
  if (same && (ckpts.empty() || !explicit_fresh)) return "";
  std::string found;
  if (!ckpts.empty()) found = describe_checkpoints(held);
  if (has_metrics) found += std::string(found.empty() ? "" : " and ") + (same ? "its metrics.jsonl" : "metrics.jsonl of another run");
  return found;
}

}  // namespace

std::string read_run_id(const std::string& run_dir) {
  const std::string file = run_dir + "/" + kRunIdFile;
  if (!fs::exists(fs::symlink_status(file))) return "";
  std::string id;
  try {
    id = nlohmann::json::parse(read_text_file(file)).at("run_id").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(file + ": expected {\"run_id\": \"<16 hex digits>\"} (" + e.what() + ")");
  }
  check(is_run_id(id), file + ": run_id: expected 16 lower-case hex digits, found '" + id + "'");
  return id;
}

void check_output_path(const std::string& what, const std::string& path) {
  const fs::path out = resolved(path);
  for (fs::path dir = out.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    std::error_code ec;
    const fs::path manifest = dir / "manifest.json";
    if (fs::is_regular_file(manifest, ec)) {
      std::ifstream in(manifest);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      check(text.find("\"keel-checkpoint\"") == std::string::npos,
            what + " " + path + ": inside checkpoint directory " + dir.string() + ": not written there");
    }
    if (is_run_directory(dir)) {
      const std::string first = out.lexically_relative(dir).begin()->string();
      for (const char* own : kRunOwnFiles) {
        check(first != own, what + " " + path + ": " + (first == out.filename().string() ? "is" : "lies under") +
                                " run directory " + dir.string() + "'s own " + own + ": not replaced; choose another path");
      }
    }
    if (dir == dir.parent_path()) break;
  }
}

RunDirectory::RunDirectory(const Config& config, Communicator& world)
    : config_(config), world_(world), path_(config.train.run_dir) {
  int64_t outcome = 0;  // 0: locked; > 0: held by that pid; -1: refused or could not lock
  std::string why, id;
  if (world_.is_root()) {
    const fs::path where = resolved(path_);
    const fs::path outer = enclosing_run_directory(where);
    if (where == where.root_path()) {
      why = "the filesystem root: a run writes its lock, checkpoints and metrics there; choose a directory of its own";
      outcome = -1;
    } else if (!outer.empty()) {
      why = "inside the run directory " + outer.string() + " (it holds " +
            (fs::exists(outer / kRunLockFile) ? kRunLockFile : kRunIdFile) +
            "): a run's directory must not lie in another's; choose one outside it";
      outcome = -1;
    }
  }
  if (world_.is_root() && outcome == 0) {
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
        id = read_run_id(path_);
        // A directory without an id file (written before runs had ids, or the file lost): the id
        // its checkpoints all name, if they name one.
        if (id.empty()) {
          for (const std::string& c : held_run(path_).checkpoints) {
            const std::string writer = writer_of(c);
            if (writer.empty()) continue;
            if (!id.empty() && writer != id) {
              id.clear();
              break;
            }
            id = writer;
          }
        }
      }
    } catch (const fs::filesystem_error& e) {
      why = std::string("cannot create it (") + e.code().message() + ")";
      outcome = -1;
    } catch (const Error& e) {
      why = e.what();
      outcome = -1;
    }
  }
  outcome = world_.broadcast(outcome);
  if (outcome == 0) {
    share_run_id(id);
    return;
  }
  if (fd_ >= 0) {
    ::close(fd_);  // (no destructor runs for an object whose constructor throws)
    fd_ = -1;
  }
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
  if ((!explicit_fresh && !config_.train.resume_auto()) || restarted) return;
  int64_t outcome = 0;  // 0: nothing in the way; 1: refused; 2: the earlier run moved aside
  std::string why;
  if (world_.is_root()) {
    const std::string found = earlier_run(path_, config_, world_.size(), explicit_fresh);
    if (!found.empty() && !config_.train.overwrite) {
      outcome = 1;
      why = "holds an earlier run (" + found + "): continue it with --set train.resume=auto, choose a new " +
            "train.run_dir, or --set train.overwrite=true to move it aside";
    } else if (!found.empty()) {
      why = move_aside(found);
      outcome = why.empty() ? 2 : 1;
    }
  }
  outcome = world_.broadcast(outcome);
  if (outcome == 2) run_id_.clear();  // the directory's run is elsewhere now: this is a new one
  if (outcome != 1) return;
  throw Error("train.run_dir " + path_ + ": " + (why.empty() ? std::string("holds an earlier run (see rank 0)") : why));
}

void RunDirectory::check_resume_from(const std::string& resume, const std::string& checkpoint) {
  int64_t outcome = 0;  // as in check_fresh_start
  std::string why;
  if (world_.is_root()) {
    const HeldRun held = held_run(path_);
    const std::string& foreign = checkpoint;
    if ((!held.checkpoints.empty() || held.metrics) && !is_own(checkpoint)) {
      const std::string found = (held.checkpoints.empty() ? std::string() : describe_checkpoints(held)) +
                                (held.metrics ? std::string(held.checkpoints.empty() ? "" : " and ") + "metrics.jsonl" : "");
      const std::string writer = writer_of(foreign);
      const std::string theirs = (foreign == resume ? "" : foreign + ", ") +
                                 (writer.empty() ? "it names no run and lies outside " + path_ + "/ckpt" : "run " + writer);
      if (!config_.train.overwrite) {
        outcome = 1;
        why = "holds " + (run_id_.empty() ? "a run" : "run " + run_id_) + " (" + found + "); train.resume=" + resume +
              " is another run's checkpoint (" + theirs + "): resuming it here would mix the two runs; choose a new " +
              "train.run_dir, or --set train.overwrite=true to move the earlier run aside";
      } else {
        why = move_aside((run_id_.empty() ? "" : "run " + run_id_ + ", ") + found);
        outcome = why.empty() ? 2 : 1;
      }
    }
  }
  outcome = world_.broadcast(outcome);
  if (outcome == 2) run_id_.clear();
  if (outcome != 1) return;
  // (Every rank says what was refused: mpirun may end rank 0 before it has printed its line.)
  throw Error("train.run_dir " + path_ + ": " +
              (why.empty() ? "holds a run that train.resume=" + resume + " is not of (see rank 0)" : why));
}

bool RunDirectory::is_own(const std::string& dir) const {
  const std::string writer = writer_of(dir);
  if (!writer.empty() && !run_id_.empty()) return writer == run_id_;
  // A checkpoint that names no run (or a directory whose run has no id yet): its place decides.
  const fs::path root = resolved(path_ + "/ckpt"), at = resolved(dir);
  return at == root || at.parent_path() == root;
}

std::string RunDirectory::move_aside(const std::string& found) {
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
  } catch (const fs::filesystem_error& e) {
    return "train.overwrite: cannot move the earlier run aside to " + aside + " (" + e.code().message() + ")";
  }
  std::printf("keel: train.overwrite: the earlier run in %s (%s) moved to %s\n", path_.c_str(), found.c_str(),
              aside.c_str());
  std::fflush(stdout);
  return "";
}

void RunDirectory::settle_run_id() {
  std::string id = run_id_, why;
  if (world_.is_root()) {
    try {
      if (id.empty()) id = new_run_id();
      if (read_run_id(path_) != id) {
        const std::string text = nlohmann::json{{"run_id", id}}.dump() + "\n";
        write_file_atomic(path_ + "/" + kRunIdFile, {ByteRange{text.data(), text.size()}});
      }
    } catch (const Error& e) {
      why = e.what();
      id.clear();
    }
  }
  share_run_id(id);
  check(!run_id_.empty(), "train.run_dir " + path_ + ": cannot record the run's id (" + (why.empty() ? "see rank 0" : why) + ")");
}

std::string RunDirectory::foreign_writer(const std::string& checkpoint) const {
  uint64_t writer = 0;
  if (world_.is_root() && !run_id_.empty()) {
    const std::string w = writer_of(checkpoint);
    if (is_run_id(w) && w != run_id_) writer = std::stoull(w, nullptr, 16);
  }
  writer = static_cast<uint64_t>(world_.broadcast(static_cast<int64_t>(writer)));
  return writer == 0 ? "" : hex64(writer);
}

void RunDirectory::share_run_id(const std::string& id) {
  const uint64_t mine = id.empty() ? 0 : std::stoull(id, nullptr, 16);
  const uint64_t shared = static_cast<uint64_t>(world_.broadcast(static_cast<int64_t>(mine)));
  run_id_ = shared == 0 ? "" : hex64(shared);
}

}  // namespace keel
