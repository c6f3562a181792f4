// A training run's checkpoints as one component: which rank writes which chunks, the writer and
// its background thread, the handshake that publishes a checkpoint (every rank's part gathered to
// rank 0, which writes the manifest and tells every rank the outcome), the step time checkpoints
// cost, the compression residuals that ride along, and resuming (choosing the candidate every
// rank could load, falling back to the previous good one).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/checkpoint.h"
#include "ckpt/memory_checkpoint.h"
#include "ckpt/run_directory.h"
#include "comm/communicator.h"
#include "core/carried_state.h"
#include "comm/grad_sync.h"
#include "comm/tensor_parallel.h"
#include "comm/zero.h"
#include "core/config.h"
#include "data/loader.h"
#include "store/chunk_store.h"

namespace keel {

// Where a run resumes from (Checkpointer::resume): train.resume (a checkpoint directory or a
// root), or the run's own checkpoints (run_dir/ckpt) for train.resume = "auto" or a job restarted
// by `keel launch` (KEEL_RESTART) that has some.
struct ResumeSource {
  bool automatic = false;  // the run's own checkpoints ("auto", or a restart that has some)
  bool has_own = false;    // the run's own root holds a checkpoint
  std::string path;        // the directory or root to try; "" = a fresh start
  // The checkpoints to try, newest first (checkpoint_candidates; throws where an explicit
  // train.resume has none); empty for a fresh start.
  std::vector<std::string> candidates() const;
};
ResumeSource resume_source(const Config& config);

class Checkpointer {
 public:
  // Takes the run directory (one run at a time: see RunDirectory; throws when another run holds
  // it). `log_event` receives the `event: checkpoint` line of every checkpoint (rank 0).
  Checkpointer(const Config& config, Communicator& world, ChunkStore& store, GradSync& sync, double peak_gflops,
               std::function<void(const nlohmann::json&)> log_event);
  ~Checkpointer();

  // Before resume(), and after a re-cut: the state the step engine carries between steps (null:
  // none), which every checkpoint saves per rank and resume() restores (or refuses in one line
  // when the checkpoint's was saved in a layout this run cannot take it up in).
  void set_carried_state(CarriedState* carried) { carried_ = carried; }
  // Tensor parallelism: the store given at construction is `whole`'s (the whole model's layout,
  // identical on every rank, written by all ranks as data-parallel ranks write theirs); each
  // checkpoint gathers the shards into it first, and a loaded one is sliced back into them.
  void set_whole_state(WholeModelState* whole) { whole_state_ = whole; }
  // Start-up, on every rank: removes what a crash during one of this run's writes left (rank 0;
  // other incomplete directories are reported and left alone), then loads the checkpoint to
  // resume from, if any: train.resume (a directory or a root), the run's own checkpoints for
  // "auto" or a job restarted by `keel launch` (KEEL_RESTART). A candidate is used only when
  // every rank loaded it; a rejected one is reported and the next older one tried. Returns the
  // state loaded, or nullopt for a fresh start (the store's moments and versions then cleared of
  // anything a failed load wrote); either way the run then has its id. Throws keel::Error when an
  // explicit train.resume has no usable checkpoint or is another run's checkpoint
  // (RunDirectory::check_resume_from), or when a fresh start would overwrite an earlier run
  // (RunDirectory::check_fresh_start).
  std::optional<TrainState> resume();

  // Logs the resume's source (`event: resume`, once the metrics are open; rank 0). A job
  // restarted by `keel launch --max-restarts` (KEEL_RESTART): also prints and logs (`event:
  // recovery`) the time from the failure being noticed to now, when training resumes at `step`
  // from checkpoint `from` ("" = from scratch). Rank 0; nothing for a first attempt.
  void report_recovery(int64_t step, const std::string& from);

  // After every step, on every rank: publishes a checkpoint whose writes all ranks finished, and
  // begins a periodic one when train.checkpoint_every or train.checkpoint_every_minutes says so
  // (not after the last step; by the clock, rank 0's clock decides and every rank follows).
  void after_step(int64_t steps_done, const LoaderPosition& data);
  // Saves the state after `steps_done` steps under root, synchronously (every rank calls it).
  // Returns whether it was published (false: it was reported as not written).
  bool save(const std::string& root, int64_t steps_done, const LoaderPosition& data);
  // The run's final state under the run's own root; its directory ("" when it was not written).
  // A pipelined run's, like its periodic ones, in the layout one rank writes (every stage's
  // replicas write their chunks).
  std::string save_final(int64_t steps_done, const LoaderPosition& data);
  // Publishes a checkpoint still being written, if any (before the run stops early).
  void finish_in_flight();
  // Every rank, once the run's final checkpoint is on disk: its memory copies are not needed again.
  void remove_memory_copies();
  // A pipeline re-cut: this rank's chunks are now `store`'s (the stages' new layout), its sync
  // `sync`. Publishes a checkpoint in flight first; the next checkpoint is a full one (a
  // differential one needs the same chunks as its base).
  void relayout(ChunkStore& store, GradSync& sync);
  // Rank 0: the newest checkpoint under the run's root that exists and verifies ("" = none; the
  // ones that do not verify are reported). Other ranks: "".
  std::string newest_verified();
  // Step time spent on checkpoints since the last call (snapshot, waiting for a write).
  double take_stall_ms();

  const std::string& root() const { return root_; }     // run_dir/ckpt
  double peak_gflops() const { return peak_gflops_; }   // recorded in every manifest
  std::string last_name() const;                         // the checkpoint begun last
  // Checkpoint buffers held per rank (for the memory report).
  double buffer_bytes() const;

 private:
  void begin(const std::string& root, int64_t step, const LoaderPosition& data);
  // The writers' partition and this rank's writer for the store's chunks; `at_restart`: this
  // process is a restarted job's (KEEL_RESTART).
  void make_writer(bool at_restart = false);
  bool commit();
  // Whether a checkpoint by the clock is due after this step (rank 0 decides).
  bool due_by_clock();
  // This rank's compression residuals in the checkpoint being resumed (into out; empty when
  // there are none to restore, with the reason returned). Throws when they are corrupt.
  // This rank's residuals in `state`: whole (`out`: saved under this layout) or by key (`parts`:
  // another pipeline layout of the same data-parallel ranks); else a note that they are dropped.
  std::string load_residuals(const TrainState& state, std::vector<float>& out, std::vector<GradSync::ResidualPart>& parts);
  // The run's id once resume decided (RunDirectory::settle_run_id), for its checkpoints.
  void settle_run_id();
  // This rank's carried step state in `state` (its description and floats; both empty when the
  // checkpoint holds none). Throws when this run cannot continue from it.
  void load_carried(const TrainState& state, std::string& layout, std::vector<float>& floats);
  // The job's memory copies, when memory checkpoints are on and one is newer than the newest disk
  // checkpoint (and `eligible`: a restarted job, or train.resume = auto); prints the source.
  std::optional<TrainState> resume_from_memory(bool eligible);
  // This rank's part of a checkpoint's state (disk or memory): rank, data position and the
  // compression residuals, copied into `residual`.
  RankState rank_state(const LoaderPosition& data, std::vector<float>& residual) const;
  // Rank 0: one line when the checkpoint's run read another training set than this one.
  void note_other_data(const TrainState& state) const;

  const Config& config_;
  Communicator& comm_;
  RunDirectory run_dir_;  // first: held before anything reads or writes the directory
  ChunkStore* store_;  // this rank's (rebound by relayout)
  GradSync* sync_;
  double peak_gflops_;
  std::function<void(const nlohmann::json&)> log_event_;
  // Which chunks each writer writes: ranks without a pipeline, a stage's replicas with one.
  ChunkPartition writers_;
  int writer_index_ = 0;               // this rank's part of writers_
  std::unique_ptr<ChunkStore> whole_;  // a pipeline: the whole model's layout (nothing allocated)
  std::unique_ptr<CheckpointWriter> writer_;
  std::string root_;
  std::string inflight_root_;
  // The configuration at the snapshot, which the manifest records: a component that keeps state
  // in it (model.dynamic_windows_state) may have moved on by the time the write is published.
  Config inflight_config_;
  int64_t inflight_step_ = -1;
  double begin_ms_ = 0;
  double stall_ms_ = 0;
  std::chrono::steady_clock::time_point last_timed_;
  bool last_ok_ = true;  // the outcome of the last commit  // rank 0: the clock checkpoints count from
  std::vector<float> residual_scratch_;
  CarriedState* carried_ = nullptr;
  WholeModelState* whole_state_ = nullptr;
  std::vector<float> carried_scratch_;
  std::unique_ptr<MemoryCheckpoint> memory_;  // checkpoint.memory_every > 0
  std::vector<float> memory_residual_;
  nlohmann::json resume_event_;  // what resume() used, logged once the metrics are open
};

}  // namespace keel
