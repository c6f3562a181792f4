// A run's directory (train.run_dir) as a component: one run at a time, and a fresh run never
// destroys an earlier run's work.
//
// Rank 0 holds an exclusive flock on run_dir/.keel.lock for the life of the run (the kernel
// releases it when the process dies, so a killed run never leaves it stuck), with its pid and host
// written in the file; a second trainer on the same directory, of another job or of the same one,
// is refused on every rank in one line naming the holder. A fresh start (nothing resumed) in a
// directory holding checkpoints, or metrics of another trajectory, is refused unless
// train.overwrite = true, which moves the earlier run aside to run_dir.old-N (never deletes it).
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/config.h"

namespace keel {

class RunDirectory {
 public:
  // Creates the directory and takes its lock (rank 0); every rank learns the outcome. Throws
  // keel::Error on every rank when another process holds it.
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

  const std::string& path() const { return path_; }

 private:
  const Config& config_;
  Communicator& world_;
  std::string path_;
  int fd_ = -1;  // rank 0: the lock file, locked
};

}  // namespace keel
