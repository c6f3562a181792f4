// In-memory checkpoints (checkpoint.memory_every): a job that loses a rank resumes from host
// memory in seconds instead of from disk.
//
// Every memory_every steps each rank writes the state a disk checkpoint would hold for it (the
// parameter and AdamW moment planes of the chunks it holds, every chunk's version, its data
// position and compression residuals, the step) to a file in /dev/shm, which outlives the
// process: /dev/shm/keel-<hash of the canonical run_dir>/r<rank>-step-<step>.bin. It then sends
// the same bytes over MPI to its buddy, rank (r + 1) mod world, which keeps them as
// buddy-r<rank>-step-<step>.bin: when a rank's own copy is gone (its host died, or the file was
// lost) the buddy's copy restores it. On one host both copies share /dev/shm; they are still two
// files, found, verified and used separately.
//
// A copy is written under a temporary name and renamed into place, so a kill during a write never
// leaves a torn copy under a valid name. Its last bytes are a footer (JSON: job, rank, world,
// step, trajectory and layout hashes, data position, versions, and where every section lies with
// the XXH3 checksum of its bytes), the footer's length and checksum and a magic number. A rank
// removes its copies of step s - N (own and buddy) only once every rank has kept step s (a
// collective at the end of each save), so a kill at any moment leaves a step that every rank has
// complete, and one generation stays in memory between saves (two while one is written).
//
// A copy belongs to one job: KEEL_JOB_ID, which `keel launch` keeps across its restarts (or a
// user passes to a job restarted by hand with train.resume = auto). Copies of another job, another
// trajectory or world size are never used: they are removed, in one line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "ckpt/checkpoint.h"
#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// A job's state restored from memory copies.
struct MemoryResume {
  TrainState state;           // step, data position, ranks' states (dir: "memory (step N)")
  std::vector<float> carried;  // this rank's carried step state (state.ranks[0].has_carried)
  int from_own = 0;           // ranks restored from their own copy
  int from_buddy = 0;         // ranks restored from the copy their buddy holds
  double load_s = 0;          // from the start of the search to the state in the store (max over ranks)
  std::string where;          // the /dev/shm directory
};

class MemoryCheckpoint {
 public:
  // Every rank of `world` constructs it (collective: the exchanges get their own communicator).
  // Throws keel::Error when /dev/shm is not a directory.
  MemoryCheckpoint(const Config& config, Communicator& world);
  ~MemoryCheckpoint();

  // The directory of this run's copies: /dev/shm/keel-<hash of the canonical run_dir>.
  const std::string& dir() const { return dir_; }
  const std::string& job() const { return job_; }

  // Every rank, after step `step`: writes this rank's copy of the store's saved planes (the
  // pending updates applied by the caller), `state`, `residual` (state.has_residual) and `carried`
  // (state.has_carried: the step engine's carried state, core/carried_state.h), then exchanges
  // copies with the buddies and drops copies older than the previous one. A copy that cannot be
  // written is reported (one line) and training goes on. Returns the milliseconds spent.
  double save(int64_t step, const ChunkStore& store, const RankState& state, const std::vector<float>& residual,
              const std::vector<float>& carried = {});

  // Every rank, at start-up. With `eligible` (a restarted job, or train.resume = auto): restores
  // the newest step newer than `disk_step` (-1: no disk checkpoint) for which every rank has a
  // complete copy of this job, own or its buddy's, whose checksums verify; its planes, versions
  // and residuals are in `store` and `sync` when it returns one. Otherwise, or when no step
  // qualifies, returns nullopt (why: `why_not`) and the store holds nothing of a copy: its moments
  // are zero and its versions 0 (its parameters are the caller's to load or initialise). Copies of
  // another job, trajectory or world size are removed and reported in one line (rank 0).
  std::optional<MemoryResume> resume(ChunkStore& store, GradSync& sync, int64_t disk_step, bool eligible,
                                     std::string* why_not);

  // Every rank, at the end of a run whose final checkpoint is on disk: removes this rank's copies
  // (own and buddy) and the directory once it is empty.
  void remove_all();

 private:
  struct Copy {
    std::string path;
    int rank = 0;  // the rank whose state it is
    int64_t step = 0;
    bool buddy = false;
  };
  // This rank's files in dir_: own copies, buddy copies of rank (r - 1), temporary ones.
  std::vector<Copy> list_copies(std::vector<std::string>* temporary) const;
  // The footer of a copy, when its trailer and checksum are sound (else throws keel::Error).
  std::string read_footer(const std::string& path, int64_t* file_bytes) const;
  // Whether a footer is of this job (else why not, for the stale report).
  std::string foreign(const std::string& footer_json, int rank) const;
  // What restore() read besides the planes: set on the store once every rank has restored.
  struct Restored {
    TrainState state;
    std::vector<uint64_t> versions;
    std::vector<float> residual;
    std::vector<float> carried;
  };
  // Restores a complete copy (the bytes of a file) into the store's planes in one pass: its footer
  // is checked against this run (job, layout, every section's place and size) before anything is
  // written, then each section is copied into its plane and its checksum taken from the copy as it
  // is made. Throws keel::Error naming `what` on a mismatch; `*written` says whether planes were
  // written (they hold part of the copy then).
  void restore(const char* bytes, int64_t size, const std::string& what, ChunkStore& store, GradSync& sync,
               Restored* out, bool* written) const;
  // The footer of a copy, checked as restore() does before writing; throws keel::Error naming `what`.
  nlohmann::json checked_footer(const char* bytes, int64_t size, const std::string& what, const ChunkStore& store,
                                GradSync& sync) const;
  // One line on stderr for the first copy this process fails to keep or send.
  void report_failure(const std::string& what);
  // Removes this rank's copies (own and buddy) of steps before `step`.
  void drop_before(int64_t step);

  Communicator& world_;
  std::unique_ptr<Communicator> exchange_;  // the buddies' transfers, apart from training's collectives
  std::string dir_, job_, trajectory_;
  int rank_ = 0, world_size_ = 1;
  std::vector<char> receive_buffer_;
  int failures_ = 0;
};

// Where the memory copies of the run in `run_dir` live: /dev/shm/keel-<XXH3 of its canonical path>.
std::string memory_checkpoint_dir(const std::string& run_dir);

// The layout hash a memory copy records: this store's chunks (offsets, sizes, layers, first
// tensors) and the chunks whose moments it holds. A copy restores only into the same layout.
std::string memory_layout_hash(const ChunkStore& store);

}  // namespace keel
