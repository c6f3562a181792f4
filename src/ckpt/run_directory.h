// A run's directory (train.run_dir) as a component: one run at a time, and a fresh run never
// destroys an earlier run's work.
//
// Rank 0 holds an exclusive flock on run_dir/.keel.lock for the life of the run (the kernel
// releases it when the process dies, so a killed run never leaves it stuck), with its pid and host
// written in the file; a second trainer on the same directory, of another job or of the same one,
// is refused on every rank in one line naming the holder. A fresh start (nothing resumed) in a
// directory holding checkpoints, or metrics of another trajectory, is refused unless
// train.overwrite = true, which moves the earlier run aside to run_dir.old-N (never deletes it).
//
// A run has an identity, apart from its trajectory (two runs of one config are still two runs): a
// random id given at its first start, kept in run_dir/keel-run.json, recorded in every manifest it
// writes and marked in every checkpoint directory before its data. Resuming another run's
// checkpoint into a directory that holds a run (checkpoints or metrics) is refused, or with
// train.overwrite moves that run aside; retention and the start-up cleanup delete only the run's
// own. The directory is never the filesystem root nor inside another run's directory, and no
// keel command's output replaces a file of a run's own (check_output_path).
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"

namespace keel {

// What a run keeps in its directory (the lock, its id, what the trainer writes, the checkpoint
// root): no output of a keel command may replace one of them or anything under them.
inline constexpr const char* kRunLockFile = ".keel.lock";
inline constexpr const char* kRunIdFile = "keel-run.json";
inline constexpr const char* kRunOwnFiles[] = {kRunLockFile, kRunIdFile, "config.toml", "metrics.jsonl",
                                               "pipeline_trace.json", "ckpt"};

// The id in run_dir/keel-run.json: 16 hex digits, or "" when there is no such file. Throws
// keel::Error naming the file when it is there but not such an id.
std::string read_run_id(const std::string& run_dir);

// Refuses, with a keel::Error naming `what` (e.g. "report --out") and `path` in one line, an
// output path of a keel command (a file, or a directory it writes into) that is one of a run
// directory's own files (kRunOwnFiles) or lies under one, or lies inside a checkpoint directory.
// A run directory is one holding the lock file or the id file.
void check_output_path(const std::string& what, const std::string& path);

class RunDirectory {
 public:
  // Creates the directory and takes its lock (rank 0); every rank learns the outcome and the run's
  // id. Throws keel::Error on every rank when another process holds it, when it is the filesystem
  // root, or when it lies inside another run's directory.
  RunDirectory(const Config& config, Communicator& world);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  // Called once the run knows it starts from step 0 with nothing resumed. `restarted`: a job
  // restarted by `keel launch --max-restarts` (its earlier attempts are this run). Throws on every
  // rank when the directory holds an earlier run that this start would overwrite (train.resume =
  // "": any checkpoint or another trajectory's metrics; "auto" with nothing usable: another
  // trajectory's checkpoints or metrics); with train.overwrite moves that run aside (rank 0) and
  // says where.
  void check_fresh_start(bool restarted);

  // An explicit train.resume (`resume`; not "auto", not a restarted job) that loaded `checkpoint`,
  // before anything is written: when the directory holds a run (checkpoints or metrics) and the
  // checkpoint is not of that run (its manifest names another run, or none while it lies outside
  // the directory's ckpt/), throws on every rank in one line naming both; with train.overwrite
  // moves that run aside instead (rank 0) and says where.
  void check_resume_from(const std::string& resume, const std::string& checkpoint);

  // Every rank: for a checkpoint that `train.resume = "auto"` or a restarted job found under this
  // directory's ckpt/, the run that wrote it when that is not this directory's run (its manifest
  // names another run id), else "" (this run's, or one that names no run). Such a copy is never
  // resumed automatically: another run's checkpoint continues only when named in train.resume.
  std::string foreign_writer(const std::string& checkpoint) const;

  // Once resume has decided: a run without an id (a new directory, or one whose run was moved
  // aside) gets a new one, recorded in keel-run.json (rank 0); every rank learns it. Throws on
  // every rank when it cannot be recorded.
  void settle_run_id();

  // The run's id (16 hex digits, the same on every rank): keel-run.json's, or for a directory
  // without one the id its checkpoints all name; "" until settle_run_id() when neither.
  const std::string& run_id() const { return run_id_; }
  const std::string& path() const { return path_; }

 private:
  // Rank 0: whether checkpoint directory `dir` is of this run (see check_resume_from).
  bool is_own(const std::string& dir) const;
  // Rank 0: moves everything but the lock to run_dir.old-N and says so; `found` describes it.
  // Returns why it could not ("" = moved).
  std::string move_aside(const std::string& found);
  // Every rank takes rank 0's id (`id` there).
  void share_run_id(const std::string& id);

  const Config& config_;
  Communicator& world_;
  std::string path_;
  std::string run_id_;
  int fd_ = -1;  // rank 0: the lock file, locked
};

}  // namespace keel
