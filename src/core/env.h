// Every file operation of Keel's own formats (checkpoints, shards, tokenizers, exports) goes
// through an Env, LevelDB's idea: one seam where tests make a write fail, the disk fill up, or
// the process die at a chosen operation, without touching the code under test.
//
// Env::get() is the POSIX environment unless KEEL_FAULT is set, in which case a FaultEnv over
// POSIX carries out the plan it describes (see FaultPlan::parse). Every failure is a keel::Error
// naming the file.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace keel {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual void append(const void* data, size_t bytes) = 0;
  virtual void sync() = 0;   // data reaches the device (fsync)
  virtual void close() = 0;  // the destructor closes silently when this was not called
};

class Env {
 public:
  virtual ~Env() = default;
  // The process's environment (POSIX, or the fault plan of KEEL_FAULT).
  static Env& get();
  static Env& posix();
  // Replaces the process's environment (tests); nullptr restores the default. Not thread-safe
  // with respect to concurrent file operations.
  static void set(Env* env);

  // Creates or truncates a file for writing.
  virtual std::unique_ptr<WritableFile> create(const std::string& path) = 0;
  virtual std::vector<char> read(const std::string& path) = 0;
  // Exactly `bytes` bytes from `offset`; a short file is an error naming it.
  virtual std::vector<char> read_range(const std::string& path, uint64_t offset, size_t bytes) = 0;
  virtual bool exists(const std::string& path) = 0;
  virtual uint64_t file_size(const std::string& path) = 0;
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // Removes a file or a directory tree; nothing to remove is not an error.
  virtual void remove(const std::string& path) = 0;
  virtual void create_dirs(const std::string& path) = 0;
  // fsyncs a directory so that creations and renames in it are durable.
  virtual void sync_dir(const std::string& path) = 0;
  // Names of the entries of a directory, sorted; empty if it does not exist.
  virtual std::vector<std::string> list_dir(const std::string& path) = 0;
};

// What a FaultEnv does, and when. Operations are counted in order over the whole process (all
// threads): create, append, sync, close, rename, remove, create_dirs, sync_dir, restricted to
// paths containing `path_contains`. Reads are not counted.
struct FaultPlan {
  enum class Action { none, fail, disk_full, kill };
  Action action = Action::none;
  int64_t at_op = 0;            // fail / kill: the 1-based operation that triggers
  uint64_t capacity = 0;        // disk_full: bytes that can still be appended
  std::string path_contains;    // only operations on matching paths count
  int rank = -1;                // only this MPI rank (OMPI_COMM_WORLD_RANK / PMI_RANK); -1 = any
  std::string once;             // kill: a marker file created before dying; when it exists the plan is spent

  // Parses KEEL_FAULT's syntax: ACTION[:key=value]... with ACTION fail|full|kill and keys op, bytes,
  // path, rank, once. Examples: "kill:op=7:path=ckpt:rank=1:once=/tmp/x", "fail:op=3",
  // "full:bytes=100000:path=ckpt". Throws keel::Error naming KEEL_FAULT on bad syntax.
  static FaultPlan parse(const std::string& text);
};

class FaultEnv final : public Env {
 public:
  FaultEnv(Env& base, FaultPlan plan);
  int64_t ops() const { return ops_.load(); }
  // Called before each counted operation: applies the plan. Public for the file wrapper.
  void before(const char* op, const std::string& path, uint64_t bytes = 0);

  std::unique_ptr<WritableFile> create(const std::string& path) override;
  std::vector<char> read(const std::string& path) override { return base_.read(path); }
  std::vector<char> read_range(const std::string& path, uint64_t offset, size_t bytes) override {
    return base_.read_range(path, offset, bytes);
  }
  bool exists(const std::string& path) override { return base_.exists(path); }
  uint64_t file_size(const std::string& path) override { return base_.file_size(path); }
  void rename(const std::string& from, const std::string& to) override;
  void remove(const std::string& path) override;
  void create_dirs(const std::string& path) override;
  void sync_dir(const std::string& path) override;
  std::vector<std::string> list_dir(const std::string& path) override { return base_.list_dir(path); }

 private:
  Env& base_;
  FaultPlan plan_;
  bool armed_ = true;
  std::atomic<int64_t> ops_{0};
  std::atomic<uint64_t> appended_{0};
};

}  // namespace keel
