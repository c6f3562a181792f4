#include "comm/zero.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace keel {

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

std::vector<int> ChunkPartition::intersect(int64_t offset, int64_t numel) const {
  std::vector<int> out(begin.size() - 1);
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t lo = std::max(offset, begin[r]), hi = std::min(offset + numel, begin[r + 1]);
    out[r] = static_cast<int>(std::max<int64_t>(0, hi - lo));
  }
  return out;
}

}  // namespace keel
