// Checkpoints: differential, atomic, verifiable and reshardable.
//
// A checkpoint root (run_dir/ckpt) holds one directory per checkpoint, step-00000040/ and so on.
// A checkpoint directory holds r0.bin, r1.bin... (the chunk records each rank wrote) and
// manifest.json, written last: data first, fsync, then the manifest renamed into place and the
// directory fsynced. A directory without a manifest is not a checkpoint: it is never used, and it
// is removed only when it is positively the run's own interrupted write (the writer creates the
// directory together with the run's mark, run-<run id>, before any data).
//
// The manifest names the format version, step, config and trajectory hashes, the writers' layout,
// every rank's state (data position, compression residuals, a step engine's carried state:
// core/carried_state.h), and for every chunk its layer, kind, tensors (names and offsets),
// version, and one record per saved plane (params, AdamW m and v). A record says where the
// plane's bytes of that chunk live and how they are encoded, with an XXH3 checksum of the stored
// bytes and of the decoded data:
//   raw       the floats as they are;
//   zstd      compressed;
//   xor-zstd  XOR against the same chunk's bytes in the previous checkpoint (`base`), compressed.
// A full checkpoint writes every chunk. In between (checkpoint.full_every), a differential one
// writes only chunks whose version moved since the previous checkpoint; an unchanged chunk's
// record is copied from the previous manifest and points into the older directory (`in`).
// Records are logical (chunk and plane), not tied to the writer's layout, so a checkpoint written
// by N ranks under any ZeRO stage loads on M ranks under any stage.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/manifest.h"
#include "core/config.h"
#include "data/loader.h"
#include "store/chunk_store.h"

namespace keel {

// Per-rank state that cannot be rebuilt from the chunks.
struct RankState {
  int rank = 0;
  LoaderPosition data;
  // Compressed gradient sync: the rank has error-feedback residuals (saved as one record of
  // floats in its rR.bin; read them with read_rank_residual) for this layout of buckets.
  bool has_residual = false;
  std::string residual_layout;
  std::string residual_keys;  // GradSync::residual_keys: what each bucket's residual covers ("" = unknown)
  // The state its step engine carries between steps (core/carried_state.h), saved as one record
  // of floats (read it with read_rank_carried) with the engine's description.
  bool has_carried = false;
  std::string carried_layout;
};

// What a training run needs besides the chunk store to continue exactly where it stopped.
struct TrainState {
  std::string dir;              // the checkpoint directory loaded
  int64_t step = 0;             // optimizer steps completed
  LoaderPosition data;          // position of the training loader (the same on every rank)
  std::vector<RankState> ranks; // as the writer saved them
  std::string config_toml;      // the resolved config of the run that wrote it
};

// The checkpoint directories under root that have a manifest, newest (highest step) first.
std::vector<std::string> list_checkpoints(const std::string& root);
// The checkpoints `path` stands for, newest first: path itself when it is one checkpoint
// directory; else the complete step-* directories under it (and path itself too when it also
// holds a manifest: format 1 wrote run_dir/ckpt as the checkpoint). Throws when there is none.
std::vector<std::string> checkpoint_candidates(const std::string& path);

// "step-00000040"; a later attempt at the same step (a run that replays past a checkpoint it
// could not use, or saves again at the step it resumed from) is "step-00000040.1" and so on:
// published directories are never rewritten, because newer checkpoints may point into them.
std::string checkpoint_name(int64_t step, int attempt = 0);
// The attempt number a new checkpoint at `step` under root gets (one more than any existing).
int next_checkpoint_attempt(const std::string& root, int64_t step);

// Reads the config stored in a checkpoint (a checkpoint directory, or a root: its newest).
Config read_checkpoint_config(const std::string& path);

enum class LoadMode {
  params,  // parameters only, any config of the same shape (evaluation, generation, export)
  resume,  // parameters and this store's moments; the writer's trajectory hash must match
};

// Loads a checkpoint into store (built from a config of the same shape and chunk size). `path` is
// a checkpoint directory (used as is) or a root (its checkpoints are tried newest first: one that
// fails verification is reported through `rejected` and the next older one is tried). Every
// record is verified (sizes, checksums of stored and decoded bytes) as it is read; on failure a
// keel::Error names the file, chunk and what differs. A store with sharded moments receives its
// own shard. `world_size` is the reader's number of ranks (for the trajectory hash).
TrainState load_checkpoint(const std::string& path, ChunkStore& store, const Config& config, LoadMode mode,
                           int world_size = 1,
                           const std::function<void(const std::string&)>& rejected = nullptr);

// Undoes what a failed load wrote into a store (a load verifies as it writes): its AdamW moments
// back to zero and every chunk's version to 0. Its parameters are left for the caller to load or
// initialise.
void clear_loaded_state(ChunkStore& store);

// Checks every record of a checkpoint (or of each checkpoint of a root) without a store: throws
// on the first problem. Returns the number of records verified.
int64_t verify_checkpoint(const std::string& dir);

// What a checkpoint directory holds, from its manifest (for `keel checkpoints`).
struct CheckpointInfo {
  std::string dir, name, kind, base;
  int64_t step = 0;
  int version = 0, world = 1, zero = 0;
  double raw_bytes = 0;      // the state it describes (3 planes of every chunk)
  double own_bytes = 0;      // bytes of records stored in this directory
  int records = 0, raw = 0, zstd = 0, xor_zstd = 0, elsewhere = 0;  // elsewhere: in an older checkpoint
};
CheckpointInfo describe_checkpoint(const std::string& dir);

// The compression residuals rank `rank` saved in checkpoint directory `dir` (verified). Throws
// when it saved none or they are corrupt.
std::vector<float> read_rank_residual(const std::string& dir, int rank);

// The carried step state rank `rank` saved in checkpoint directory `dir` (verified). Throws when
// it saved none or it is corrupt.
std::vector<float> read_rank_carried(const std::string& dir, int rank);

// Decodes one plane of a checkpoint into a flat array of store.numel() floats (tests, tools).
std::vector<float> read_checkpoint_plane(const std::string& dir, Plane plane);

// What one checkpoint cost.
struct CheckpointStats {
  std::string name;
  bool full = true;
  double raw_bytes = 0;      // the state covered (3 planes of every chunk, compression residuals)
  double written_bytes = 0;  // bytes written by this checkpoint (all ranks, after encoding)
  int records = 0, unchanged = 0, xor_records = 0;
  double stall_ms = 0;       // training time lost: waiting for the previous write + snapshot copy
  double write_ms = 0;       // background encode + write + fsync (max over ranks)
};

// A chunk of a store in a checkpoint of another layout: the checkpoint's chunk id (-1: not
// written, e.g. the replica of a tied tensor, saved at its home) and how many of its floats the
// checkpoint's chunk holds (a store's last chunk runs on to an alignment boundary).
struct ChunkTarget {
  int id = -1;
  int64_t numel = 0;
};

// One rank's side of writing checkpoints. The rank writes the chunks [first, last) of a
// partition of the store (every chunk is written by exactly one rank): begin() waits for the
// previous write, copies the chunks' planes into a snapshot buffer and returns; a background
// thread encodes and writes them (or begin() writes them itself when async is off; with memory
// tiers, or under ZeRO-3, begin() streams the chunks from the store itself, with no snapshot). Publishing
// needs every rank's part: the checkpointer gathers the parts (finish()) to rank 0, which calls
// publish_checkpoint and tells every rank the outcome through committed().
class CheckpointWriter {
 public:
  // With `preallocate`, the snapshot buffers are allocated and touched now rather than inside the
  // first checkpoints' steps (for runs that checkpoint periodically). `targets`, when given, say
  // where each of the store's chunks goes in the checkpoint's layout (a pipeline stage's chunks
  // are the whole model's chunks of its layers).
  // `stream`: always write as with memory tiers, chunk by chunk from the store under leases,
  // synchronously, with no snapshot (ZeRO-3: a rank's range of parameters and moments is most of
  // what it holds, and a copy of it would not fit beside it).
  CheckpointWriter(const ChunkStore& store, const CheckpointConfig& config, int rank, int first_chunk, int last_chunk,
                   bool preallocate = false, std::vector<ChunkTarget> targets = {}, bool stream = false);
  // Whether its checkpoints stream (no snapshot buffers): memory tiers, or asked to.
  bool streams() const { return stream_ || !store_.residency().always_present(); }
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // The run whose checkpoints it writes (RunDirectory::run_id): every checkpoint directory is
  // created with that run's mark in it, before any data. "" (tools): no mark.
  void set_run_id(std::string run_id) { run_id_ = std::move(run_id); }

  // Snapshots this rank's chunks at `step` (index = checkpoints taken so far in this run decides
  // full or differential) and starts writing them under root/checkpoint_name(step, attempt)
  // (every rank must use the same attempt: see next_checkpoint_attempt). With state.has_residual,
  // `residual` holds the rank's compression residuals: the writer takes the vector (swapping in
  // its previous buffer, so the caller can reuse it) and writes it as one record; the same for
  // `carried` with state.has_carried.
  void begin(const std::string& root, int64_t step, const RankState& state, int attempt = 0,
             std::vector<float>* residual = nullptr, std::vector<float>* carried = nullptr);
  const std::string& name() const { return name_; }
  bool in_flight() const { return in_flight_; }
  bool done() const;         // the background write of the current checkpoint finished
  // Waits for the background write; returns this rank's part (its records, rank state, sizes,
  // or the error that stopped it).
  const CheckpointPart& finish();
  // The outcome of publishing: a committed checkpoint becomes the base of the next differential one.
  void committed(bool ok);

 private:
  void write_job();

  const ChunkStore& store_;
  CheckpointConfig config_;
  int rank_, first_, last_;
  int64_t begin_offset_ = 0, numel_ = 0;  // flat range of this rank's chunks
  // Snapshot and, for XOR deltas, the bytes of the last committed checkpoint; planes back to back.
  std::vector<float> snapshot_, base_;
  bool stream_ = false;     // asked to stream (ZeRO-3)
  bool streaming_ = false;  // this checkpoint: no snapshot, written chunk by chunk from the store
  std::vector<uint64_t> snapshot_versions_, base_versions_;
  std::string base_name_;          // the last committed checkpoint ("" = none: next one is full)
  std::vector<ChunkRecords> base_records_;  // its records of this rank's chunks [first, last)
  std::vector<ChunkRecords> written_;       // the current checkpoint's, the same way (set with part_)
  std::vector<ChunkTarget> targets_;        // per chunk (empty: the store's own layout)
  int64_t taken_ = 0;              // checkpoints begun in this run
  bool full_ = true;
  std::string root_, name_, run_id_;
  int64_t step_ = 0;
  RankState state_;
  std::vector<float> residual_, carried_;
  bool in_flight_ = false;
  CheckpointPart part_;
  std::thread thread_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool job_done_ = true;
};

// Rank 0: assembles the manifest from every rank's part (recording `run_id`, the run that wrote
// it) and publishes the checkpoint (manifest written to a temporary name, fsynced, renamed into
// place, directory fsynced), then applies retention: keeps the run's newest `keep` checkpoints and
// every older one they reference, and removes the run's others (complete checkpoints whose
// manifest names this run or no run; nothing else under root). Returns "" on success or why it
// did not publish (a rank's write failed); the checkpoint directory is then removed.
std::string publish_checkpoint(const std::string& root, const std::vector<CheckpointPart>& parts,
                               const ChunkStore& store, const Config& config, int world_size, double peak_gflops,
                               int keep, const std::string& run_id, CheckpointStats* stats);

// The mark of run `run_id` that its writers create in a checkpoint directory before any data.
std::string run_marker(const std::string& run_id);

// What start-up found under a checkpoint root that has a checkpoint's name but no manifest.
struct IncompleteCheckpoints {
  std::vector<std::string> removed;  // names: the run's own interrupted writes, removed
  std::vector<std::pair<std::string, std::string>> kept;  // name, why it is not known to be one: left alone
};
// Rank 0 at start-up: removes an entry without a manifest only when it is positively an
// interrupted write of run `run_id`: a directory (not a link), newer than the newest complete
// checkpoint, holding that run's mark and nothing a writer does not write (rN.bin,
// manifest.json.tmp), or nothing at all. Everything else is left alone and named in `kept`.
IncompleteCheckpoints remove_interrupted_checkpoints(const std::string& root, const std::string& run_id);

// Synchronous save of a whole store by one process (tools, tests, single-rank runs): full
// checkpoint of every chunk into root/checkpoint_name(state.step).
std::string save_checkpoint(const std::string& root, const ChunkStore& store, const Config& config,
                            const RankState& state, int64_t step, double peak_gflops = 0);

}  // namespace keel
