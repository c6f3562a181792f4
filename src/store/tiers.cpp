#include "store/tiers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <xxhash.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/text.h"

namespace keel {

const char* tier_name(Tier t) { return to_string(t); }

struct TierManager::Transfer {
  uint64_t ticket = 0;
  AlignedBuffer buf;
  uint64_t version = 0;  // the version of the bytes being moved
  bool host = false;     // a host copy (HostCopier's ticket), else NVMe I/O (BlockFile's)
};

struct TierManager::Page {
  bool exists = false;
  Tier home = Tier::device;
  int64_t bytes = 0;  // the page's bytes in the flat plane
  int64_t slot = 0;   // bytes rounded up to the I/O alignment (host copies, NVMe slots, staging)
  uint64_t nvme_offset = 0;
  bool present = true;
  int pins = 0;
  uint64_t version = 0;         // the owner's version
  uint64_t device_version = 0;  // the version of the present copy
  uint64_t home_version = 0;    // the version the home copy holds
  AlignedBuffer host;           // a host-homed page's home copy
  bool home_zero = false;       // the home copy is all zero (never written): fetches memset
  bool released = false;        // its memory was given back and not touched since: it reads zero
  bool zeroed_pinned = false;   // declared zero while leased: the lease's write leaves it clean
  std::unique_ptr<Transfer> fetching, writing;
  int64_t last_use = 0;
  int64_t touched_step = -1;
  std::vector<int64_t> uses;  // positions in this step's view of the schedule, ascending
  int64_t first_use = -1;     // its first position in the recorded step (-1: none)
  bool routed = false;        // TierOptions::routed
  bool expected = false;      // a routed page a hint fetched, not acquired since (kept)
  bool transient = false;     // no slot of its own (tiers.h): zero at home, or in a scratch slot
  bool scratch = false;       // ... which holds its bytes now (nvme_offset)
  PageCounters counters;
  // tier.verify: a checksum of the bytes of version `checksum_version` (none yet: ~0).
  uint64_t checksum = 0, checksum_version = ~0ull;
};

TierManager::TierManager(ChunkStore& store, const TierOptions& options, std::vector<Tier> homes)
    : store_(store), options_(options) {
  check(store.finalized(), "tiers: the chunk store is not finalized");
  const int n_chunks = static_cast<int>(store.chunks().size());
  check(homes.size() == static_cast<size_t>(n_chunks) * kNumPlanes,
        "tiers: " + std::to_string(homes.size()) + " homes for " + std::to_string(n_chunks * kNumPlanes) + " pages");
  trace_ = std::getenv("KEEL_TIER_TRACE") != nullptr;
  check(options.lookahead >= 0, "tier.lookahead: expected >= 0, found " + std::to_string(options.lookahead));
  pages_.resize(homes.size());
  applied_early_.assign(static_cast<size_t>(n_chunks), 0);
  const auto [m_begin, m_end] = store.moment_chunks();
  // ZeRO-3 (the store homes some chunks' parameters only): the other chunks' parameter and
  // gradient pages are transient where there is an NVMe tier to spill them to.
  const bool sharded = !options.nvme_dir.empty() && store.params_homed_in_part();
  bool any_transient = false;
  int64_t device_homed = 0, host_homed = 0, nvme_bytes = 0, largest_chunk = 0, largest_slot = 0;
  for (int c = 0; c < n_chunks; ++c) {
    const Chunk& chunk = store.chunks()[c];
    largest_chunk = std::max<int64_t>(largest_chunk, chunk.numel * 4);
    for (int p = 0; p < kNumPlanes; ++p) {
      Page& pg = pages_[c * kNumPlanes + p];
      const bool moment = p >= static_cast<int>(Plane::adam_m);
      pg.exists = (!moment || (c >= m_begin && c < m_end)) && (!options.params_only || p == 0) &&
                  !((options.absent_planes >> p) & 1);
      if (!pg.exists) continue;
      pg.home = homes[c * kNumPlanes + p];
      pg.transient = sharded && p <= static_cast<int>(Plane::grad) && !store.param_homed(c);
      pg.routed = !options.routed.empty() && options.routed.at(static_cast<size_t>(c * kNumPlanes + p)) != 0;
      pg.bytes = chunk.numel * static_cast<int64_t>(sizeof(float));
      pg.slot = static_cast<int64_t>(BlockFile::align_up(pg.bytes));
      largest_slot = std::max(largest_slot, pg.slot);
      if (pg.transient) {  // homed nowhere: neither a budget nor a slot of its own
        pg.home = Tier::nvme;
        any_transient = true;
        continue;
      }
      switch (pg.home) {
        case Tier::device: device_homed += pg.bytes; break;
        case Tier::host: host_homed += pg.slot; break;
        case Tier::nvme: break;
      }
      // Slots for the NVMe-homed pages; with the adaptive policy, for every page (any may move there).
      if (pg.home == Tier::nvme || ((options.adaptive || pg.routed) && !options.nvme_dir.empty())) {
        pg.nvme_offset = static_cast<uint64_t>(nvme_bytes);
        nvme_bytes += pg.slot;
      }
    }
  }
  // One chunk's planes (those the tiers hold): the optimizer's working set.
  const int64_t window = (kNumPlanes - std::popcount(static_cast<unsigned>(options.absent_planes))) * largest_chunk;
  if (device_homed + window > options.device_bytes) {
    throw Error("tier.device_bytes = " + format_mib(options.device_bytes) + " cannot hold the device-homed pages (" +
                format_mib(device_homed) + ") plus one chunk's working set (" + format_mib(window) + ")");
  }
  if (host_homed > options.host_bytes) {
    throw Error("tier.host_bytes = " + format_mib(options.host_bytes) + " cannot hold the host-homed pages (" + format_mib(host_homed) + ")");
  }
  if (nvme_bytes > 0 || any_transient) {
    check(!options.nvme_dir.empty(), "tier.nvme_dir: pages are placed on the NVMe tier but no directory is set");
    static std::atomic<int> counter{0};
    const std::string path = options.nvme_dir + "/keel-tier-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter++) + ".bin";
    file_ = BlockFile::create(path, static_cast<uint64_t>(nvme_bytes), options.engine, 32, options.write_delay_us);
    scratch_begin_ = static_cast<uint64_t>(nvme_bytes);
    if (file_->size() > scratch_begin_) scratch_free_[scratch_begin_] = file_->size() - scratch_begin_;
  }
  if (options.async_host) copier_ = std::make_unique<HostCopier>();
  if (options.verify) zeros_.assign(static_cast<size_t>(largest_slot), 0);
  // Move everything home; only device-homed pages stay present.
  for (int i = 0; i < static_cast<int>(pages_.size()); ++i) {
    Page& pg = pages_[i];
    if (!pg.exists) continue;
    if (options.verify) note_bytes(i, address(i), pg.version);
    if (pg.home == Tier::device) {
      device_used_ += pg.bytes;
      continue;
    }
    const float* src = address(i);
    // Untouched planes (gradients, moments) read as zero without being mapped: no I/O for them.
    pg.home_zero = std::all_of(src, src + pg.bytes / 4, [](float x) { return std::bit_cast<uint32_t>(x) == 0; });
    if (pg.home == Tier::host) {
      // A zero page's host copy is allocated when first written (its room is reserved now); a
      // page homed in place keeps its bytes where they are.
      if (!pg.home_zero && !in_place(pg)) {
        pg.host = AlignedBuffer(static_cast<size_t>(pg.slot));
        std::memcpy(pg.host.data, src, static_cast<size_t>(pg.bytes));
      }
      host_used_ += pg.slot;
    } else if (!pg.home_zero) {
      if (pg.transient) take_scratch(i);
      file_->wait(file_->write(address(i), static_cast<size_t>(pg.slot), pg.nvme_offset));
    }
    if (!in_place(pg) || pg.home_zero) give_back(i);
    pg.present = false;
  }
  stats_.peak_device_bytes = device_used_;
  stats_.peak_host_bytes = host_used_;
}

TierManager::~TierManager() {
  try {
    drain();
  } catch (...) {
    // The file goes with the manager; nothing left to save.
  }
}

IoEngine TierManager::engine() const { return file_ ? file_->engine() : IoEngine::automatic; }

int64_t TierManager::nvme_file_bytes() const { return file_ ? static_cast<int64_t>(file_->measured_size()) : 0; }

int64_t TierManager::nvme_scratch_bytes() const {
  return file_ ? static_cast<int64_t>(file_->size() - std::min(file_->size(), scratch_begin_)) : 0;
}

// First fit among the free scratch extents; else at the file's end (from a free extent that
// reaches it), growing the file by what is missing.
void TierManager::take_scratch(int i) {
  Page& pg = pages_[i];
  if (pg.scratch) return;
  const uint64_t need = static_cast<uint64_t>(pg.slot);
  uint64_t at = 0;
  auto fit = std::find_if(scratch_free_.begin(), scratch_free_.end(), [&](const auto& e) { return e.second >= need; });
  if (fit != scratch_free_.end()) {
    at = fit->first;
    const uint64_t left = fit->second - need;
    scratch_free_.erase(fit);
    if (left > 0) scratch_free_[at + need] = left;
  } else {
    at = std::max(file_->size(), scratch_begin_);
    if (!scratch_free_.empty()) {
      auto last = std::prev(scratch_free_.end());
      if (last->first + last->second == file_->size()) {
        at = last->first;
        scratch_free_.erase(last);
      }
    }
    file_->grow(at + need);
  }
  pg.nvme_offset = at;
  pg.scratch = true;
}

// Gives page i's scratch slot back (no transfer of it may be in flight), merged with its free
// neighbours.
void TierManager::free_scratch(int i) {
  Page& pg = pages_[i];
  if (!pg.scratch) return;
  pg.scratch = false;
  uint64_t at = pg.nvme_offset, bytes = static_cast<uint64_t>(pg.slot);
  auto next = scratch_free_.lower_bound(at);
  if (next != scratch_free_.end() && next->first == at + bytes) {
    bytes += next->second;
    next = scratch_free_.erase(next);
  }
  if (next != scratch_free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      at = prev->first;
      bytes += prev->second;
      scratch_free_.erase(prev);
    }
  }
  scratch_free_[at] = bytes;
}

TierManager::Page& TierManager::page(PageRef p) {
  Page& pg = pages_.at(static_cast<size_t>(index(p)));
  check(pg.exists, "tiers: chunk " + std::to_string(p.chunk) + " plane " + std::to_string(static_cast<int>(p.plane)) +
                       " is not held by this rank");
  return pg;
}
const TierManager::Page& TierManager::page(PageRef p) const { return const_cast<TierManager*>(this)->page(p); }

Tier TierManager::home(PageRef p) const { return page(p).home; }
bool TierManager::home_in_place(PageRef p) const { return in_place(page(p)); }
bool TierManager::in_place(const Page& pg) const {
  return options_.routed_host_in_place && pg.routed && pg.home == Tier::host;
}
bool TierManager::present(PageRef p) const { return page(p).present; }
uint64_t TierManager::version(PageRef p) const { return page(p).version; }

float* TierManager::address(int i) const {
  const int c = i / kNumPlanes;
  return const_cast<ChunkStore&>(store_).chunk_view(c, static_cast<Plane>(i % kNumPlanes)).data();
}

// Gives the whole OS pages inside page i's bytes back to the system (they read back as zero).
// Chunks start on 4 KiB boundaries and the bytes up to the next one are the chunk's own (or its
// padding), so the whole slot goes, and reads back as zero until written.
void TierManager::give_back(int i) {
  pages_[i].released = true;
  char* begin = reinterpret_cast<char*>(address(i));
  char* end = begin + pages_[i].slot;
  const uintptr_t os_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  char* inner_begin = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + os_page - 1) / os_page * os_page);
  char* inner_end = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end) / os_page * os_page);
  if (inner_begin < inner_end) {
    check(::madvise(inner_begin, static_cast<size_t>(inner_end - inner_begin), MADV_DONTNEED) == 0,
          "tiers: madvise(MADV_DONTNEED) failed");
  }
}

void TierManager::begin_step(bool representative) {
  if (in_step_) end_step();
  in_step_ = true;
  if (scheduled_) {
    // The deferred updates an evaluation or a checkpoint ran early make no acquires this step.
    const bool early = std::any_of(applied_early_.begin(), applied_early_.end(), [](uint8_t a) { return a != 0; });
    if (early || !view_full_) set_view();
  } else if (!recording_ && representative) {
    recording_ = true;
    recorded_.clear();
    recorded_update_.clear();
  }
  std::fill(applied_early_.begin(), applied_early_.end(), 0);
  position_ = 0;
  ++stats_step_;
  for (Page& pg : pages_) pg.expected = false;  // a hint of the last step that no acquire followed
  // What the last step's tail prefetched for this one, an evaluation in between may have evicted.
  on_schedule_ = scheduled_;
  prefetch_ahead();
}

void TierManager::end_step() {
  if (!in_step_) return;
  in_step_ = false;
  if (recording_) {
    recording_ = false;
    scheduled_ = !recorded_.empty();
    set_view();
    if (options_.adaptive && scheduled_) rehome();
  } else if (!view_full_) {
    set_view();  // (the next step's updates are pending again: the whole recorded step)
  }
  // Between steps: no prefetch, and eviction measures from the next step's start.
  on_schedule_ = false;
  position_ = 0;
}

void TierManager::set_view() {
  schedule_.clear();
  view_full_ = true;
  for (size_t k = 0; k < recorded_.size(); ++k) {
    const int u = recorded_update_[k];
    if (u >= 0 && applied_early_[static_cast<size_t>(u)]) {
      view_full_ = false;
      continue;
    }
    schedule_.push_back(recorded_[k]);
  }
  for (Page& pg : pages_) pg.uses.clear(), pg.first_use = -1;
  for (int64_t pos = static_cast<int64_t>(recorded_.size()) - 1; pos >= 0; --pos)
    for (int i : recorded_[pos]) pages_[i].first_use = pos;
  for (int64_t pos = 0; pos < static_cast<int64_t>(schedule_.size()); ++pos)
    for (int i : schedule_[pos]) pages_[i].uses.push_back(pos);
}

// Acquires from now until page i is next acquired (0 = the coming acquire). Without a schedule:
// least recently used first (a large distance for an old last use). Past the end of this step's
// view: the next step's, taken as recorded (whole: its updates pending again).
int64_t TierManager::next_use(int i) const {
  const Page& pg = pages_[i];
  if (!scheduled_) return clock_ - pg.last_use;
  if (pg.first_use < 0) return std::numeric_limits<int64_t>::max() / 2;
  const int64_t len = static_cast<int64_t>(schedule_.size());
  if (len == 0) return pg.first_use;
  const int64_t at = position_ % len;
  auto it = std::lower_bound(pg.uses.begin(), pg.uses.end(), at);
  return it != pg.uses.end() ? *it - at : pg.first_use + len - at;
}

// Evicts unpinned pages, farthest next use first (never one needed within `horizon` acquires,
// when horizon >= 0), until `bytes` more fit the device budget once the write-backs in flight
// have freed their memory. False when no such page is left.
bool TierManager::evict_for(int64_t bytes, int64_t horizon) {
  while (device_used_ - leaving_bytes() + bytes > options_.device_bytes) {
    int victim = -1;
    int64_t farthest = -1;
    // Routed pages a hint brought in for the coming acquires go last (a demand only).
    for (int pass = 0; pass < (horizon < 0 ? 2 : 1) && victim < 0; ++pass) {
      for (int i = 0; i < static_cast<int>(pages_.size()); ++i) {
        const Page& pg = pages_[i];
        if (!pg.exists || !pg.present || pg.pins > 0 || pg.home == Tier::device || pg.fetching) continue;
        if (pg.expected && pass == 0) continue;
        const int64_t d = next_use(i);
        if (d > farthest) farthest = d, victim = i;
      }
    }
    if (victim < 0 || (horizon >= 0 && farthest <= horizon)) return false;
    evict(victim);
  }
  return true;
}

// Makes room for `bytes` more in the device budget now. A demand (horizon < 0) waits for
// write-backs to free memory (oldest first); a prefetch does not.
bool TierManager::make_room(int64_t bytes, int64_t horizon) {
  while (device_used_ + bytes > options_.device_bytes) {
    const bool coming = evict_for(bytes, horizon);
    if (device_used_ + bytes <= options_.device_bytes) break;  // clean pages went at once
    if (horizon >= 0) {
      poll();
      return coming && device_used_ + bytes <= options_.device_bytes;
    }
    // Memory comes back as writes complete; prefetches in flight become evictable once done.
    if (!finish_oldest_of(true) && !finish_oldest_of(false)) return false;
  }
  return true;
}

// Completes the oldest write-back of an evicted page (`write`), or the oldest fetch of an
// unpinned page. False when there is none.
bool TierManager::finish_oldest_of(bool write) {
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    const Page& pg = pages_[*it];
    if (write ? (pg.writing && !pg.present) : (pg.fetching && pg.pins == 0)) {
      const int i = *it;
      in_flight_.erase(it);
      settle(i);
      return true;
    }
  }
  return false;
}

int64_t TierManager::leaving_bytes() const {
  int64_t b = 0;
  for (int i : in_flight_)
    if (pages_[i].writing && !pages_[i].present) b += pages_[i].bytes;
  return b;
}

// A page whose write-back is still in flight holds its bytes: take it back without a fetch.
bool TierManager::revive(int i) {
  Page& pg = pages_[i];
  if (pg.present || !pg.writing) return false;
  pg.present = true;
  pg.released = false;
  pg.device_version = pg.writing->version;
  return true;
}

void TierManager::evict(int i) {
  Page& pg = pages_[i];
  if (pg.writing) {
    // Taken back (revive) while its write-back was in flight. Unchanged since: it leaves again
    // as it was, the write in flight carrying these very bytes, and its memory goes when the
    // write completes. Changed since: the older write completes first (two writes of one slot
    // are never in flight together), then the page is as dirty as any other.
    if (pg.device_version == pg.writing->version) {
      pg.present = false;
      stats_.evictions++;
      return;
    }
    settle(i);
  }
  const bool dirty = pg.device_version > pg.home_version;
  if (dirty) pg.home_zero = false;
  if (in_place(pg)) {  // its bytes are its home copy: they stay, out of the device budget's count
    if (dirty) {
      pg.home_version = pg.device_version;
      stats_.tier[static_cast<int>(Tier::host)].bytes_written += static_cast<uint64_t>(pg.bytes);
    }
    pg.present = false;
    device_used_ -= pg.bytes;
    stats_.evictions++;
    return;
  }
  if (dirty && pg.home == Tier::host) {
    if (pg.host.data == nullptr) pg.host = AlignedBuffer(static_cast<size_t>(pg.slot));
    std::memcpy(pg.host.data, address(i), static_cast<size_t>(pg.bytes));
    pg.home_version = pg.device_version;
    stats_.tier[static_cast<int>(Tier::host)].bytes_written += static_cast<uint64_t>(pg.bytes);
  } else if (dirty) {
    // Written straight from the compute tier (O_DIRECT): the page's memory stays held, and
    // counted, until the write completes; an acquire before then takes the page back as it is.
    if (pg.transient) take_scratch(i);
    auto t = std::make_unique<Transfer>();
    t->version = pg.device_version;
    t->ticket = file_->write(address(i), static_cast<size_t>(pg.slot), pg.nvme_offset);
    pg.writing = std::move(t);
    pg.present = false;
    in_flight_.push_back(i);
    stats_.evictions++;
    return;
  }
  give_back(i);
  pg.present = false;
  device_used_ -= pg.bytes;
  stats_.evictions++;
}

void TierManager::finish_writeback(int i) {
  Page& pg = pages_[i];
  file_->wait(pg.writing->ticket);
  pg.home_version = pg.writing->version;
  stats_.tier[static_cast<int>(Tier::nvme)].bytes_written += static_cast<uint64_t>(pg.bytes);
  pg.writing.reset();
  if (!pg.present) {  // evicted: its memory goes now (taken back meanwhile: it stays)
    give_back(i);
    device_used_ -= pg.bytes;
  }
}

void TierManager::finish_fetch(int i) {
  Page& pg = pages_[i];
  if (pg.fetching->host) {
    copier_->wait(pg.fetching->ticket);
  } else {
    file_->wait(pg.fetching->ticket);
  }
  pg.device_version = pg.fetching->version;
  pg.present = true;
  pg.released = false;
  pg.fetching.reset();
}

// Completes the oldest transfer in flight.
void TierManager::finish_oldest() {
  const int i = in_flight_.front();
  in_flight_.erase(in_flight_.begin());  // (an entry may be stale: its transfer already finished)
  settle(i);
}

// Completes the transfers that are done, without blocking.
void TierManager::poll() {
  for (size_t k = 0; k < in_flight_.size();) {
    const int i = in_flight_[k];
    Page& pg = pages_[i];
    const Transfer* t = pg.fetching ? pg.fetching.get() : pg.writing.get();
    if (t == nullptr) {
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(k));
      continue;
    }
    if (!(t->host ? copier_->done(t->ticket) : file_->done(t->ticket))) {
      ++k;
      continue;
    }
    in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(k));
    if (pg.fetching) {
      finish_fetch(i);
    } else {
      finish_writeback(i);
    }
  }
}

// Starts bringing page i into the device tier (room must have been made). A host-homed page is
// copied at once, or by the copier's thread (async_host); an NVMe page is read straight into its
// place in the plane (O_DIRECT).
void TierManager::fetch(int i) {
  Page& pg = pages_[i];
  const int t = static_cast<int>(pg.home);
  if (pg.home_zero && !pg.writing) {
    device_used_ += pg.bytes;
    if (!pg.released) std::memset(address(i), 0, static_cast<size_t>(pg.bytes));
    pg.device_version = pg.home_version;
    pg.present = true;
    pg.released = false;
    stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, device_used_);
    return;
  }
  if (in_place(pg)) {  // its home copy is at its address: counted present, nothing copied
    device_used_ += pg.bytes;
    pg.device_version = pg.home_version;
    pg.present = true;
    pg.released = false;
  } else if (pg.home == Tier::host && copier_) {
    device_used_ += pg.bytes;
    auto tr = std::make_unique<Transfer>();
    tr->version = pg.home_version;
    tr->host = true;
    tr->ticket = copier_->copy(address(i), pg.host.data, static_cast<size_t>(pg.bytes));
    pg.fetching = std::move(tr);
    in_flight_.push_back(i);
  } else if (pg.home == Tier::host) {
    device_used_ += pg.bytes;
    std::memcpy(address(i), pg.host.data, static_cast<size_t>(pg.bytes));
    pg.device_version = pg.home_version;
    pg.present = true;
    pg.released = false;
  } else {
    device_used_ += pg.bytes;
    auto tr = std::make_unique<Transfer>();
    tr->version = pg.home_version;
    tr->ticket = file_->read(address(i), static_cast<size_t>(pg.slot), pg.nvme_offset);
    pg.fetching = std::move(tr);
    in_flight_.push_back(i);
  }
  stats_.tier[t].bytes_read += static_cast<uint64_t>(pg.bytes);
  pg.counters.bytes_read += static_cast<uint64_t>(pg.bytes);
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, device_used_);
}

// Completes whatever transfer page i has in flight (a fetch, or a write-back).
void TierManager::settle(int i) {
  Page& pg = pages_[i];
  while (pg.fetching || pg.writing) {
    const auto it = std::find(in_flight_.begin(), in_flight_.end(), i);
    if (it != in_flight_.end()) in_flight_.erase(it);
    if (pg.fetching) {
      finish_fetch(i);
    } else {
      finish_writeback(i);
    }
  }
}

void TierManager::note_bytes(int i, const void* data, uint64_t version) {
  Page& pg = pages_[i];
  pg.checksum = XXH3_64bits(data != nullptr ? data : zeros_.data(), static_cast<size_t>(pg.bytes));
  pg.checksum_version = version;
}

void TierManager::check_bytes(int i) const {
  const Page& pg = pages_[i];
  if (pg.checksum_version != pg.version) return;
  if (XXH3_64bits(address(i), static_cast<size_t>(pg.bytes)) == pg.checksum) return;
  throw Error("tiers (tier.verify): chunk " + std::to_string(i / kNumPlanes) + " plane " + std::to_string(i % kNumPlanes) +
              " (home " + tier_name(pg.home) + ") does not hold the bytes of its version " + std::to_string(pg.version) +
              ": a transfer lost or tore them, or they were written without a lease");
}

void TierManager::count_touch(int i, bool hit, double waited_ms) {
  Page& pg = pages_[i];
  if (pg.touched_step == stats_step_) return;
  pg.touched_step = stats_step_;
  TierCounters& c = stats_.tier[static_cast<int>(pg.home)];
  c.acquires++;
  c.hits += hit;
  c.stall_ms += waited_ms;
  pg.counters.acquires++;
  pg.counters.hits += hit;
  pg.counters.stall_ms += waited_ms;
  if (!hit) c.stalls_ms.push_back(static_cast<float>(waited_ms));
}

void TierManager::acquire(std::span<const PageRef> refs) {
  const auto t_start = std::chrono::steady_clock::now();
  struct Timer {  // all of acquire, waits for room and prefetch issue included
    TierStats& s;
    std::chrono::steady_clock::time_point t0;
    ~Timer() { s.acquire_ms += ms_since(t0); }
  } timer{stats_, t_start};
  poll();
  if (refs.empty()) return;  // (a lease of no pages: no part of the schedule)
  std::vector<int> group;
  group.reserve(refs.size());
  bool routed = true;
  for (const PageRef& r : refs) {
    routed = routed && page(r).routed && r.plane == refs[0].plane;
    group.push_back(index(r));
  }
  // Routed pages' acquires (a block's lease of an expert the router chose for this micro-batch:
  // one plane) are no part of the schedule: not recorded, and the position in it stays where the
  // block's other acquires left it. (The optimizer's update of an expert, its parameters and
  // gradient together, runs every step at the same point: scheduled.)
  if (routed) {
    ++clock_;
    acquire_group(group);
    return;
  }
  if (!in_step_) {
    // Between steps (an evaluation, a checkpoint, the deferred updates they apply first): off
    // the schedule, no part of it, and an update run here will not come in the next step.
    if (const int u = store_.updating(); u >= 0) applied_early_[static_cast<size_t>(u)] = 1;
    stats_.between_steps++;
    on_schedule_ = false;
    ++clock_;
    acquire_group(group);
    return;
  }
  if (recording_) {
    recorded_.push_back(group);
    recorded_update_.push_back(store_.updating());
  }
  // Off the schedule (a step unlike the recorded one): no prefetch until it is found again a
  // little further on.
  const int64_t len = static_cast<int64_t>(schedule_.size());
  if (scheduled_ && position_ < len && schedule_[position_] != group) {
    constexpr int64_t kResync = 64;
    for (int64_t k = 1; k <= kResync && position_ + k < len; ++k) {
      if (schedule_[position_ + k] == group) {
        position_ += k;
        stats_.schedule_skips += static_cast<uint64_t>(k);
        break;
      }
    }
  }
  on_schedule_ = scheduled_ && position_ < len && schedule_[position_] == group;
  if (scheduled_ && !on_schedule_) stats_.off_schedule++;
  if (trace_ && scheduled_ && !on_schedule_) {
    std::fprintf(stderr, "tier-off-schedule pos %lld of %lld group of %zu (first chunk %d plane %d)\n",
                 static_cast<long long>(position_), static_cast<long long>(len), group.size(),
                 group.empty() ? -1 : group[0] / kNumPlanes, group.empty() ? -1 : group[0] % kNumPlanes);
  }
  ++position_;
  ++clock_;
  acquire_group(group);
  prefetch_ahead();
}

// Makes the pages of `group` present with their newest bytes and pins them (the schedule's
// bookkeeping done).
void TierManager::acquire_group(const std::vector<int>& group) {
  int64_t need = 0;
  for (int i : group) {
    revive(i);
    const Page& pg = pages_[i];
    if (!pg.present && !pg.fetching) need += pg.bytes;
  }
  for (int i : group) pages_[i].pins++;  // nothing of this group is evicted to make room for it
  const auto t_room = std::chrono::steady_clock::now();
  bool room = make_room(need, -1);
  if (!room) {  // the room of routed pages hinted and not yet acquired is given up last
    for (Page& pg : pages_) pg.expected = false;
    room = make_room(need, -1);
  }
  // Waiting for write-backs to free room is a stall too: charged to the first page fetched.
  double room_ms = need > 0 ? ms_since(t_room) : 0.0;
  if (!room) {
    for (int i : group) pages_[i].pins--;
    int64_t pinned = 0;
    for (const Page& pg : pages_)
      if (pg.exists && pg.present && (pg.pins > 0 || pg.home == Tier::device)) pinned += pg.bytes;
    throw Error("tier.device_bytes = " + format_mib(options_.device_bytes) + " cannot hold the working set: " + format_mib(need) +
                " to fetch while " + format_mib(pinned) + " are pinned or device-homed");
  }
  for (int i : group) {
    Page& pg = pages_[i];
    pg.last_use = clock_;
    pg.expected = false;
    // A present copy behind its owner's version is stale: drop it, fetch again.
    if (pg.present && pg.device_version != pg.version) {
      stats_.stale_refetches++;
      settle(i);  // a write-back of the old bytes still reading this memory completes first
      pg.present = false;
      device_used_ -= pg.bytes;
    }
    if (pg.present) {
      count_touch(i, true, 0);
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const bool was_fetching = pg.fetching != nullptr;
    if (!pg.fetching) fetch(i);
    settle(i);
    if (trace_) {
      std::fprintf(stderr, "tier-miss pos %lld chunk %d plane %d home %s bytes %lld %s wait %.2f ms used %lld\n",
                   static_cast<long long>(position_ - 1), i / kNumPlanes, i % kNumPlanes, tier_name(pg.home),
                   static_cast<long long>(pg.bytes), was_fetching ? "in-flight" : "not-started",
                   ms_since(t0) + room_ms, static_cast<long long>(device_used_));
    }
    if (pg.device_version != pg.version) {
      throw Error("tiers: chunk " + std::to_string(i / kNumPlanes) + " plane " + std::to_string(i % kNumPlanes) +
                  " fetched at version " + std::to_string(pg.device_version) + ", owner at " + std::to_string(pg.version));
    }
    count_touch(i, false, ms_since(t0) + room_ms);
    room_ms = 0;
  }
  if (options_.verify) {
    for (int i : group) check_bytes(i);
  }
}

void TierManager::release(std::span<const PageRef> refs, bool modified) {
  for (const PageRef& r : refs) {
    Page& pg = page(r);
    check(pg.pins > 0, "tiers: release of a page that is not acquired");
    pg.pins--;
    if (modified) {
      pg.version++;
      pg.device_version = pg.version;
      if (options_.verify) note_bytes(index(r), address(index(r)), pg.version);
      // A page declared zero under this lease is as its (zero) home says: nothing to write back.
      if (pg.home == Tier::device || pg.zeroed_pinned) pg.home_version = pg.version;
    }
    if (pg.pins == 0) pg.zeroed_pinned = false;
  }
}

void TierManager::record_again() {
  recording_ = scheduled_ = on_schedule_ = false;
  recorded_.clear();
  recorded_update_.clear();
  schedule_.clear();
  view_full_ = true;
  for (Page& pg : pages_) pg.uses.clear(), pg.first_use = -1;
}

int TierManager::hint(std::span<const PageRef> refs) {
  bool routed = false;
  for (const PageRef& r : refs) routed = routed || page(r).routed;
  if (!options_.prefetch || (scheduled_ && on_schedule_ && !routed)) return 0;
  poll();
  if (scheduled_ && on_schedule_) {  // routed pages, which the schedule cannot know
    int started = 0;
    for (const PageRef& r : refs) {
      const int i = index(r);
      Page& pg = pages_[i];
      if (!pg.routed) continue;
      if (revive(i) || pg.present || pg.fetching || pg.home == Tier::device) {
        pg.expected = true;
        continue;
      }
      if (!make_room(pg.bytes, 0)) break;  // never evicting what the coming acquire needs
      pg.expected = true;  // (kept for its acquire once there: not before there is room)
      fetch(i);
      started++;
    }
    stats_.hint_fetches += static_cast<uint64_t>(started);
    return started;
  }
  std::vector<uint8_t> hinted(pages_.size(), 0);
  for (const PageRef& r : refs) {
    page(r);  // exists
    hinted[static_cast<size_t>(index(r))] = 1;
  }
  // Room for a hinted page: free room, else the least recently used clean page that is not
  // hinted (gone at once, no write-back; a dirty one would only free its room later).
  auto room_for = [&](int64_t bytes) {
    while (device_used_ + bytes > options_.device_bytes) {
      int victim = -1;
      for (int i = 0; i < static_cast<int>(pages_.size()); ++i) {
        const Page& pg = pages_[i];
        if (!pg.exists || !pg.present || pg.pins > 0 || pg.home == Tier::device || pg.fetching || pg.writing ||
            hinted[static_cast<size_t>(i)] || pg.expected || pg.device_version > pg.home_version) {
          continue;
        }
        if (victim < 0 || pg.last_use < pages_[victim].last_use) victim = i;
      }
      if (victim < 0) return false;
      evict(victim);
    }
    return true;
  };
  int started = 0;
  for (const PageRef& r : refs) {
    const int i = index(r);
    Page& pg = pages_[i];
    if (revive(i) || pg.present || pg.fetching || pg.home == Tier::device) {
      pg.expected = pg.expected || pg.routed;
      continue;
    }
    if (!room_for(pg.bytes)) break;
    pg.expected = pg.expected || pg.routed;
    fetch(i);
    started++;
  }
  stats_.hint_fetches += static_cast<uint64_t>(started);
  return started;
}

void TierManager::prefetch_ahead() {
  if (!options_.prefetch || !scheduled_ || !on_schedule_) return;
  const int64_t len = static_cast<int64_t>(schedule_.size()), whole = static_cast<int64_t>(recorded_.size());
  // Pages ahead whose room write-backs in flight are still freeing: they are not fetched yet,
  // but eviction goes on for the pages after them, so their writes overlap too.
  int64_t waiting = 0;
  for (int64_t k = 0; k < options_.lookahead; ++k) {
    // Past this step's view: the next step's acquires, as recorded (its updates pending again).
    const int64_t at = position_ + k;
    for (int i : at < len ? schedule_[at] : recorded_[(at - len) % whole]) {
      Page& pg = pages_[i];
      if (revive(i) || pg.present || pg.fetching || pg.home == Tier::device) continue;
      if (waiting == 0 && make_room(pg.bytes, k)) {
        fetch(i);
        continue;
      }
      if (!evict_for(waiting + pg.bytes, k)) {
        if (trace_) {
          std::fprintf(stderr, "tier-prefetch-blocked pos %lld ahead %lld chunk %d plane %d used %lld leaving %lld\n",
                       static_cast<long long>(position_ - 1), static_cast<long long>(k), i / kNumPlanes, i % kNumPlanes,
                       static_cast<long long>(device_used_), static_cast<long long>(leaving_bytes()));
        }
        return;
      }
      waiting += pg.bytes;
    }
  }
}

void TierManager::update_at_home(PageRef r, const std::function<void(float*, size_t)>& update) {
  Page& pg = page(r);
  const int i = index(r);
  const size_t n = static_cast<size_t>(pg.bytes) / sizeof(float);
  if (pg.home == Tier::device) {
    update(address(i), n);
    pg.version++;
    if (options_.verify) note_bytes(i, address(i), pg.version);
    pg.device_version = pg.home_version = pg.version;
    return;
  }
  settle(i);
  if (in_place(pg)) {  // one copy, at its address (zero where given back)
    update(address(i), n);
    pg.version++;
    if (options_.verify) note_bytes(i, address(i), pg.version);
    pg.home_zero = false;
    pg.home_version = pg.version;
    if (pg.present) pg.device_version = pg.version;
    return;
  }
  const int t = static_cast<int>(pg.home);
  const bool device_newer = pg.present && pg.device_version > pg.home_version;
  const bool was_zero = pg.home_zero && !device_newer;
  pg.home_zero = false;
  if (pg.home == Tier::host) {
    if (pg.host.data == nullptr) pg.host = AlignedBuffer(static_cast<size_t>(pg.slot));
    if (device_newer) std::memcpy(pg.host.data, address(i), static_cast<size_t>(pg.bytes));
    if (was_zero) std::memset(pg.host.data, 0, static_cast<size_t>(pg.slot));
    update(static_cast<float*>(pg.host.data), n);
    if (options_.verify) note_bytes(i, pg.host.data, pg.version + 1);
  } else {
    while (host_used_ + pg.slot > options_.host_bytes && !in_flight_.empty()) finish_oldest();
    check(host_used_ + pg.slot <= options_.host_bytes, "tier.host_bytes: no room left to stage an update at home");
    AlignedBuffer buf(static_cast<size_t>(pg.slot));
    if (device_newer) {
      std::memcpy(buf.data, address(i), static_cast<size_t>(pg.bytes));
      std::memset(static_cast<char*>(buf.data) + pg.bytes, 0, static_cast<size_t>(pg.slot - pg.bytes));
    } else if (was_zero) {
      std::memset(buf.data, 0, static_cast<size_t>(pg.slot));
    } else {
      file_->wait(file_->read(buf.data, static_cast<size_t>(pg.slot), pg.nvme_offset));
      stats_.tier[t].bytes_read += static_cast<uint64_t>(pg.bytes);
    }
    update(static_cast<float*>(buf.data), n);
    if (options_.verify) note_bytes(i, buf.data, pg.version + 1);
    if (pg.transient) take_scratch(i);
    file_->wait(file_->write(buf.data, static_cast<size_t>(pg.slot), pg.nvme_offset));
    stats_.tier[t].bytes_written += static_cast<uint64_t>(pg.bytes);
  }
  pg.version++;
  pg.home_version = pg.version;
  if (pg.present && pg.pins == 0) {  // behind now, and unused: give its memory back
    give_back(i);
    pg.present = false;
    device_used_ -= pg.bytes;
  }
}

void TierManager::discard_to_zero(PageRef r, bool zeroed_in_place) {
  Page& pg = page(r);
  const int i = index(r);
  pg.version++;
  if (pg.home == Tier::device) {
    std::memset(address(i), 0, static_cast<size_t>(pg.bytes));
    pg.device_version = pg.home_version = pg.version;
    if (options_.verify) note_bytes(i, nullptr, pg.version);
    return;
  }
  settle(i);  // a write-back's bytes are moot now, but its memory must outlive the write
  if (options_.verify) note_bytes(i, nullptr, pg.version);
  if (in_place(pg) && zeroed_in_place) {  // its home copy, at its address, is the zeros now
    pg.home_zero = false;
    pg.home_version = pg.version;
    if (pg.present) pg.device_version = pg.version;
    return;
  }
  if (in_place(pg) && !pg.present) give_back(i);  // (its bytes there were its home copy's)
  pg.home_zero = true;
  pg.home_version = pg.version;
  if (pg.transient) free_scratch(i);  // its write (settled above) is moot
  if (pg.home == Tier::host) pg.host = AlignedBuffer();  // zero again: allocated at its next write
  if (pg.present) {
    if (pg.pins > 0) {
      std::memset(address(i), 0, static_cast<size_t>(pg.bytes));
      pg.device_version = pg.version;
      pg.zeroed_pinned = true;
    } else {
      give_back(i);
      pg.present = false;
      device_used_ -= pg.bytes;
    }
  }
}

// The adaptive policy. From the recorded step: a page's accesses per step and its mean reuse
// distance (bytes acquired between two of its uses, wrapping into the next step). Pages are
// ranked by accesses per step (more first), then reuse distance (shorter first), then size
// (smaller first), and homed greedily: the device tier up to its budget less the reserve kept for
// the working window, then host DRAM up to its budget, the rest on NVMe (or host, without an
// NVMe tier, where it must fit).
void TierManager::rehome() {
  drain();
  const int64_t len = static_cast<int64_t>(schedule_.size());
  std::vector<int64_t> bytes_at(static_cast<size_t>(len) + 1, 0);  // bytes acquired before position p
  for (int64_t pos = 0; pos < len; ++pos) {
    int64_t b = 0;
    for (int i : schedule_[pos]) b += pages_[i].bytes;
    bytes_at[pos + 1] = bytes_at[pos] + b;
  }
  const int64_t step_bytes = bytes_at[len];
  struct Rank {
    int i;
    int64_t uses;
    double reuse;
  };
  std::vector<Rank> order;
  for (int i = 0; i < static_cast<int>(pages_.size()); ++i) {
    const Page& pg = pages_[i];
    if (!pg.exists || pg.transient) continue;  // (transient pages stay homed nowhere)
    const int64_t u = static_cast<int64_t>(pg.uses.size());
    double reuse = static_cast<double>(step_bytes) * 2;  // used once a step or never: a step or more
    if (u > 0) {
      double sum = 0;
      for (int64_t k = 0; k < u; ++k) {
        const int64_t a = pg.uses[k], b = k + 1 < u ? pg.uses[k + 1] : pg.uses[0] + len;
        sum += static_cast<double>(b < len ? bytes_at[b] - bytes_at[a] : step_bytes - bytes_at[a] + bytes_at[b - len]);
      }
      reuse = sum / static_cast<double>(u);
    }
    order.push_back({i, u, reuse});
  }
  std::stable_sort(order.begin(), order.end(), [&](const Rank& a, const Rank& b) {
    if (a.uses != b.uses) return a.uses > b.uses;
    if (a.reuse != b.reuse) return a.reuse < b.reuse;
    return pages_[a.i].bytes < pages_[b.i].bytes;
  });
  std::vector<Tier> want(pages_.size(), Tier::device);
  int64_t device_left = options_.device_bytes - options_.reserve_bytes, host_left = options_.host_bytes;
  for (const Rank& r : order) {
    const Page& pg = pages_[r.i];
    if (pg.bytes <= device_left) {
      want[r.i] = Tier::device;
      device_left -= pg.bytes;
    } else if (pg.slot <= host_left) {
      want[r.i] = Tier::host;
      host_left -= pg.slot;
    } else {
      want[r.i] = file_ ? Tier::nvme : Tier::host;
      check(file_ != nullptr, "tiers: the adaptive policy ran out of host budget and there is no NVMe tier");
    }
  }
  int64_t moved[kNumTiers] = {}, count = 0;
  // Moves that free room first: off the device, then off the host, then onto them.
  for (int pass = 0; pass < 3; ++pass) {
    for (const Rank& r : order) {
      Page& pg = pages_[r.i];
      const Tier to = want[r.i];
      if (pg.home == to) continue;
      const bool frees_device = pg.home == Tier::device, frees_host = pg.home == Tier::host && to == Tier::nvme;
      if ((pass == 0 && !frees_device) || (pass == 1 && !frees_host) || (pass == 2 && (frees_device || frees_host))) continue;
      move_home(r.i, to);
      moved[static_cast<int>(to)] += pg.bytes;
      count++;
    }
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "adaptive policy re-homed %lld pages: %s to device, %s to host, %s to nvme",
                static_cast<long long>(count), format_mib(moved[0]).c_str(), format_mib(moved[1]).c_str(), format_mib(moved[2]).c_str());
  rehome_note_ = buf;
}

// Moves page i's home to `to`, carrying its newest bytes; leaves it absent unless device-homed.
void TierManager::move_home(int i, Tier to) {
  Page& pg = pages_[i];
  // The newest bytes, in the compute tier (rehome drained every transfer first).
  if (!pg.present && !revive(i)) {
    pg.pins++;
    const bool room = make_room(pg.bytes, -1);
    pg.pins--;
    check(room, "tiers: no device room to move a page between tiers");
    fetch(i);
  }
  settle(i);
  if (pg.home == Tier::host) {
    pg.host = AlignedBuffer();
    host_used_ -= pg.slot;
  }
  pg.home = to;
  pg.home_zero = false;
  const int t = static_cast<int>(to);
  if (to == Tier::host) {
    if (!in_place(pg)) {
      pg.host = AlignedBuffer(static_cast<size_t>(pg.slot));
      std::memcpy(pg.host.data, address(i), static_cast<size_t>(pg.bytes));
    }
    host_used_ += pg.slot;
    stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, host_used_);
  } else if (to == Tier::nvme) {
    file_->wait(file_->write(address(i), static_cast<size_t>(pg.slot), pg.nvme_offset));
  }
  stats_.tier[t].bytes_written += to == Tier::device ? 0 : static_cast<uint64_t>(pg.bytes);
  pg.home_version = pg.device_version;
  if (to != Tier::device && pg.pins == 0) {
    if (!in_place(pg)) give_back(i);
    pg.present = false;
    device_used_ -= pg.bytes;
  }
}

std::vector<int64_t> TierManager::rehome_pages(std::span<const PageRef> refs, std::span<const Tier> homes,
                                              int64_t device_reserve) {
  check(refs.size() == homes.size(), "tiers: rehome_pages with " + std::to_string(homes.size()) + " homes for " +
                                          std::to_string(refs.size()) + " pages");
  // The budgets after the moves, checked before any page moves.
  int64_t device_homed = 0, host = host_used_;
  std::vector<Tier> after(pages_.size());
  for (int i = 0; i < static_cast<int>(pages_.size()); ++i) after[i] = pages_[i].home;
  for (size_t k = 0; k < refs.size(); ++k) {
    const int i = index(refs[k]);
    const Page& pg = page(refs[k]);
    if (pg.transient) continue;  // another rank's (ZeRO-3): homed nowhere, left so
    if (homes[k] == Tier::nvme && pg.home != Tier::nvme) {
      check(file_ != nullptr && (pg.routed || options_.adaptive),
            "tiers: chunk " + std::to_string(refs[k].chunk) + " has no NVMe slot to move to");
    }
    if (pg.home == Tier::host && homes[k] != Tier::host) host -= pg.slot;
    if (pg.home != Tier::host && homes[k] == Tier::host) host += pg.slot;
    after[i] = homes[k];
  }
  for (int i = 0; i < static_cast<int>(pages_.size()); ++i)
    if (pages_[i].exists && after[i] == Tier::device) device_homed += pages_[i].bytes;
  if (device_homed + device_reserve > options_.device_bytes) {
    throw Error("tier.device_bytes = " + format_mib(options_.device_bytes) + " cannot home " + format_mib(device_homed) +
                " on the device and keep " + format_mib(device_reserve) + " free for the working window");
  }
  if (host > options_.host_bytes) {
    throw Error("tier.host_bytes = " + format_mib(options_.host_bytes) + " cannot hold " + format_mib(host) +
                " of host copies after re-homing");
  }
  drain();
  // A page that moves onto or off host DRAM, where it is updated at home (TierResidency), changes
  // the optimizer's lease of its chunk: the recorded schedule no longer matches the step, and the
  // next representative step is recorded again. (Routed pages homed in place are leased alike
  // wherever they live.)
  bool shape_changes = false;
  for (size_t k = 0; k < refs.size(); ++k) {
    const Page& pg = page(refs[k]);
    const bool at_home = pg.home == Tier::host && !in_place(pg);
    const bool at_home_after = homes[k] == Tier::host && !(options_.routed_host_in_place && pg.routed);
    shape_changes = shape_changes || (homes[k] != pg.home && at_home != at_home_after);
  }
  std::vector<int64_t> moved(kNumTiers, 0);
  // Moves that free room first: off the device, then off the host, then onto them.
  for (int pass = 0; pass < 3; ++pass) {
    for (size_t k = 0; k < refs.size(); ++k) {
      const int i = index(refs[k]);
      Page& pg = pages_[i];
      const Tier to = homes[k];
      if (pg.home == to || pg.transient) continue;
      const bool frees_device = pg.home == Tier::device, frees_host = pg.home == Tier::host && to == Tier::nvme;
      if ((pass == 0 && !frees_device) || (pass == 1 && !frees_host) || (pass == 2 && (frees_device || frees_host))) continue;
      move_home(i, to);
      moved[static_cast<int>(to)] += pg.bytes;
    }
  }
  if (shape_changes) record_again();
  return moved;
}

PageCounters TierManager::take_page_counters(PageRef p) {
  PageCounters c;
  std::swap(c, page(p).counters);
  return c;
}

std::string TierManager::take_rehome_note() {
  std::string n;
  n.swap(rehome_note_);
  return n;
}

std::vector<Tier> TierManager::homes() const {
  std::vector<Tier> h(pages_.size(), Tier::device);
  for (size_t i = 0; i < pages_.size(); ++i)
    if (pages_[i].exists) h[i] = pages_[i].home;
  return h;
}

void TierManager::drain() {
  while (!in_flight_.empty()) finish_oldest();
}

TierStats TierManager::take_step_stats() {
  TierStats out = stats_;
  int64_t resident[kNumTiers] = {device_used_, 0, 0};
  for (const Page& pg : pages_) {
    if (!pg.exists) continue;
    if (pg.home == Tier::host) resident[1] += pg.slot;
    if (pg.home == Tier::nvme && (!pg.transient || pg.scratch)) resident[2] += pg.slot;
  }
  for (int t = 0; t < kNumTiers; ++t) out.tier[t].resident_bytes = resident[t];
  for (TierCounters& c : stats_.tier) c = TierCounters{};
  stats_.stale_refetches = 0;
  stats_.acquire_ms = 0;
  stats_.evictions = 0;
  stats_.hint_fetches = 0;
  stats_.off_schedule = stats_.schedule_skips = stats_.between_steps = 0;
  return out;
}

}  // namespace keel
