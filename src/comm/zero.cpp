#include "comm/zero.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "core/error.h"

namespace keel {

namespace {

// Tilings of the flat space over `world` ranks balancing the elements of the chunks `counted`
// accepts: rank r starts at the chunk whose counted elements before it come nearest r/world of
// them (the later on a tie; chunks not counted move no boundary).
void balance(const ChunkStore& store, int world, const std::function<bool(const Chunk&)>& counted,
             std::vector<int>& first_chunk, std::vector<int64_t>& begin) {
  const std::vector<Chunk>& chunks = store.chunks();
  const int n = static_cast<int>(chunks.size());
  std::vector<int64_t> before(static_cast<size_t>(n) + 1, 0);  // counted elements before chunk c
  for (int c = 0; c < n; ++c) before[c + 1] = before[c] + (counted(chunks[c]) ? chunks[c].numel : 0);
  first_chunk.assign(world + 1, n);
  first_chunk[0] = 0;
  int c = 0;
  for (int r = 1; r < world; ++r) {
    const int64_t target = before[n] * r / world;
    while (c < n && before[c] < target) ++c;
    if (c > first_chunk[r - 1] && target - before[c - 1] < before[c] - target) --c;
    first_chunk[r] = c;
  }
  begin.resize(world + 1);
  for (int r = 0; r < world; ++r) begin[r] = first_chunk[r] < n ? chunks[first_chunk[r]].offset : store.numel();
  begin[0] = 0;
  begin[world] = store.numel();
  for (int r = 0; r < world; ++r) {
    check(begin[r + 1] - begin[r] <= std::numeric_limits<int>::max(), "ZeRO: a rank's shard exceeds 2^31 elements");
  }
}

std::vector<int> intersect_tiling(const std::vector<int64_t>& begin, int64_t offset, int64_t numel) {
  std::vector<int> out(begin.size() - 1);
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t lo = std::max(offset, begin[r]), hi = std::min(offset + numel, begin[r + 1]);
    out[r] = static_cast<int>(std::max<int64_t>(0, hi - lo));
  }
  return out;
}

}  // namespace

ChunkPartition ChunkPartition::balanced(const ChunkStore& store, int world) {
  const std::vector<Chunk>& chunks = store.chunks();
  const int n = static_cast<int>(chunks.size());
  ChunkPartition p;
  p.first_chunk.assign(world + 1, n);
  p.first_chunk[0] = 0;
  // Rank r starts at the first chunk whose start reaches r/world of the flat space.
  int c = 0;
  for (int r = 1; r < world; ++r) {
    const int64_t target = store.numel() * r / world;
    while (c < n && chunks[c].offset < target) ++c;
    p.first_chunk[r] = c;
  }
  p.begin.resize(world + 1);
  for (int r = 0; r < world; ++r) {
    p.begin[r] = p.first_chunk[r] < n ? chunks[p.first_chunk[r]].offset : store.numel();
  }
  p.begin[0] = 0;
  p.begin[world] = store.numel();
  for (int r = 0; r < world; ++r) {
    check(p.size(r) <= std::numeric_limits<int>::max(), "ZeRO: a rank's shard exceeds 2^31 elements");
  }
  return p;
}

ChunkPartition ChunkPartition::balanced_experts_apart(const ChunkStore& store, int world, int expert_group) {
  check(expert_group > 1 && world % expert_group == 0,
        "ZeRO: sharded experts over " + std::to_string(world) + " data ranks in expert groups of " +
            std::to_string(expert_group));
  ChunkPartition p;
  p.expert_group = expert_group;
  balance(store, world, [](const Chunk& c) { return c.expert < 0; }, p.first_chunk, p.begin);
  balance(store, world / expert_group, [](const Chunk& c) { return c.expert >= 0; }, p.expert_first_chunk,
          p.expert_begin);
  return p;
}

bool ChunkPartition::owns(int rank, const Chunk& chunk) const {
  if (!experts_apart() || chunk.expert < 0) return chunk.id >= first_chunk[rank] && chunk.id < first_chunk[rank + 1];
  const int q = rank / expert_group;
  return chunk.id >= expert_first_chunk[q] && chunk.id < expert_first_chunk[q + 1];
}

std::vector<int> ChunkPartition::counts() const {
  std::vector<int> out(begin.size() - 1);
  for (size_t r = 0; r < out.size(); ++r) out[r] = static_cast<int>(begin[r + 1] - begin[r]);
  return out;
}

std::vector<int> ChunkPartition::displs() const {
  std::vector<int> out(begin.size() - 1);
  for (size_t r = 0; r < out.size(); ++r) out[r] = static_cast<int>(begin[r]);
  return out;
}

std::vector<int> ChunkPartition::intersect(int64_t offset, int64_t numel, bool expert) const {
  return intersect_tiling(expert && experts_apart() ? expert_begin : begin, offset, numel);
}

}  // namespace keel
