// A training run's checkpoints as one component: which rank writes which chunks, the writer and
// its background thread, the handshake that publishes a checkpoint (every rank's part gathered to
// rank 0, which writes the manifest and tells every rank the outcome), the step time checkpoints
// cost, the compression residuals that ride along, and resuming (choosing the candidate every
// rank could load, falling back to the previous good one).
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/checkpoint.h"
#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "comm/zero.h"
#include "core/config.h"
#include "data/loader.h"
#include "store/chunk_store.h"

namespace keel {

class Checkpointer {
 public:
  // `log_event` receives the `event: checkpoint` line of every checkpoint (rank 0).
  Checkpointer(const Config& config, Communicator& world, ChunkStore& store, GradSync& sync, double peak_gflops,
               std::function<void(const nlohmann::json&)> log_event);
  ~Checkpointer();

  // Start-up, on every rank: removes what a crash during a write left (rank 0), then loads the
  // checkpoint to resume from, if any: train.resume (a directory or a root), the run's own
  // checkpoints for "auto" or a job restarted by `keel launch` (KEEL_RESTART). A candidate is
  // used only when every rank loaded it; a rejected one is reported and the next older one
  // tried. Returns the state loaded, or nullopt for a fresh start (the store's moments and
  // versions then cleared of anything a failed load wrote). Throws keel::Error when an
  // explicit train.resume has no usable checkpoint.
  std::optional<TrainState> resume();

  // A job restarted by `keel launch --max-restarts` (KEEL_RESTART): prints and logs (`event:
  // recovery`) the time from the failure being noticed to now, when training resumes at `step`
  // from checkpoint `from` ("" = from scratch). Rank 0; nothing for a first attempt.
  void report_recovery(int64_t step, const std::string& from);

  // After every step, on every rank: publishes a checkpoint whose writes all ranks finished, and
  // begins a periodic one when train.checkpoint_every says so (not after the last step).
  void after_step(int64_t steps_done, const LoaderPosition& data);
  // Saves the state after `steps_done` steps under root, synchronously (every rank calls it).
  void save(const std::string& root, int64_t steps_done, const LoaderPosition& data);
  // Step time spent on checkpoints since the last call (snapshot, waiting for a write).
  double take_stall_ms();

  const std::string& root() const { return root_; }     // run_dir/ckpt
  double peak_gflops() const { return peak_gflops_; }   // recorded in every manifest
  std::string last_name() const;                         // the checkpoint begun last
  // Checkpoint buffers held per rank (for the memory report).
  double buffer_bytes() const;

 private:
  void begin(const std::string& root, int64_t step, const LoaderPosition& data);
  void commit();
  // This rank's compression residuals in the checkpoint being resumed (into out; empty when
  // there are none to restore, with the reason returned). Throws when they are corrupt.
  std::string load_residuals(const TrainState& state, std::vector<float>& out);

  const Config& config_;
  Communicator& comm_;
  ChunkStore& store_;
  GradSync& sync_;
  double peak_gflops_;
  std::function<void(const nlohmann::json&)> log_event_;
  ChunkPartition writers_;  // which rank writes which chunks
  std::unique_ptr<CheckpointWriter> writer_;
  std::string root_;
  std::string inflight_root_;
  int64_t inflight_step_ = -1;
  double begin_ms_ = 0;
  double stall_ms_ = 0;
  std::vector<float> residual_scratch_;
};

}  // namespace keel
