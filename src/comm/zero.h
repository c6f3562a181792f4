// ZeRO sharding by chunk: the data-parallel ranks split the chunks into contiguous groups of
// about equal size. Rank r owns the optimizer state (ZeRO-1) and the reduced gradients (ZeRO-2)
// of its group, updates those parameters, and all-gathers the updated parameters.
//
// With sharded experts (comm/expert_parallel.h: parallel.expert = P, each rank's store holding
// only its E / P routed experts beside every chunk of no expert, at the same flat offsets on
// every rank) the two kinds of chunk are shared out apart (`experts_apart`): the chunks of no
// expert over the D data ranks as above (their ranges tile the flat space; a rank owns the chunks
// of no expert inside its range), and the expert chunks over the D / P ranks holding the same
// experts (data ranks with the same rank % P; holder q = data rank / P owns the expert chunks of
// its range of the same tiling over the expert chunks). A rank's own chunks are then not one
// contiguous range: `owns` says which are.
#pragma once

#include <cstdint>
#include <vector>

#include "store/chunk_store.h"

namespace keel {

// The passes of a model whose layer leases ZeRO-3 records, each kind's schedule apart
// (comm/sharded_params.h): a training step (its micro-batches' forward and backward passes) and
// one evaluation batch's forward.
enum class LeasePass : uint8_t { step, evaluation };

struct ChunkPartition {
  std::vector<int> first_chunk;  // rank r owns chunks [first_chunk[r], first_chunk[r + 1])
  std::vector<int64_t> begin;    // and the flat elements [begin[r], begin[r + 1]); these tile the
                                 // whole flat space, alignment gaps included
  // Sharded experts (1: none): the expert group's size P, and the same two tilings for the
  // expert chunks over the D / P holders of each expert (first_chunk and begin are then the
  // chunks of no expert's).
  int expert_group = 1;
  std::vector<int> expert_first_chunk;
  std::vector<int64_t> expert_begin;
  // Balances element counts; deterministic, the same on every rank.
  static ChunkPartition balanced(const ChunkStore& store, int world);
  // The chunks of no expert balanced over `world` ranks, the expert chunks over world / P
  // holders (P = expert_group > 1, dividing world). Deterministic, the same on every rank.
  static ChunkPartition balanced_experts_apart(const ChunkStore& store, int world, int expert_group);
  bool experts_apart() const { return expert_group > 1; }
  int64_t size(int rank) const { return begin[rank + 1] - begin[rank]; }
  // The rank that owns `chunk` (not with experts apart: see owns).
  int owner(int chunk) const {
    int r = 0;
    while (first_chunk[r + 1] <= chunk) r++;
    return r;
  }
  // Whether data rank `rank` owns `chunk` (of its store: an expert chunk is one of its experts').
  bool owns(int rank, const Chunk& chunk) const;
  // The owner of an expert chunk among its D / P holders (experts apart).
  int expert_holder(int chunk) const {
    int q = 0;
    while (expert_first_chunk[q + 1] <= chunk) q++;
    return q;
  }
  // Per-rank element counts and offsets as MPI wants them.
  std::vector<int> counts() const;
  std::vector<int> displs() const;
  // Elements of [offset, offset + numel) owned by each rank (they sum to numel). With experts
  // apart, `expert`: by the expert tiling, one count per holder (a range of one kind of chunk).
  std::vector<int> intersect(int64_t offset, int64_t numel, bool expert = false) const;
};

}  // namespace keel
