#include "comm/grad_sync.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"

namespace keel {

namespace {
double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

bool same_codec(const CodecParams& a, const CodecParams& b) {
  return a.kind == b.kind && a.keep == b.keep && a.block == b.block;
}

// ZeRO-2: the elements of a bucket's reduce-scatter each rank of its group receives, and where
// rank `rank`'s part lies (with sharded experts an expert bucket's group is its holders, by the
// partition's expert tiling).
struct ScatterShares {
  std::vector<int> counts;
  int64_t own_offset = 0, own_count = 0;
};
ScatterShares scatter_shares(const ChunkPartition& to, int rank, int64_t offset, int64_t numel, bool expert) {
  ScatterShares s;
  s.counts = to.intersect(offset, numel, expert);
  s.own_offset = std::max(offset, (expert ? to.expert_begin : to.begin)[static_cast<size_t>(rank)]);
  s.own_count = s.counts[static_cast<size_t>(rank)];
  return s;
}
}  // namespace

GradSync::GradSync(Communicator& comm, ChunkStore& store, GradSyncOptions options)
    : comm_(comm), store_(store), options_(std::move(options)), scatter_to_(options_.scatter_to), bf16_(options_.bf16) {
  check(bf16_ == nullptr || options_.codecs.empty(), "gradient sync: bf16 gradients with a codec");
  const std::vector<Chunk>& chunks = store.chunks();
  const bool compression = !options_.codecs.empty();
  check(!compression || options_.codecs.size() == chunks.size(), "gradient sync: one codec per chunk expected");
  check(!compression || scatter_to_ == nullptr, "gradient sync: compressed sync cannot reduce-scatter (ZeRO-2)");
  const int P = options_.expert_group;
  check(P == 1 || comm.size() % P == 0, "gradient sync: a group size not a multiple of " + std::to_string(P));
  // (ZeRO-2 with sharded experts reduce-scatters each expert bucket over its holders: the
  // partition must share the expert chunks out over them.)
  check(P == 1 || scatter_to_ == nullptr || scatter_to_->expert_group == P,
        "gradient sync: sharded experts with a reduce-scatter to owners that hold every expert");
  // Collective over the data group: the ranks holding the same experts (consecutive groups of P).
  if (P > 1 && comm.size() > P) expert_replicas_ = comm.split(comm.rank() % P, comm.rank() / P);
  const int64_t bucket_floats = std::max<int64_t>(1, options_.bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // Walk chunks from the end of the flat space (the last layers: produced first by backward).
  // With compression, a bucket ends where the codec or the layer changes too.
  int64_t end = store.numel();
  Bucket current;
  bool open = false;
  std::map<std::pair<int, bool>, int> per_layer;  // buckets so far of each layer (and replica flag)
  for (int c = static_cast<int>(chunks.size()) - 1; c >= 0; --c) {
    if (!open) {
      current = Bucket{};
      current.ready_layer = chunks[c].layer;
      current.layer = chunks[c].layer;
      current.top_layer = chunks[c].layer;
      current.replica = chunks[c].replica;
      current.expert = P > 1 && chunks[c].expert >= 0;
      if (compression) current.codec = options_.codecs[c];
      open = true;
    }
    current.offset = chunks[c].offset;
    current.ready_layer = std::min(current.ready_layer, chunks[c].layer);
    // Holes: the chunk's elements after each segment up to the next segment, or to the bucket's
    // end (alignment padding inside and after the chunk).
    {
      const std::vector<Segment>& segs = chunks[c].segments;
      const int64_t limit = c + 1 < static_cast<int>(chunks.size()) ? std::min(end, chunks[c + 1].offset) : end;
      int64_t at = chunks[c].offset;
      for (const Segment& s : segs) {
        if (s.offset > at) current.gaps.emplace_back(at, s.offset);
        at = s.offset + s.numel;
      }
      if (limit > at) current.gaps.emplace_back(at, limit);
    }
    const bool cut = c > 0 && std::any_of(options_.cut_layers.begin(), options_.cut_layers.end(), [&](int l) {
      return chunks[c - 1].layer < l && chunks[c].layer >= l;
    });
    const bool boundary = c == 0 || cut || (P > 1 && (chunks[c - 1].expert >= 0) != (chunks[c].expert >= 0)) ||
                          (compression && (chunks[c - 1].layer != chunks[c].layer ||
                                           !same_codec(options_.codecs[c - 1], options_.codecs[c])));
    if (end - current.offset >= bucket_floats || boundary) {
      current.numel = end - current.offset;
      // (An expert bucket is compressed over the ranks holding its experts, with its own error
      // feedback; held by this rank alone, it is never summed.)
      Communicator& over = current.expert && expert_replicas_ ? *expert_replicas_ : comm;
      if (current.codec.kind != CodecKind::none && over.size() > 1 && (!current.expert || expert_replicas_)) {
        current.codec_impl = Codec::make(current.codec);
        current.comm = over.duplicate();
        current.reducer = std::make_unique<CompressedAllreduce>(*current.comm, *current.codec_impl,
                                                                static_cast<size_t>(current.numel), options_.shape);
      }
      current.index = per_layer[{current.layer, current.replica}]++;
      buckets_.push_back(std::move(current));
      end = buckets_.back().offset;
      open = false;
    }
  }
}

GradSync::~GradSync() = default;

int GradSync::num_compressed_buckets() const {
  int n = 0;
  for (const Bucket& b : buckets_) n += b.reducer != nullptr;
  return n;
}

void GradSync::begin(bool sync, int64_t step) {
  active_ = sync && comm_.size() > 1;
  next_ = 0;
  step_ = step;
  stats_ = SyncStats{};
  for (Bucket& b : buckets_) {
    b.request = Communicator::Request{};
    b.settled = true;
    b.compressed_now = false;
    b.held_now = true;
    for (int l = b.ready_layer; b.held_now && l <= b.top_layer; ++l) b.held_now = held(l);
    // Sharded experts held by this rank alone (data == P): nothing to sum.
    if (b.expert && expert_replicas_ == nullptr) b.held_now = true;
    if (b.reducer) b.reducer->reset_stats();
  }
}

void GradSync::progress() {
  for (size_t i = 0; i < next_; ++i) {
    Bucket& b = buckets_[i];
    if (b.settled) continue;
    if (b.compressed_now ? b.reducer->test() : comm_of(b).test(b.request)) settle(b);
  }
}

// Waits for the bucket's sum and settles it.
void GradSync::complete(Bucket& b) {
  if (b.compressed_now) {
    b.reducer->wait();
  } else {
    comm_of(b).wait(b.request);
  }
  settle(b);
}

void GradSync::settle(Bucket& b) {
  b.settled = true;
  if (bf16_ != nullptr) {
    if (scatter_to_ != nullptr) {
      uint16_t* base = bf16_->bits(Plane::grad, b.offset);
      if (b.own_count > 0 && b.own_offset != b.offset) {
        std::memmove(base + (b.own_offset - b.offset), base, static_cast<size_t>(b.own_count) * sizeof(uint16_t));
      }
      const int64_t own_end = b.own_count > 0 ? b.own_offset + b.own_count : b.offset;
      const int64_t own_begin = b.own_count > 0 ? b.own_offset : b.offset;
      store_.discard(Plane::grad, b.offset, own_begin - b.offset);
      store_.discard(Plane::grad, own_end, b.offset + b.numel - own_end);
    }
    // The sums are new bytes of these pages.
    for (const Chunk& c : store_.chunks_overlapping(b.offset, b.numel)) bf16_->bits_written({c.id, Plane::grad});
    return;
  }
  if (b.compressed_now) {
    for (const auto& [begin, end] : b.gaps) {
      std::span<float> g = store_.range_view(Plane::grad, begin, end - begin);
      std::fill(g.begin(), g.end(), 0.0f);
    }
  }
  if (scatter_to_ == nullptr) {
    b.lease.end();
    return;
  }
  // MPI leaves this rank's sum at the start of the bucket; move it where it belongs, then let go
  // of everything else in the bucket.
  float* base = store_.range_view(Plane::grad, b.offset, b.numel).data();
  if (b.own_count > 0 && b.own_offset != b.offset) {
    std::memmove(base + (b.own_offset - b.offset), base, static_cast<size_t>(b.own_count) * sizeof(float));
  }
  const int64_t own_end = b.own_count > 0 ? b.own_offset + b.own_count : b.offset;
  const int64_t own_begin = b.own_count > 0 ? b.own_offset : b.offset;
  store_.discard(Plane::grad, b.offset, own_begin - b.offset);
  store_.discard(Plane::grad, own_end, b.offset + b.numel - own_end);
  b.lease.end();  // after the moves and discards: with tiers they happen to pinned pages
}

void GradSync::after_backward_input(int) {
  if (active_) progress();
}

void GradSync::after_backward_weight(int layer) {
  if (!active_) return;
  // Layers finish in descending order, so a bucket whose lowest layer is done is complete.
  while (next_ < buckets_.size() && buckets_[next_].ready_layer >= layer) {
    Bucket& b = buckets_[next_];
    if (b.held_now) {  // not synced this step: nothing to send, nothing to wait for
      next_++;
      continue;
    }
    if (stats_.buckets == 0) first_start_ = std::chrono::steady_clock::now();
    if (max_in_flight_bytes_ > 0) {
      int64_t pinned = 0;
      for (size_t i = 0; i < next_; ++i)
        if (!buckets_[i].settled) pinned += buckets_[i].numel * 4;
      for (size_t i = 0; i < next_ && pinned > 0 && pinned + b.numel * 4 > max_in_flight_bytes_; ++i) {
        if (buckets_[i].settled) continue;
        complete(buckets_[i]);
        pinned -= buckets_[i].numel * 4;
      }
    }
    if (bf16_ != nullptr) {  // bf16 gradients: the bits are summed in place (every W of the bucket is done)
      uint16_t* bits = bf16_->bits(Plane::grad, b.offset);
      if (scatter_to_ == nullptr) {
        b.request = comm_of(b).iallreduce_sum_bf16(bits, static_cast<size_t>(b.numel));
      } else {
        Communicator& over = comm_of(b);
        const ScatterShares shares = scatter_shares(*scatter_to_, over.rank(), b.offset, b.numel, b.expert);
        b.own_offset = shares.own_offset;
        b.own_count = shares.own_count;
        b.request = over.ireduce_scatter_sum_bf16(bits, shares.counts);
      }
      b.compressed_now = false;
      b.settled = false;
      stats_.payload_bytes += static_cast<double>(b.numel) * sizeof(uint16_t);
      stats_.buckets++;
      next_++;
      continue;
    }
    // With memory tiers the bucket's gradient pages stay present until its sum is in place.
    b.lease = store_.use_range(Plane::grad, b.offset, b.numel, /*write=*/true);
    float* data = store_.range_view(Plane::grad, b.offset, b.numel).data();
    b.compressed_now = b.reducer != nullptr && step_ >= options_.warmup_steps;
    if (b.compressed_now) {
      // The codecs' random choices: the same on every rank for a (seed, step, bucket).
      uint64_t x = options_.seed ^ (static_cast<uint64_t>(step_) * 0x9E3779B97F4A7C15ull) ^
                   (static_cast<uint64_t>(next_) * 0xD1B54A32D192ED03ull);
      b.reducer->start(data, splitmix64(x));
    } else if (scatter_to_ == nullptr) {
      b.request = comm_of(b).iallreduce_sum(data, static_cast<size_t>(b.numel));
    } else {
      Communicator& over = comm_of(b);
      const ScatterShares shares = scatter_shares(*scatter_to_, over.rank(), b.offset, b.numel, b.expert);
      b.own_offset = shares.own_offset;
      b.own_count = shares.own_count;
      b.request = over.ireduce_scatter_sum(data, shares.counts);
    }
    b.settled = false;
    stats_.payload_bytes += static_cast<double>(b.numel) * sizeof(float);
    stats_.buckets++;
    next_++;
  }
  progress();
}

void GradSync::finish() {
  if (!active_) return;
  // Any bucket not started yet (e.g. a backward that skipped a layer's hook) starts now.
  while (next_ < buckets_.size()) after_backward_weight(-1);
  const auto t0 = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) {
    if (b.compressed_now) {
      b.reducer->wait();
    } else {
      comm_of(b).wait(b.request);
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) {
    if (!b.settled) settle(b);
  }
  stats_.exposed_ms = ms_between(t0, t1);
  stats_.latency_ms = ms_between(first_start_, t1);
  const double n = comm_.size();
  // Ring algorithms: all-reduce sends 2 (N-1)/N of the payload, reduce-scatter (N-1)/N.
  const double ring = (scatter_to_ != nullptr ? 1.0 : 2.0) * (n - 1) / n;
  // (bf16 gradients: the payload is 2 bytes an element; a plain float32 ring would send twice that.)
  stats_.uncompressed_bytes = stats_.payload_bytes * ring * (bf16_ != nullptr ? 2.0 : 1.0);
  std::map<int, LayerSyncStats> layers;
  std::map<int, double> codec_share;  // raw bytes of the layer's largest codec so far
  double uncompressed = 0;            // (sharded experts: each bucket's ring over its own group)
  for (const Bucket& b : buckets_) {
    if (b.held_now) continue;
    const double raw = static_cast<double>(b.numel) * sizeof(float);
    // (An expert bucket's ring is its replicas'.)
    const double nb = comm_of(b).size();
    const double ring_b = b.expert ? (scatter_to_ != nullptr ? 1.0 : 2.0) * (nb - 1) / nb : ring;
    double wire = raw * ring_b * (bf16_ != nullptr ? 0.5 : 1.0);
    uncompressed += raw * ring_b;
    if (b.compressed_now) {
      const CompressionStats& cs = b.reducer->stats();
      wire = cs.wire_bytes;
      stats_.encode_ms += cs.encode_ms;
      stats_.decode_ms += cs.decode_ms;
      stats_.compressed = true;
    }
    stats_.sent_bytes += wire;
    if (!compression_configured()) continue;
    LayerSyncStats& l = layers[b.layer];
    l.layer = b.layer;
    l.raw_bytes += raw;
    l.wire_bytes += wire;
    if (raw > codec_share[b.layer]) {
      codec_share[b.layer] = raw;
      l.codec = b.compressed_now ? b.codec.kind : CodecKind::none;
    }
  }
  for (auto& [layer, l] : layers) stats_.layers.push_back(l);
  if (options_.expert_group > 1) stats_.uncompressed_bytes = uncompressed;
  active_ = false;
}

size_t GradSync::residual_size() const {
  size_t n = 0;
  for (const Bucket& b : buckets_) {
    if (b.reducer) n += b.reducer->worker_residual().size() + b.reducer->server_residual().size();
  }
  return n;
}

void GradSync::copy_residuals(std::vector<float>& out) const {
  out.resize(residual_size());
  size_t at = 0;
  for (const Bucket& b : buckets_) {
    if (!b.reducer) continue;
    for (std::span<const float> r : {b.reducer->worker_residual(), b.reducer->server_residual()}) {
      std::copy(r.begin(), r.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
      at += r.size();
    }
  }
}

void GradSync::restore_residuals(std::span<const float> in) {
  check(in.size() == residual_size(), "gradient sync: " + std::to_string(in.size()) + " residual values, expected " +
                                          std::to_string(residual_size()));
  size_t at = 0;
  for (Bucket& b : buckets_) {
    if (!b.reducer) continue;
    for (std::span<float> r : {b.reducer->worker_residual(), b.reducer->server_residual()}) {
      std::copy(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + r.size()),
                r.begin());
      at += r.size();
    }
  }
}

std::string GradSync::key_of(const Bucket& b) const {
  std::ostringstream s;
  s << 'L' << b.layer << (b.replica ? "r" : "") << '#' << b.index << ':' << b.reducer->worker_residual().size() << '+'
    << b.reducer->server_residual().size() << ':' << codec_name(b.codec.kind) << '/' << b.codec.keep << '/'
    << b.codec.block << ":D" << comm_.size();
  // A sharded expert bucket's residuals are its experts': named by the first (another expert
  // group size deals other experts to the rank, whose buckets then match no saved key).
  if (b.expert) {
    s << ":X" << store_.chunks_overlapping(b.offset, b.numel).front().expert << "/" << expert_replicas_->size();
  }
  return s.str();
}

std::string GradSync::residual_keys() const {
  std::string out;
  for (const Bucket& b : buckets_) {
    if (b.reducer) out += (out.empty() ? "" : ";") + key_of(b);
  }
  return out;
}

std::vector<GradSync::ResidualPart> GradSync::residual_parts() const {
  std::vector<ResidualPart> out;
  for (const Bucket& b : buckets_) {
    if (!b.reducer) continue;
    ResidualPart p{b.layer, b.replica, key_of(b), {}};
    for (std::span<const float> r : {b.reducer->worker_residual(), b.reducer->server_residual()}) {
      p.values.insert(p.values.end(), r.begin(), r.end());
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<GradSync::ResidualPart> GradSync::split_residuals(const std::string& keys, std::span<const float> flat) {
  std::vector<ResidualPart> out;
  std::istringstream in(keys);
  std::string key;
  size_t at = 0;
  while (std::getline(in, key, ';')) {
    ResidualPart p;
    p.key = key;
    size_t worker = 0, server = 0;
    char replica = 0;
    int n = 0;
    const bool parsed = std::sscanf(key.c_str(), "L%d%n", &p.layer, &n) == 1 &&
                        ((replica = key[static_cast<size_t>(n)]) == '#' || replica == 'r') &&
                        std::sscanf(key.c_str() + key.find(':'), ":%zu+%zu:", &worker, &server) == 2;
    check(parsed && key.find(':') != std::string::npos, "compression residual keys: cannot read \"" + key + "\"");
    p.replica = replica == 'r';
    check(at + worker + server <= flat.size(), "compression residual keys: \"" + key + "\" runs past the " +
                                                   std::to_string(flat.size()) + " values saved");
    p.values.assign(flat.begin() + static_cast<std::ptrdiff_t>(at),
                    flat.begin() + static_cast<std::ptrdiff_t>(at + worker + server));
    at += worker + server;
    out.push_back(std::move(p));
  }
  check(at == flat.size(), "compression residual keys: they describe " + std::to_string(at) + " values, " +
                               std::to_string(flat.size()) + " were saved");
  return out;
}

int GradSync::restore_residual_parts(std::vector<ResidualPart>& parts) {
  std::map<std::string, ResidualPart*> by_key;
  for (ResidualPart& p : parts) by_key[p.key] = &p;
  int filled = 0;
  for (Bucket& b : buckets_) {
    if (!b.reducer) continue;
    const auto it = by_key.find(key_of(b));
    if (it == by_key.end()) continue;
    const std::vector<float>& v = it->second->values;
    const size_t w = b.reducer->worker_residual().size();
    std::copy(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(w), b.reducer->worker_residual().begin());
    std::copy(v.begin() + static_cast<std::ptrdiff_t>(w), v.end(), b.reducer->server_residual().begin());
    filled++;
  }
  return filled;
}

std::string GradSync::residual_layout() const {
  std::ostringstream s;
  s << "world " << comm_.size() << ", buckets";
  for (const Bucket& b : buckets_) {
    if (!b.reducer) continue;
    s << ' ' << b.offset << '+' << b.numel << ':' << codec_name(b.codec.kind) << '/' << b.codec.keep << '/'
      << b.codec.block;
  }
  return s.str();
}

}  // namespace keel
