// Moving a pipeline's state from one cut of its stages to another, in memory and over MPI: what a
// re-cut mid-run (pipeline/repartitioner.h) does between two steps.
//
// Every rank can lay out every rank's chunks under either cut without allocating anything
// (ChunkStore::finalize_layout), and ZeRO's moment shards are a pure function of a layout
// (ChunkPartition::balanced). So every rank computes the same list of pieces — one tensor's
// elements in one plane, from the rank that holds them under the old cut to the rank that needs
// them under the new one — and the pieces travel in rounds of all-to-all exchanges over the world
// communicator (at most kRoundBytes sent or received per rank a round; a piece a rank sends to
// itself is a copy; with sharded experts each replica's layouts are also its expert rank's, which a
// cut does not change). What moves: the parameters (from the same data-parallel replica's holder),
// both AdamW moments (from whichever replica owns that shard under ZeRO), and each chunk's version
// (the newest of the chunks it draws from, as a checkpoint loaded by tensor name sets it).
// Gradients are zero between steps and do not move; compressed sync's residuals move by key
// (migrate_residuals). The result is the state a checkpoint written under the old cut and resumed
// under the new one would load (residuals too, by the same keys): the same bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/grad_sync.h"
#include "comm/process_groups.h"
#include "core/config.h"
#include "model/gpt.h"
#include "store/chunk_store.h"

namespace keel::pipeline {

struct MigrationStats {
  double ms = 0;                // the whole move, on this rank (layouts, exchanges, copies)
  int64_t bytes_sent = 0;       // to other ranks
  int64_t bytes_received = 0;   // from other ranks
  int64_t bytes_copied = 0;     // kept on this rank (copied between its old and new store)
  int rounds = 0;               // all-to-all exchanges
};

// Every rank of `groups.world()` calls it between two steps. `from` is this rank's store under
// `old_cut` (every stage's layers), `to` its store under `new_cut`, finalized and empty (its
// moments sharded as the optimizer built on it shards them). Afterwards `to` holds the
// parameters, moments and versions `from` held for its layers.
MigrationStats migrate_stages(const Config& config, ProcessGroups& groups, const std::vector<LayerRange>& old_cut,
                              const ChunkStore& from, const std::vector<LayerRange>& new_cut, ChunkStore& to);

// Compressed sync's error-feedback residuals, moved with their layers: every bucket's residual
// (GradSync::residual_parts: keyed by layer and position among the layer's buckets, so the same
// key under both cuts) goes to the rank of the same replica that holds its layer under
// `new_cut` (a tied tensor's replica: the rank holding the group's other layers), in one
// all-to-all over the replica's pipeline group. Every rank calls it, after RankModel has built
// `to` for the new cut. Returns the buckets of `to` filled, summed over the world, and the bytes
// this rank sent.
struct ResidualMoveStats {
  int buckets = 0, of = 0;  // buckets of the new syncs filled, out of the compressed ones (world)
  int64_t bytes_sent = 0;
  double ms = 0;  // on this rank
};
ResidualMoveStats migrate_residuals(const Config& config, ProcessGroups& groups, const std::vector<TiedGroup>& tied,
                                    const std::vector<LayerRange>& new_cut, const GradSync& from, GradSync& to);

}  // namespace keel::pipeline
