#include "comm/sharded_params.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "core/error.h"
#include "store/bf16_state.h"
#include "store/placement.h"

namespace keel {

void validate_zero3_config(const Config& c, int data_ranks) {
  if (c.parallel.zero != 3 || data_ranks < 2) return;
  // Each of these is later work, refused rather than silently replicated.
  auto refuse = [](bool refused, const std::string& key, const std::string& found) {
    if (refused) {
      throw Error("config key '" + key + "': expected its default with parallel.zero = 3 (not yet supported together), "
                  "found " + found);
    }
  };
  // Inside a pipeline each stage's replicas shard that stage's chunks; what moves a stage's whole
  // planes between steps (a re-cut's migration, the gradient predictor's deferred weight gradients)
  // is not built over shards.
  refuse(c.parallel.pipeline > 1 && c.parallel.predict_gradients != PredictGradients::off, "parallel.predict_gradients",
         "\"" + std::string(to_string(c.parallel.predict_gradients)) + "\"");
  refuse(c.parallel.pipeline > 1 && c.parallel.repartition_every > 0, "parallel.repartition_every",
         std::to_string(c.parallel.repartition_every));
  refuse(c.sync.codec != SyncCodec::none, "sync.codec", "\"" + std::string(to_string(c.sync.codec)) + "\"");
  refuse(c.clip.enabled(), "[clip]", "a dual encoder");
  refuse(c.checkpoint.memory_every > 0, "checkpoint.memory_every", std::to_string(c.checkpoint.memory_every));
}

ShardedParams::ShardedParams(Communicator& dp, ChunkStore& store, const ChunkPartition& owners, Zero3Keep keep,
                             bool progress_thread)
    : comm_(dp.duplicate()), store_(store), inner_(&store.residency()), owners_(owners), keep_(keep) {
  const int n = static_cast<int>(store_.chunks().size());
  if (owners_.experts_apart()) {
    // The chunks this rank owns (of no expert by the data group's tiling, its experts' by their
    // holders'), their span as the parameter home, and the holders' communicator.
    own_.assign(static_cast<size_t>(n), 0);
    own_first_ = n;
    own_last_ = 0;
    for (const Chunk& c : store_.chunks()) {
      if (!owners_.owns(dp.rank(), c)) continue;
      own_[static_cast<size_t>(c.id)] = 1;
      own_first_ = std::min(own_first_, c.id);
      own_last_ = c.id + 1;
      shard_bytes_ += extent(c.id) * static_cast<int64_t>(sizeof(float));
    }
    own_first_ = std::min(own_first_, own_last_);
    const int P = owners_.expert_group;
    if (dp.size() > P) holders_ = comm_->split(dp.rank() % P, dp.rank() / P);
  } else {
    own_first_ = owners_.first_chunk[dp.rank()];
    own_last_ = owners_.first_chunk[dp.rank() + 1];
    shard_bytes_ = owners_.size(dp.rank()) * static_cast<int64_t>(sizeof(float));
  }
  last_layer_ = n > 0 ? store_.chunks().back().layer : 0;
  // From the start a rank holds its own chunks only: the weights are drawn or loaded into them
  // alone (ChunkStore::home_params), never whole (experts apart: into their span, see settled()).
  store_.home_params(own_first_, own_last_, own_);  // (experts apart: the own ones among them, for the memory tiers)
  gathered_.assign(static_cast<size_t>(n), 0);
  pins_.assign(static_cast<size_t>(n), 0);
  double figures[3] = {static_cast<double>(shard_bytes_), static_cast<double>(largest_layer_gather_bytes()),
                       static_cast<double>(largest_layer_bytes())};
  comm_->allreduce_max(figures, 3);
  for (int f = 0; f < 3; ++f) group_max_[f] = static_cast<int64_t>(figures[f]);
  store_.attach_residency(this);
  if (progress_thread && dp.size() > 1 && Communicator::threads_may_call()) progress_ = std::thread([this] { progress_loop(); });
}

ShardedParams::~ShardedParams() {
  if (progress_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    progress_.join();
  }
  store_.attach_residency(nullptr);
}

void ShardedParams::wrap_attached() {
  if (&store_.residency() == this) return;
  inner_ = &store_.residency();
  store_.attach_residency(this);
}

int ShardedParams::hint(std::span<const PageRef> pages) {
  std::vector<PageRef> mine;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param || own(p.chunk) || gathered_[p.chunk]) mine.push_back(p);
  }
  return inner_->hint(mine);
}

void ShardedParams::progress_loop() {
  // Tests only (MPI_Test on this object's own communicator); every broadcast is started and
  // finally waited for by the main thread, in the same order on every rank.
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    bool pending = false;
    for (Communicator::Request& r : ahead_) pending = !comm_->test(r) || pending;
    if (pending) {
      wake_.wait_for(lock, std::chrono::microseconds(200));
    } else {
      wake_.wait(lock);
    }
  }
}

int64_t ShardedParams::extent(int chunk) const {
  const std::vector<Chunk>& chunks = store_.chunks();
  const int64_t end = chunk + 1 < static_cast<int>(chunks.size()) ? chunks[chunk + 1].offset : store_.numel();
  return end - chunks[chunk].offset;
}

Communicator& ShardedParams::comm_of(int chunk) const {
  return owners_.experts_apart() && store_.chunks()[chunk].expert >= 0 ? *holders_ : *comm_;
}

int ShardedParams::root_of(int chunk) const {
  return owners_.experts_apart() && store_.chunks()[chunk].expert >= 0 ? owners_.expert_holder(chunk)
                                                                        : owners_.owner(chunk);
}

int64_t ShardedParams::whole_bytes() const { return store_.numel() * static_cast<int64_t>(sizeof(float)); }

void ShardedParams::give_back(int chunk) {
  gathered_[chunk] = 0;
  if (own(chunk)) return;  // its home: the bytes stay
  inner_->discard(Plane::param, store_.chunks()[chunk].offset, extent(chunk));
  gathered_bytes_ -= extent(chunk) * element_bytes();
}

void ShardedParams::settled() {
  check(gathered_bytes_ == 0, "ZeRO-3: other ranks' parameters gathered before the weights were settled");
  started_ = true;
  if (bits_ == nullptr && !own_.empty()) {
    // Experts apart: the weights were drawn or loaded into the home's span; the pages of the
    // chunks in it that other ranks own go back (a page shared with an own chunk is zeroed in part).
    for (int c = own_first_; c < own_last_; ++c) {
      if (!own(c)) inner_->discard(Plane::param, store_.chunks()[c].offset, extent(c));
    }
  }
  if (bits_ == nullptr) return;
  // The bf16 state's settling made bits for every chunk (other ranks' zero): give theirs back, so
  // that a rank holds its own chunks' bits and the gathered ones.
  for (int c = 0; c < static_cast<int>(gathered_.size()); ++c) {
    if (!own(c)) inner_->discard(Plane::param, store_.chunks()[c].offset, extent(c));
  }
}

void ShardedParams::drop_gathered() {
  check(std::all_of(pins_.begin(), pins_.end(), [](int p) { return p == 0; }),
        "ZeRO-3: parameters dropped while a layer still uses them");
  if (!started_) return;
  wait_ahead();
  for (int c = 0; c < static_cast<int>(gathered_.size()); ++c) {
    if (gathered_[c]) give_back(c);
  }
  whole_ = false;
}

void ShardedParams::begin_pass(LeasePass pass) {
  // (A pass that leased nothing leaves its kind's schedule as it was.)
  if (!this_round_.empty()) last_round_[static_cast<int>(pass_)] = std::move(this_round_);
  this_round_.clear();
  pass_ = pass;
}

void ShardedParams::gather_whole() {
  if (!started_) return;
  wait_ahead();
  if (bits_ != nullptr || inner_->always_present()) {  // the bits, or the whole plane, are always here
    std::vector<PageRef> all;
    for (int c = 0; c < static_cast<int>(gathered_.size()); ++c) all.push_back({c, Plane::param});
    gather(all);
    whole_ = true;
    return;
  }
  // Chunk by chunk, each under a lease while its broadcast writes it (where pages move, the
  // whole plane is never present at once; the tiers keep the gathered bytes as written).
  for (int c = 0; c < static_cast<int>(gathered_.size()); ++c) {
    const PageRef page{c, Plane::param};
    inner_->acquire({&page, 1});
    gather({&page, 1});
    inner_->release({&page, 1}, /*modified=*/false);
  }
  whole_ = true;
}

void ShardedParams::wait_ahead() {
  std::vector<Communicator::Request> ahead;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ahead.swap(ahead_);
  }
  for (Communicator::Request& r : ahead) comm_->wait(r);
  written(ahead_chunks_);
  ahead_chunks_.clear();
  ahead_bytes_ = 0;
}

void ShardedParams::written(const std::vector<int>& chunks) {
  // A gather wrote these pages (other ranks' chunks): their version moves on, so that whatever
  // was derived from their earlier bytes (a bf16 copy) is known stale, and a tier that evicts
  // them keeps these bytes. Where pages move the caller holds them leased: that lease ends as
  // modified and is taken again (the tiers check a page's bytes against its version at a lease).
  std::vector<PageRef> pages;
  for (int c : chunks) {
    if (!own(c)) pages.push_back({c, Plane::param});
  }
  if (pages.empty()) return;
  if (bits_ != nullptr) {  // the bits were written, with no lease of their pages open
    for (const PageRef& p : pages) bits_->bits_written(p);
    return;
  }
  inner_->release(pages, /*modified=*/true);
  inner_->acquire(pages);
}

void ShardedParams::count_gather(int chunk) {
  gathered_[chunk] = 1;
  if (own(chunk)) return;
  gathered_bytes_ += extent(chunk) * element_bytes();
  (pass_ == LeasePass::evaluation ? peaks_.evaluation_received_bytes : peaks_.received_bytes) +=
      extent(chunk) * element_bytes();
}

bool ShardedParams::alone(int chunk) const {
  return owners_.experts_apart() && store_.chunks()[chunk].expert >= 0 && holders_ == nullptr;
}

Communicator::Request ShardedParams::start_gather(int chunk) {
  count_gather(chunk);
  if (alone(chunk)) return {};  // (its one holder is this rank: nothing to broadcast)
  const int64_t n = extent(chunk);
  float* at = store_.range_view(Plane::param, store_.chunks()[chunk].offset, n).data();
  return comm_of(chunk).ibroadcast(at, static_cast<size_t>(n), root_of(chunk));
}

void ShardedParams::start_ahead(const std::vector<int>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int c : chunks) {
      if (gathered_[c]) continue;
      if (!own(c)) ahead_bytes_ += extent(c) * static_cast<int64_t>(sizeof(float));
      ahead_.push_back(start_gather(c));
      ahead_chunks_.push_back(c);
    }
  }
  wake_.notify_one();
  peaks_.ahead_bytes = std::max(peaks_.ahead_bytes, ahead_bytes_);
}

void ShardedParams::gather(std::span<const PageRef> pages) {
  // Every rank reaches here with the same pages and the same gathered_ flags: the same
  // broadcasts, started together (one per chunk, from its owner) and then waited for. The ones
  // started ahead were started in the same order on every rank, and are all waited for first.
  wait_ahead();
  std::vector<Communicator::Request> requests;
  std::vector<int> chunks;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param || gathered_[p.chunk]) continue;
    chunks.push_back(p.chunk);
    if (bits_ == nullptr) {
      requests.push_back(start_gather(p.chunk));
      continue;
    }
    // bf16 bits: one blocking broadcast per chunk, in the same order on every rank.
    count_gather(p.chunk);
    if (alone(p.chunk)) continue;
    comm_of(p.chunk).broadcast(bits_->bits(Plane::param, store_.chunks()[p.chunk].offset),
                               static_cast<size_t>(extent(p.chunk)), root_of(p.chunk));
  }
  for (Communicator::Request& r : requests) comm_->wait(r);
  written(chunks);
  note_peaks();
}

void ShardedParams::note_peaks() {
  // After a gather's waits a rank's resident parameters are its shard plus what is gathered, so
  // their peak can only move where the gathered bytes reach a new level: measure (mincore over the
  // whole plane) there only, not after every layer.
  if (gathered_bytes_ <= peaks_.gathered_bytes && peaks_.resident_bytes > 0) return;
  peaks_.gathered_bytes = gathered_bytes_;
  peaks_.resident_bytes = std::max(peaks_.resident_bytes, store_.resident_bytes(Plane::param));
}

ShardedParams::Peaks ShardedParams::take_peaks() {
  Peaks out = peaks_;
  peaks_ = {};
  return out;
}

namespace {

// The largest of a lease's float32 bytes by layer (`by_layer`): with a head tied to the embedding
// (no lm_head.w of its own) the head's lease holds the embedding's (layer 0) at the same time.
int64_t largest_lease(const ChunkStore& store, const std::vector<int64_t>& by_layer) {
  const int64_t largest = *std::max_element(by_layer.begin(), by_layer.end());
  const bool tied = std::none_of(store.tensors().begin(), store.tensors().end(),
                                 [](const TensorInfo& t) { return t.spec.name == "lm_head.w"; });
  return tied ? std::max(largest, by_layer.front() + by_layer.back()) : largest;
}

}  // namespace

int64_t ShardedParams::largest_layer_gather_bytes() const {
  std::vector<int64_t> by_layer(static_cast<size_t>(last_layer_ + 1), 0);
  for (const Chunk& c : store_.chunks()) {
    if (!own(c.id)) by_layer[static_cast<size_t>(c.layer)] += extent(c.id) * static_cast<int64_t>(sizeof(float));
  }
  return largest_lease(store_, by_layer);
}

int64_t ShardedParams::largest_layer_bytes() const {
  std::vector<int64_t> by_layer(static_cast<size_t>(last_layer_ + 1), 0);
  for (const Chunk& c : store_.chunks()) {
    by_layer[static_cast<size_t>(c.layer)] += extent(c.id) * static_cast<int64_t>(sizeof(float));
  }
  return largest_lease(store_, by_layer);
}

void ShardedParams::acquire(std::span<const PageRef> pages) {
  // One rank's own use (the optimizer's chunk, a checkpoint's, drawing or loading the weights):
  // another rank's parameters are here only while gathered (experts apart: or drawn or loaded
  // into the home's span, before the weights settled).
  for (const PageRef& p : pages) {
    const bool homing = !started_ && !own_.empty() && p.chunk >= own_first_ && p.chunk < own_last_;
    if (p.plane == Plane::param && !own(p.chunk) && !gathered_[p.chunk] && !homing) {
      // (An expert chunk's holder q, experts apart, is data rank q P + this rank's place in its expert group.)
      const int P = owners_.expert_group;
      const bool expert = owners_.experts_apart() && store_.chunks()[p.chunk].expert >= 0;
      const int data_rank = expert ? root_of(p.chunk) * P + comm_->rank() % P : root_of(p.chunk);
      throw Error("ZeRO-3: chunk " + std::to_string(p.chunk) + "'s parameters live on data-parallel rank " +
                  std::to_string(data_rank) + ", and this rank used them outside a layer's pass");
    }
  }
  inner_->acquire(pages);
}

bool ShardedParams::experts_only(std::span<const PageRef> pages) const {
  bool any = false;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param) continue;
    if (store_.chunks()[p.chunk].expert < 0) return false;
    any = true;
  }
  return any;
}

void ShardedParams::gather_apart(std::span<const PageRef> pages) {
  check(bits_ == nullptr, "ZeRO-3: an expert gathered apart from its layer under bf16 working parameters");
  std::vector<Communicator::Request> requests;
  std::vector<int> chunks;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param || gathered_[p.chunk]) continue;
    chunks.push_back(p.chunk);
    requests.push_back(start_gather(p.chunk));
  }
  for (Communicator::Request& r : requests) comm_->wait(r);
  written(chunks);
  note_peaks();
}

bool ShardedParams::alone_only(std::span<const PageRef> pages) const {
  bool any = false;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param) continue;
    if (!alone(p.chunk)) return false;
    any = true;
  }
  return any;
}

void ShardedParams::acquire_layer(std::span<const PageRef> pages) {
  // A lease of expert chunks this rank alone holds (a MoE block's expert that rows were sent to,
  // data = P: comm/expert_parallel.h experts_gathered_with_layers): its own pages, which no other
  // rank takes; not gathered, pinned or recorded among the leases every rank takes alike.
  if (alone_only(pages)) {
    inner_->acquire_layer(pages);
    return;
  }
  // A lease of expert chunks alone that several ranks hold (a MoE block's expert that rows of some
  // holder chose, leased apart from its layer: comm/expert_parallel.h gather_experts_apart): its
  // holders, having agreed on it, take the same such leases in the same order, other expert
  // groups others. Gathered over the holders (the data group where every rank holds every
  // expert), pinned as a layer's, but neither recorded among the leases every rank of the data
  // group takes alike nor waiting for the broadcasts ahead (so those still match on every rank).
  if (experts_only(pages)) {
    inner_->acquire_layer(pages);
    gather_apart(pages);
    for (const PageRef& p : pages) {
      if (p.plane == Plane::param) pins_[p.chunk]++;
    }
    return;
  }
  std::vector<int> chunks;
  for (const PageRef& p : pages) {
    if (p.plane == Plane::param) chunks.push_back(p.chunk);
  }
  // Under bf16 working parameters the broadcasts write the bits, which the lease then widens;
  // otherwise the pages are made present first (the tiers fetch this rank's own pages, and give
  // others' pages room), then the broadcasts write them.
  if (bits_ != nullptr && !chunks.empty()) gather(pages);
  inner_->acquire_layer(pages);
  if (bits_ == nullptr && !chunks.empty()) gather(pages);
  if (!chunks.empty()) {
    // On the recorded schedule: the lease that came next in the last pass of this kind, broadcast
    // ahead; not where pages move (a page not leased may be fetched over what a broadcast wrote).
    const std::vector<std::vector<int>>& last = last_round_[static_cast<int>(pass_)];
    const size_t at = this_round_.size();
    if (!whole_ && inner_->always_present() && at + 1 < last.size() && last[at] == chunks) start_ahead(last[at + 1]);
    this_round_.push_back(std::move(chunks));
  }
  for (const PageRef& p : pages) {
    if (p.plane == Plane::param) pins_[p.chunk]++;
  }
}

void ShardedParams::release_layer(std::span<const PageRef> pages, bool modified) {
  inner_->release_layer(pages, modified);
  if (alone_only(pages)) return;  // (as acquire_layer took it)
  for (const PageRef& p : pages) {
    if (p.plane != Plane::param || --pins_[p.chunk] > 0 || whole_) continue;
    const bool kept = keep_ == Zero3Keep::all || (keep_ == Zero3Keep::last && store_.chunks()[p.chunk].layer == last_layer_);
    if (!kept) give_back(p.chunk);
  }
}

}  // namespace keel
