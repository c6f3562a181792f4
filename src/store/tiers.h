// Tiered chunk memory: where each page of the chunk store lives between uses, and how it gets to
// the compute tier in time.
//
// A page is one plane of one chunk (its parameters, gradients, or one AdamW moment). Compute
// always happens at the page's address in the store's flat planes: the `device` tier (DRAM on a
// CPU build, device memory on a GPU build). A page is *present* when those bytes are valid; an
// absent page's memory is given back to the system. Every page has a *home* where its
// authoritative copy stays while it is absent:
//   device  never leaves the compute tier (hot);
//   host    a DRAM copy (cold, in the seed's words: big, touched rarely);
//   nvme    a slot of a preallocated O_DIRECT file (warm: fetched ahead of use).
// The device budget bounds the bytes of present pages (device-homed ones included), the host
// budget the host copies plus the staging buffers of NVMe transfers. Neither is ever exceeded.
//
// Users acquire the pages an operation needs (fetched and pinned) and release them after (a write
// acquire marks them modified). The manager records the first step's sequence of acquires as the
// step's schedule; from then on it prefetches the next `lookahead` acquires while the current one
// computes, and evicts the unpinned page whose next use lies farthest ahead (Belady's rule, exact
// here because steps repeat), so eviction never drops what is needed next. Modified pages are
// written back to their home asynchronously when evicted.
//
// A step runs from begin_step() to end_step(): only its acquires are recorded, and only they
// follow the schedule. Acquires between steps (evaluations, checkpoints, deferred optimizer
// updates they apply early) are off it: neither recorded nor moving the position, no prefetch,
// evicting the pages the next step needs farthest from its start. A deferred update (the store's
// updater, ChunkStore::updating()) that ran between steps is left out of the next step's view of
// the schedule (its acquires will not come), so that step's forward pass follows the schedule
// from its first acquire instead of prefetching the updates' pages for nothing.
//
// Versions (the seed's ParameterVersion protocol): every page has an owner version, bumped when
// a write acquire is released. A device copy records the version it was copied at; an acquire
// compares the two, and a copy that is behind is refetched, never used. A page whose write-back
// is still in flight keeps its memory until the write completes and is taken back from there
// (the newest bytes), never read from the home slot being written.
//
// Transient pages (ZeRO-3 with an NVMe tier: the parameter and gradient pages of chunks whose
// parameters the store does not home (ChunkStore::param_homed: with sharded experts also the
// other holders' chunks inside the span of a rank's own), which are another rank's and pass
// through this one only while gathered, drawn or loaded before the weights settle, or until their
// reduce-scatter) have no slot of their own: their home is zero between
// uses. One evicted with bytes (a gathered layer kept unpinned, a gradient waiting for its bucket)
// is written to a scratch slot at the file's end, given back to the scratch's free list when the
// page is next declared zero; the file grows only when no free slot fits. A rank's file is so its
// own shard's slots plus the most its transient pages ever spilled at once. Re-homing (the
// adaptive policy, rehome_pages) leaves transient pages as they are.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "store/block_file.h"
#include "store/chunk_store.h"
#include "store/host_copier.h"

namespace keel {

// (Tier: core/config.h, the names tier.* spell.)
inline constexpr int kNumTiers = 3;
const char* tier_name(Tier t);

struct TierOptions {
  int64_t device_bytes = 0;  // present pages, device-homed ones included
  int64_t host_bytes = 0;    // host copies (and update_at_home's staging buffer)
  std::string nvme_dir;      // directory of the NVMe tier's file ("" = no NVMe tier)
  IoEngine engine = IoEngine::automatic;
  int lookahead = 16;        // acquires prefetched ahead of the current one
  bool prefetch = true;      // false: fetch on demand only (the naive baseline)
  // After the first step: re-home every page by its measured accesses per step and reuse
  // distance (see TierManager::rehome). The NVMe file then has a slot for every page.
  bool adaptive = false;
  int64_t reserve_bytes = 0;  // adaptive: device bytes kept free of homed pages (the working window)
  int write_delay_us = 0;     // tests, with the threads engine: NVMe writes start this late
  // A host-homed page's fetch is copied by a thread of its own (store/host_copier.h) and waited
  // for at its acquire, as an NVMe read is; false: copied at once by the thread that starts it.
  bool async_host = false;
  // A checksum (XXH3) of every page's bytes each time its version changes, checked at every
  // acquire: a transfer that lost, tore or mixed up bytes fails loudly at the page it hit instead
  // of drifting the run. Costs a hash of each page written and of each page acquired.
  bool verify = false;
  // Only the parameter plane's pages exist (a store of values that are never trained, such as a
  // KV cache's blocks): gradient and moment pages are neither homed nor counted.
  bool params_only = false;
  // Planes whose pages another residency holds (bit p set: plane p; the bf16 training state's
  // parameters and gradients, store/bf16_state.h): neither homed nor counted, as params_only's.
  uint8_t absent_planes = 0;
  // Routed pages (per page as the homes, 1 = routed; empty: none): a mixture of experts' routed
  // experts, acquired only when the router chose them. An acquire of routed pages of one plane
  // alone stays out of the recorded schedule (which cannot know the next choice): a hint() brings
  // them in, on the schedule or off it, once the router has chosen. (An acquire of several planes
  // or that mixes them with other pages, such as the optimizer's update of an expert's chunk,
  // happens every step and is scheduled.) They have an
  // NVMe slot each (where there is an NVMe tier), so that rehome_pages may move them anywhere.
  std::vector<uint8_t> routed;
  // Routed pages homed on host DRAM keep their home copy at their compute address (a CPU build,
  // where host DRAM and the compute tier are the same memory): fetching one and writing it back
  // move no bytes, only the device budget's accounting (present pages, as for any other), and
  // a gradient zeroed in place stays mapped. Their memory counts against the host budget.
  bool routed_host_in_place = false;
};

// What one page saw since it was last asked (TierManager::take_page_counters).
struct PageCounters {
  uint64_t acquires = 0;  // steps in which an acquire touched it (first touches, as TierCounters')
  uint64_t hits = 0;      // ... where it was present
  double stall_ms = 0;    // time those acquires waited for it
  uint64_t bytes_read = 0;  // brought into the device tier (fetches, prefetches and hints)
  PageCounters& operator+=(const PageCounters& o) {
    acquires += o.acquires, hits += o.hits, stall_ms += o.stall_ms, bytes_read += o.bytes_read;
    return *this;
  }
};

// What one tier (by the home of the pages) saw.
struct TierCounters {
  uint64_t acquires = 0;       // first touches of a page by an acquire
  uint64_t hits = 0;           // ... where the page was already present
  double stall_ms = 0;         // time acquires waited for this tier's pages
  std::vector<float> stalls_ms;  // each wait, for percentiles (reset by take_step_stats)
  uint64_t bytes_read = 0;     // from this tier into the device tier
  uint64_t bytes_written = 0;  // written back into this tier
  int64_t resident_bytes = 0;  // bytes this tier holds now (device: present pages)
  double hit_rate() const { return acquires ? static_cast<double>(hits) / static_cast<double>(acquires) : 1.0; }
};

struct TierStats {
  TierCounters tier[kNumTiers];
  uint64_t stale_refetches = 0;  // device copies found behind their owner's version
  uint64_t evictions = 0;
  uint64_t hint_fetches = 0;     // fetches a lookahead hint started (TierManager::hint)
  double acquire_ms = 0;  // time spent inside acquire (fetch waits, eviction, prefetch issue)
  // A step's acquires (once a schedule is recorded) that were not the schedule's at their place
  // (after the resync below), and the schedule's entries passed over to find a later one.
  // Sequence logic alone (no I/O timing): the same traffic gives the same counts.
  uint64_t off_schedule = 0, schedule_skips = 0;
  uint64_t between_steps = 0;  // acquires between end_step() and the next begin_step()
  int64_t peak_device_bytes = 0, peak_host_bytes = 0;
};

class TierManager {
 public:
  // Manages every page of `store` (finalized; moment pages outside a ZeRO shard do not exist)
  // with the homes given per page (homes[chunk * kNumPlanes + plane]). The store's current
  // contents are moved to the pages' homes, and only device-homed pages stay present. Throws
  // keel::Error naming the budget when the homes do not fit (the device budget must also leave
  // room for one chunk's four planes), or when the NVMe file cannot be created.
  TierManager(ChunkStore& store, const TierOptions& options, std::vector<Tier> homes);
  ~TierManager();
  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Makes `pages` present with their newest bytes and pins them until release(). Throws
  // keel::Error if the pinned pages cannot fit the device budget.
  void acquire(std::span<const PageRef> pages);
  // Unpins; `modified` marks the pages' device copies as newer than their homes.
  void release(std::span<const PageRef> pages, bool modified);
  // Marks a step's start. The acquires of the first step begun as `representative`, up to its
  // end_step(), become the schedule (a step unlike the steady state, such as the first one of a
  // run whose optimizer updates are deferred into the next forward pass, says false). Once there
  // is a schedule, the step's first `lookahead` acquires start their fetch here. A step not
  // ended by end_step() ends here (callers that mark step starts only: the KV cache, tests).
  void begin_step(bool representative = true);
  // Marks the end of the step's compute (the trainer: after the step engine's run, before its
  // checkpoint and any evaluation): acquires from here to the next begin_step() are off the
  // schedule (see above).
  void end_step();
  // The recorded step's acquires (0 until one is recorded).
  int64_t schedule_length() const { return scheduled_ ? static_cast<int64_t>(recorded_.size()) : 0; }
  // Forgets the recorded schedule: the next representative step is recorded anew (the step's
  // shape changed, e.g. a pipeline's micro-batch count).
  void record_again();
  // A hint that these pages will be acquired soon, nearest first (a pipeline executor's
  // lookahead, its current instruction's pages first). Where prefetch follows the recorded
  // schedule, that already covers them (exactly, and further ahead): nothing to do. Before a
  // schedule exists, or off it, those not present start their fetch, in order, into free room or
  // the room of the least recently used clean pages that are not hinted (never a pinned, hinted
  // or modified page). Routed pages (TierOptions::routed) are fetched on the schedule too, into
  // free room or that of the pages used farthest ahead (never one the coming acquire needs), and
  // are kept (not evicted while other room is found) until acquired or the step ends.
  // Returns the fetches started.
  int hint(std::span<const PageRef> pages);
  // Runs `update` on the page's home copy in place (the host copy; an NVMe page through a staging
  // buffer: read, update, write) and bumps the owner's version, ZeRO-Offload style: the optimizer
  // step of state that lives off the device runs where it lives. A device copy that was newer is
  // written home first; one that is present is now behind and is refetched at its next acquire.
  void update_at_home(PageRef p, const std::function<void(float* data, size_t n)>& update);
  // Declares the page's bytes zero (AdamW consumed the gradient): nothing is written back, the
  // device copy (if present and unpinned) is given back, and the next fetch is a memset.
  // `zeroed_in_place`: the caller zeroed the page's bytes at its address under a lease now over;
  // a page whose home copy is at its compute address (routed_host_in_place) then keeps them.
  void discard_to_zero(PageRef p, bool zeroed_in_place = false);
  // Waits for every transfer in flight (write-backs included).
  void drain();
  // Moves page pages[k]'s home to homes[k], with its newest bytes (every transfer in flight
  // completes first; moves off the device go first, then off host DRAM, then onto them). Throws
  // keel::Error, moving nothing, when the device-homed pages would leave less than `device_reserve`
  // bytes of the device budget free, the host copies would exceed the host budget, or a page bound
  // for NVMe has no slot (TierOptions::routed). A move onto or off host DRAM that changes whether
  // the page is updated at home (not a routed page leased in place) changes the optimizer's lease
  // of its chunk: the next representative step is recorded again as the schedule. Returns the
  // bytes moved onto each tier.
  std::vector<int64_t> rehome_pages(std::span<const PageRef> pages, std::span<const Tier> homes, int64_t device_reserve);
  // The page's counters since the last call (then reset).
  PageCounters take_page_counters(PageRef p);

  Tier home(PageRef p) const;
  // The page's home copy is its bytes at the compute address (TierOptions::routed_host_in_place).
  bool home_in_place(PageRef p) const;
  bool present(PageRef p) const;
  uint64_t version(PageRef p) const;
  const TierStats& stats() const { return stats_; }
  // The stats since the last call (counters reset, resident bytes kept).
  TierStats take_step_stats();
  // What the adaptive policy did at its re-homing ("" before, or without it); cleared by reading.
  std::string take_rehome_note();
  // The current homes, per page as in the constructor (non-existent pages: device).
  std::vector<Tier> homes() const;
  int64_t device_bytes_used() const { return device_used_; }
  int64_t host_bytes_used() const { return host_used_; }
  IoEngine engine() const;
  // The NVMe file: its size now (measured, fstat; 0 without one), and the part of it that is
  // scratch for transient pages (the slots past the homed pages'; it never shrinks).
  int64_t nvme_file_bytes() const;
  int64_t nvme_scratch_bytes() const;

 private:
  struct Page;
  struct Transfer;
  Page& page(PageRef p);
  bool in_place(const Page& pg) const;
  const Page& page(PageRef p) const;
  int index(PageRef p) const { return p.chunk * kNumPlanes + static_cast<int>(p.plane); }
  void acquire_group(const std::vector<int>& group);
  void fetch(int i);
  void settle(int i);
  void finish_oldest();
  void finish_fetch(int i);
  void evict(int i);
  void finish_writeback(int i);
  bool make_room(int64_t bytes, int64_t horizon);
  bool evict_for(int64_t bytes, int64_t horizon);
  int64_t leaving_bytes() const;
  bool finish_oldest_of(bool write);
  bool revive(int i);
  void rehome();
  void move_home(int i, Tier to);
  int64_t next_use(int i) const;
  void prefetch_ahead();
  // schedule_ from recorded_ less the deferred updates that ran between steps; pages' uses.
  void set_view();
  void poll();
  void give_back(int i);
  float* address(int i) const;
  void count_touch(int i, bool hit, double waited_ms);
  // tier.verify: page i's bytes at `version` are `data` (nullptr: all zero); checked at acquire.
  void note_bytes(int i, const void* data, uint64_t version);
  void check_bytes(int i) const;
  std::vector<char> zeros_;  // (verify) the largest page's worth of zero bytes
  // Transient pages' scratch slots: page i gets one before its bytes are written to the file, and
  // gives it back when declared zero (its write, if any, completed first).
  void take_scratch(int i);
  void free_scratch(int i);
  uint64_t scratch_begin_ = 0;                  // the file's offset where scratch starts
  std::map<uint64_t, uint64_t> scratch_free_;   // free scratch extents: offset -> bytes

  ChunkStore& store_;
  TierOptions options_;
  std::vector<Page> pages_;
  std::unique_ptr<BlockFile> file_;
  std::unique_ptr<HostCopier> copier_;  // async_host: the host-homed pages' fetches
  int64_t device_used_ = 0, host_used_ = 0;
  // The schedule: the recorded step's acquires (page indices), and per acquire the chunk whose
  // deferred update made it (-1: none); this step's view of it (without the updates that ran
  // between steps, applied_early_ per chunk), then the position in that view.
  std::vector<std::vector<int>> recorded_;
  std::vector<int> recorded_update_;
  std::vector<std::vector<int>> schedule_;
  std::vector<uint8_t> applied_early_;
  bool view_full_ = true;  // schedule_ is recorded_ whole
  bool recording_ = false, scheduled_ = false, on_schedule_ = false;
  bool in_step_ = false;   // between begin_step() and end_step()
  int64_t position_ = 0;   // acquires since the step began (between steps: 0, the next step's start)
  int64_t clock_ = 0;      // acquires since the start (for LRU before a schedule exists)
  int64_t stats_step_ = 0; // steps begun (first touches are counted once per step)
  std::vector<int> in_flight_;  // pages with a transfer in flight, oldest first
  TierStats stats_;
  std::string rehome_note_;
  bool trace_ = false;  // KEEL_TIER_TRACE set: each miss is logged to stderr (for tuning)
};

}  // namespace keel
