#include "pipeline/stage_migration.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "comm/expert_parallel.h"
#include "comm/zero.h"
#include "core/error.h"
#include "model/model_layout.h"
#include "pipeline/layout.h"
#include "store/placement.h"

namespace keel::pipeline {

namespace {

// Bytes a rank sends (and, separately, receives) in one all-to-all round at most.
constexpr int64_t kRoundBytes = int64_t{256} << 20;

constexpr Plane kMoved[] = {Plane::param, Plane::adam_m, Plane::adam_v};

// One pipeline rank's chunks under one cut, described without memory, and where its tensors lie.
struct RankLayout {
  std::unique_ptr<ChunkStore> store;
  // The moments' owners over the data-parallel replicas (ZeRO; with sharded experts the experts'
  // over their holders apart: comm/zero.h), or one owner.
  ChunkPartition shards;
  // Per tensor name (home tensors only, not tied replicas): its pieces, in tensor order.
  struct Place {
    int chunk;
    Segment seg;
  };
  std::map<std::string, std::vector<Place>> homes;
};

RankLayout layout_of(const Config& config, const std::vector<LayerRange>& ranges, int shard_ranks, TensorPlace place,
                     ExpertPlace experts, bool experts_apart) {
  RankLayout l;
  l.store = std::make_unique<ChunkStore>(config.store.chunk_bytes);
  register_layout(*l.store, model_layout(config.model, ranges, place, experts));
  l.store->set_huge_page_alignment(tiering_enabled(config.tier));  // as RankModel::build lays out its store
  l.store->finalize_layout();
  l.shards = experts_apart ? ChunkPartition::balanced_experts_apart(*l.store, shard_ranks, experts.size)
                           : ChunkPartition::balanced(*l.store, shard_ranks);
  for (const Chunk& c : l.store->chunks()) {
    for (const Segment& seg : c.segments) {
      const TensorSpec& spec = l.store->tensors()[seg.tensor].spec;
      if (!spec.replica) l.homes[spec.name].push_back({c.id, seg});
    }
  }
  for (auto& [name, places] : l.homes) {
    std::sort(places.begin(), places.end(),
              [](const RankLayout::Place& a, const RankLayout::Place& b) { return a.seg.tensor_offset < b.seg.tensor_offset; });
  }
  return l;
}

// Every pipeline rank's layers under `cut` (a rank holds several stages under interleaved / zb-v).
std::vector<std::vector<LayerRange>> ranges_per_rank(const Config& config, const std::vector<LayerRange>& cut) {
  const Schedule schedule = make_schedule({config.parallel.schedule, config.parallel.pipeline,
                                           micro_batches(config), virtual_stages(config.parallel)});
  std::vector<std::vector<LayerRange>> out(config.parallel.pipeline);
  for (int p = 0; p < config.parallel.pipeline; ++p) {
    for (int s : schedule.stages_of(p)) out[p].push_back(cut.at(s));
  }
  return out;
}

// Elements [src_offset, + numel) of plane `plane` on world rank `src` (old layout) go to
// [dst_offset, + numel) on world rank `dst` (new layout).
struct Piece {
  int src, dst, plane;
  int src_chunk, dst_chunk;
  int64_t src_offset, dst_offset, numel;
};

}  // namespace

MigrationStats migrate_stages(const Config& config, ProcessGroups& groups, const std::vector<LayerRange>& old_cut,
                              const ChunkStore& from, const std::vector<LayerRange>& new_cut, ChunkStore& to) {
  const auto t0 = std::chrono::steady_clock::now();
  Communicator& world = groups.world();
  // World rank = (replica x P + pipeline rank) x T + tensor rank: a tensor rank's shards move
  // between the ranks of the same tensor rank (its pipeline group), each layout that rank's shards'.
  // Sharded experts (comm/expert_parallel.h): replica d holds the routed experts of expert rank
  // d mod X under either cut (an expert group is X consecutive replicas), so an expert's chunks
  // move between the ranks of the same replica as every other chunk; each layout is also that
  // expert rank's. Under ZeRO-1/2 an expert chunk's moments come from their owner among the
  // replicas holding its experts (holder q of expert rank x: replica q X + x), and a replica
  // receives the moments of the chunks it owns under the new cut only.
  const int P = config.parallel.pipeline, T = config.parallel.tensor, D = world.size() / (P * T), me = world.rank();
  const int X = experts_sharded(config) ? config.parallel.expert : 1;
  const bool zero = config.parallel.zero > 0 && D > 1;
  const std::vector<std::vector<LayerRange>> old_ranges = ranges_per_rank(config, old_cut),
                                             new_ranges = ranges_per_rank(config, new_cut);
  std::vector<RankLayout> olds, news;  // by (expert rank x P + pipeline rank) x T + tensor rank
  for (int x = 0; x < X; ++x) {
    for (int p = 0; p < P; ++p) {
      for (int t = 0; t < T; ++t) {
        const TensorPlace place = T > 1 ? TensorPlace{t, T} : TensorPlace{};
        const ExpertPlace experts = X > 1 ? ExpertPlace{x, X} : ExpertPlace{};
        olds.push_back(layout_of(config, old_ranges[p], zero ? D : 1, place, experts, zero && X > 1));
        news.push_back(layout_of(config, new_ranges[p], zero ? D : 1, place, experts, zero && X > 1));
      }
    }
  }
  auto layout_at = [&](int replica, int p, int t) { return ((replica % X) * P + p) * T + t; };
  auto layout_index = [&](int rank) { return layout_at(rank / (P * T), (rank / T) % P, rank % T); };
  const int mine_at = layout_index(me);
  check(olds[mine_at].store->chunks().size() == from.chunks().size() &&
            news[mine_at].store->chunks().size() == to.chunks().size(),
        "re-cut: this rank's stores do not have the layouts of their cuts");
  // Where every tensor lives under the old cut (the same pipeline rank for every tensor rank,
  // and an expert's for every replica holding it).
  std::map<std::string, int> home_rank;
  for (int x = 0; x < X; ++x) {
    for (int p = 0; p < P; ++p) {
      for (const auto& [name, places] : olds[layout_at(x, p, 0)].homes) home_rank[name] = p;
    }
  }
  // Every piece of every rank's new state, in one order every rank shares: receiver, plane, its
  // chunks, their segments, the old pieces they draw from.
  std::vector<Piece> pieces;
  for (int d = 0; d < D; ++d) {
    for (int p = 0; p < P; ++p) {
     for (int t = 0; t < T; ++t) {
      const RankLayout& n = news[layout_at(d, p, t)];
      const int dst = (d * P + p) * T + t;
      for (int plane = 0; plane < 3; ++plane) {
        const bool moment = kMoved[plane] != Plane::param;
        for (const Chunk& chunk : n.store->chunks()) {
          if (moment && zero && !n.shards.owns(d, chunk)) continue;
          const int c = chunk.id;
          for (const Segment& seg : chunk.segments) {
            const std::string& name = n.store->tensors()[seg.tensor].spec.name;
            const auto home = home_rank.find(name);
            check(home != home_rank.end(), "re-cut: no stage holds tensor '" + name + "' under the old cut");
            // (every parameter piece comes from replica d itself: it held the same experts)
            const RankLayout& o = olds[layout_at(d, home->second, t)];
            int64_t at = seg.tensor_offset;
            const int64_t end = seg.tensor_offset + seg.numel;
            for (const RankLayout::Place& place : o.homes.at(name)) {
              const int64_t lo = std::max(at, place.seg.tensor_offset),
                            hi = std::min(end, place.seg.tensor_offset + place.seg.numel);
              if (hi <= lo) continue;
              const bool expert = o.shards.experts_apart() && o.store->chunks()[place.chunk].expert >= 0;
              const int src_replica = !(moment && zero) ? d
                                      : expert          ? o.shards.expert_holder(place.chunk) * X + d % X
                                                        : o.shards.owner(place.chunk);
              // Split into pieces a round can carry.
              for (int64_t a = lo; a < hi;) {
                const int64_t b = std::min<int64_t>(hi, a + kRoundBytes / static_cast<int64_t>(sizeof(float)));
                pieces.push_back(Piece{(src_replica * P + home->second) * T + t, dst, plane, place.chunk, c,
                                       place.seg.offset + (a - place.seg.tensor_offset),
                                       seg.offset + (a - seg.tensor_offset), b - a});
                a = b;
              }
              at = hi;
            }
            check(at == end, "re-cut: tensor '" + name + "' is not whole under the old cut");
          }
        }
      }
     }
    }
  }
  // The old chunks' versions of every rank (each a chunk takes the newest of those it draws from).
  const int W = world.size();
  std::vector<int> counts(W), displs(W);
  for (int r = 0, at = 0; r < W; ++r) {
    counts[r] = static_cast<int>(olds[layout_index(r)].store->chunks().size() * sizeof(uint64_t));
    displs[r] = at;
    at += counts[r];
  }
  std::vector<uint64_t> mine(from.chunks().size()), all((displs[W - 1] + counts[W - 1]) / sizeof(uint64_t));
  for (const Chunk& c : from.chunks()) mine[c.id] = c.version;
  Communicator::Request gathered = world.iallgatherv(reinterpret_cast<const uint8_t*>(mine.data()),
                                                     reinterpret_cast<uint8_t*>(all.data()), counts, displs);
  world.wait(gathered);
  std::vector<uint64_t> versions(to.chunks().size(), 0);
  MigrationStats stats;
  // Rounds: consecutive pieces while no rank sends or receives more than kRoundBytes.
  std::vector<uint8_t> send, recv;
  for (size_t begin = 0; begin < pieces.size();) {
    std::vector<int64_t> out(W, 0), in(W, 0);
    size_t end = begin;
    for (; end < pieces.size(); ++end) {
      const Piece& q = pieces[end];
      const int64_t bytes = q.numel * static_cast<int64_t>(sizeof(float));
      if (end > begin && (out[q.src] + bytes > kRoundBytes || in[q.dst] + bytes > kRoundBytes)) break;
      if (q.src != q.dst) out[q.src] += bytes, in[q.dst] += bytes;
    }
    std::vector<int> send_counts(W, 0), send_displs(W, 0), recv_counts(W, 0), recv_displs(W, 0);
    for (size_t i = begin; i < end; ++i) {
      const Piece& q = pieces[i];
      const int bytes = static_cast<int>(q.numel * sizeof(float));
      if (q.src == q.dst) continue;
      if (q.src == me) send_counts[q.dst] += bytes;
      if (q.dst == me) recv_counts[q.src] += bytes;
    }
    for (int r = 1; r < W; ++r) {
      send_displs[r] = send_displs[r - 1] + send_counts[r - 1];
      recv_displs[r] = recv_displs[r - 1] + recv_counts[r - 1];
    }
    send.resize(static_cast<size_t>(send_displs[W - 1] + send_counts[W - 1]));
    recv.resize(static_cast<size_t>(recv_displs[W - 1] + recv_counts[W - 1]));
    std::vector<int> send_at = send_displs, recv_at = recv_displs;
    for (size_t i = begin; i < end; ++i) {
      const Piece& q = pieces[i];
      if (q.src != me) continue;
      const Plane plane = kMoved[q.plane];
      const PageLease use = from.use_chunk(q.src_chunk, {plane});
      const std::span<const float> v = from.range_view(plane, q.src_offset, q.numel);
      if (q.dst == me) {  // kept on this rank: a copy between its stores
        const PageLease write = to.use_chunk(q.dst_chunk, {}, {plane});
        std::copy(v.begin(), v.end(), to.range_view(plane, q.dst_offset, q.numel).begin());
        stats.bytes_copied += static_cast<int64_t>(v.size_bytes());
        continue;
      }
      std::memcpy(send.data() + send_at[q.dst], v.data(), v.size_bytes());
      send_at[q.dst] += static_cast<int>(v.size_bytes());
    }
    Communicator::Request exchanged =
        world.ialltoallv(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);
    world.wait(exchanged);
    stats.rounds++;
    for (size_t i = begin; i < end; ++i) {
      const Piece& q = pieces[i];
      if (q.dst != me) continue;
      if (kMoved[q.plane] == Plane::param) {
        versions[q.dst_chunk] = std::max(versions[q.dst_chunk], all[displs[q.src] / sizeof(uint64_t) + q.src_chunk]);
      }
      if (q.src == me) continue;
      const Plane plane = kMoved[q.plane];
      const PageLease write = to.use_chunk(q.dst_chunk, {}, {plane});
      const size_t bytes = static_cast<size_t>(q.numel) * sizeof(float);
      std::memcpy(to.range_view(plane, q.dst_offset, q.numel).data(), recv.data() + recv_at[q.src], bytes);
      recv_at[q.src] += static_cast<int>(bytes);
    }
    for (int r = 0; r < W; ++r) {
      stats.bytes_sent += send_counts[r];
      stats.bytes_received += recv_counts[r];
    }
    begin = end;
  }
  for (const Chunk& c : to.chunks()) to.set_version(c.id, versions[c.id]);
  stats.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

ResidualMoveStats migrate_residuals(const Config& config, ProcessGroups& groups, const std::vector<TiedGroup>& tied,
                                    const std::vector<LayerRange>& new_cut, const GradSync& from, GradSync& to) {
  const auto t0 = std::chrono::steady_clock::now();
  Communicator& pp = groups.pp();
  const int P = pp.size();
  const std::vector<std::vector<LayerRange>> ranges = ranges_per_rank(config, new_cut);
  auto holds = [&](int p, int layer) {
    for (const LayerRange& r : ranges[p]) {
      if (layer >= r.first && layer <= r.last) return true;
    }
    return false;
  };
  // What each pipeline rank of this replica gets: [key bytes | key | value count | values].
  std::vector<std::string> out(static_cast<size_t>(P));
  for (const GradSync::ResidualPart& part : from.residual_parts()) {
    for (int p = 0; p < P; ++p) {
      bool wanted = !part.replica && holds(p, part.layer);
      for (const TiedGroup& g : tied) {  // a replica of home `layer`: where the group's layers are without it
        if (!part.replica || g.home != part.layer || holds(p, g.home)) continue;
        for (int layer : g.layers) wanted |= holds(p, layer);
      }
      if (!wanted) continue;
      const uint32_t key_bytes = static_cast<uint32_t>(part.key.size());
      const uint64_t n = part.values.size();
      std::string& o = out[static_cast<size_t>(p)];
      o.append(reinterpret_cast<const char*>(&key_bytes), sizeof key_bytes).append(part.key);
      o.append(reinterpret_cast<const char*>(&n), sizeof n);
      o.append(reinterpret_cast<const char*>(part.values.data()), n * sizeof(float));
    }
  }
  // The sizes first, then the parts.
  std::vector<int64_t> send_sizes(static_cast<size_t>(P)), recv_sizes(static_cast<size_t>(P));
  std::vector<int> eight(static_cast<size_t>(P), 8), at8(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    send_sizes[static_cast<size_t>(p)] = static_cast<int64_t>(out[static_cast<size_t>(p)].size());
    at8[static_cast<size_t>(p)] = 8 * p;
  }
  Communicator::Request sized = pp.ialltoallv(reinterpret_cast<const uint8_t*>(send_sizes.data()), eight, at8,
                                              reinterpret_cast<uint8_t*>(recv_sizes.data()), eight, at8);
  pp.wait(sized);
  std::vector<int> send_counts(static_cast<size_t>(P)), send_displs(static_cast<size_t>(P)),
      recv_counts(static_cast<size_t>(P)), recv_displs(static_cast<size_t>(P));
  std::string send;
  int64_t received = 0;
  ResidualMoveStats stats;
  for (int p = 0; p < P; ++p) {
    const size_t i = static_cast<size_t>(p);
    check(static_cast<int64_t>(send.size()) + send_sizes[i] < (int64_t{1} << 31) && received + recv_sizes[i] < (int64_t{1} << 31),
          "re-cut: more than 2 GiB of compression residuals to move between two ranks in one exchange");
    send_displs[i] = static_cast<int>(send.size());
    send_counts[i] = static_cast<int>(send_sizes[i]);
    send += out[i];
    recv_displs[i] = static_cast<int>(received);
    recv_counts[i] = static_cast<int>(recv_sizes[i]);
    received += recv_sizes[i];
    if (p != pp.rank()) stats.bytes_sent += send_sizes[i];
  }
  std::vector<uint8_t> recv(static_cast<size_t>(received));
  Communicator::Request moved = pp.ialltoallv(reinterpret_cast<const uint8_t*>(send.data()), send_counts, send_displs,
                                              recv.data(), recv_counts, recv_displs);
  pp.wait(moved);
  std::vector<GradSync::ResidualPart> parts;
  for (size_t at = 0; at < recv.size();) {
    GradSync::ResidualPart part;
    uint32_t key_bytes = 0;
    uint64_t n = 0;
    std::memcpy(&key_bytes, recv.data() + at, sizeof key_bytes);
    at += sizeof key_bytes;
    part.key.assign(reinterpret_cast<const char*>(recv.data() + at), key_bytes);
    at += key_bytes;
    std::memcpy(&n, recv.data() + at, sizeof n);
    at += sizeof n;
    part.values.resize(n);
    std::memcpy(part.values.data(), recv.data() + at, n * sizeof(float));
    at += n * sizeof(float);
    parts.push_back(std::move(part));
  }
  double figures[2] = {static_cast<double>(to.restore_residual_parts(parts)), static_cast<double>(to.num_compressed_buckets())};
  groups.world().allreduce_sum(figures, 2);
  stats.buckets = static_cast<int>(figures[0]);
  stats.of = static_cast<int>(figures[1]);
  stats.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace keel::pipeline
