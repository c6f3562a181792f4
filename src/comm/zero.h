// ZeRO sharding by chunk: the data-parallel ranks split the chunks into contiguous groups of
// about equal size. Rank r owns the optimizer state (ZeRO-1) and the reduced gradients (ZeRO-2)
// of its group, updates those parameters, and all-gathers the updated parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "store/chunk_store.h"

namespace keel {

struct ChunkPartition {
  std::vector<int> first_chunk;  // rank r owns chunks [first_chunk[r], first_chunk[r + 1])
  std::vector<int64_t> begin;    // and the flat elements [begin[r], begin[r + 1]); these tile the
                                 // whole flat space, alignment gaps included
  // Balances element counts; deterministic, the same on every rank.
  static ChunkPartition balanced(const ChunkStore& store, int world);
  int64_t size(int rank) const { return begin[rank + 1] - begin[rank]; }
  // The rank that owns `chunk`.
  int owner(int chunk) const {
    int r = 0;
    while (first_chunk[r + 1] <= chunk) r++;
    return r;
  }
  // Per-rank element counts and offsets as MPI wants them.
  std::vector<int> counts() const;
  std::vector<int> displs() const;
  // Elements of [offset, offset + numel) owned by each rank (they sum to numel).
  std::vector<int> intersect(int64_t offset, int64_t numel) const;
};

}  // namespace keel
