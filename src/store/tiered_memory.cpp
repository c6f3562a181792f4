#include "store/tiered_memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace keel {

namespace {

// The p-th percentile (0..1) of a tier's wait per first touch, hits counting as zero waits.
double stall_percentile(const TierCounters& c, double p) {
  if (c.acquires == 0 || c.stalls_ms.empty()) return 0;
  std::vector<float> misses = c.stalls_ms;
  std::sort(misses.begin(), misses.end());
  const uint64_t k = static_cast<uint64_t>(std::ceil(p * static_cast<double>(c.acquires)));
  const uint64_t zeros = c.acquires - misses.size();
  if (k <= zeros) return 0;
  return misses[std::min<size_t>(misses.size() - 1, static_cast<size_t>(k - zeros - 1))];
}

// Hit rate over the pages that live off the device (host and NVMe homes).
double offload_hit_rate(const TierStats& s) {
  uint64_t a = 0, h = 0;
  for (Tier t : {Tier::host, Tier::nvme}) {
    a += s.tier[static_cast<int>(t)].acquires;
    h += s.tier[static_cast<int>(t)].hits;
  }
  return a ? static_cast<double>(h) / static_cast<double>(a) : 1.0;
}

double total_stall_ms(const TierStats& s) {
  double ms = 0;
  for (const TierCounters& c : s.tier) ms += c.stall_ms;
  return ms;
}

void accumulate(TierStats& total, const TierStats& s) {
  for (int i = 0; i < kNumTiers; ++i) {
    TierCounters& a = total.tier[i];
    const TierCounters& b = s.tier[i];
    a.acquires += b.acquires;
    a.hits += b.hits;
    a.stall_ms += b.stall_ms;
    a.stalls_ms.insert(a.stalls_ms.end(), b.stalls_ms.begin(), b.stalls_ms.end());
    a.bytes_read += b.bytes_read;
    a.bytes_written += b.bytes_written;
    a.resident_bytes = b.resident_bytes;
  }
  total.evictions += s.evictions;
  total.acquire_ms += s.acquire_ms;
  total.stale_refetches += s.stale_refetches;
  total.hint_fetches += s.hint_fetches;
  total.off_schedule += s.off_schedule;
  total.schedule_skips += s.schedule_skips;
  total.between_steps += s.between_steps;
  total.peak_device_bytes = s.peak_device_bytes;
  total.peak_host_bytes = s.peak_host_bytes;
}

}  // namespace

TierResidency::TierResidency(TierManager& manager, ChunkStore& store)
    : manager_(manager), store_(store), grad_sums_(store.chunks().size()) {}

void TierResidency::release(std::span<const PageRef> pages, bool modified) {
  if (modified) {
    for (const PageRef& p : pages) {
      if (p.plane != Plane::grad) continue;
      GradSum& g = grad_sums_[static_cast<size_t>(p.chunk)];
      g.sum = sum_squares(store_.chunk_view(p.chunk, Plane::grad));  // present: still pinned
      g.valid = false;  // until the version the release gives it is known
    }
  }
  manager_.release(pages, modified);
  if (!modified) return;
  for (const PageRef& p : pages) {
    if (p.plane != Plane::grad) continue;
    GradSum& g = grad_sums_[static_cast<size_t>(p.chunk)];
    g.version = manager_.version(p);
    g.valid = true;
  }
}

bool TierResidency::known_sum_squares(PageRef p, double* out) const {
  if (p.plane != Plane::grad) return false;
  const GradSum& g = grad_sums_[static_cast<size_t>(p.chunk)];
  if (!g.valid || g.version != manager_.version(p)) return false;
  *out = g.sum;
  return true;
}

void TierResidency::discard(Plane plane, int64_t offset, int64_t numel) {
  for (const Chunk& c : store_.chunks_overlapping(offset, numel)) {
    const int64_t lo = std::max(offset, c.offset), hi = std::min(offset + numel, c.offset + c.numel);
    if (lo == c.offset && hi == c.offset + c.numel) {
      manager_.discard_to_zero({c.id, plane});
    } else {
      std::span<float> part = store_.range_view(plane, lo, hi - lo);
      std::fill(part.begin(), part.end(), 0.0f);
    }
  }
}

TieredMemory::TieredMemory(const TierConfig& config, ChunkStore& store, bool print_notes, uint8_t absent_planes)
    : config_(config), store_(store), print_notes_(print_notes) {
  store_.prefer_huge_pages();
  placement_ = place_pages(config_, store_, absent_planes);
  TierOptions options = tier_options(config_);
  options.absent_planes = absent_planes;
  options.reserve_bytes = 2 * placement_.working_set_bytes;  // adaptive: room for the working window
  // A mixture of experts' routed experts: their parameter and gradient pages are acquired only
  // when the router chose them (model/moe.h), and hinted right after it has.
  options.routed.assign(store_.chunks().size() * kNumPlanes, 0);
  for (const Chunk& c : store_.chunks()) {
    if (c.expert < 0) continue;
    for (Plane p : {Plane::param, Plane::grad}) options.routed[static_cast<size_t>(c.id) * kNumPlanes + static_cast<int>(p)] = 1;
  }
  // This build computes in host DRAM: a routed page homed there is leased where it lies (its
  // fetches and write-backs, a copy each and hundreds of page faults, were most of what host-homed
  // experts cost a step).
  options.routed_host_in_place = true;
  manager_ = std::make_unique<TierManager>(store_, options, placement_.homes);
  residency_ = std::make_unique<TierResidency>(*manager_, store_);
  store_.attach_residency(residency_.get());
}

TieredMemory::~TieredMemory() { store_.attach_residency(nullptr); }

int64_t TieredMemory::free_device_bytes() const {
  return (config_.device_mib << 20) - placement_.bytes[0] - 2 * placement_.working_set_bytes;
}

void TieredMemory::before_step(int64_t) {
  accumulate(totals_, manager_->take_step_stats());  // (an evaluation's traffic: the run's alone)
  manager_->begin_step(!config_.defer_update || store_.any_pending() || steps_begun_ >= 2);
  steps_begun_++;
}

void TieredMemory::step_computed(int64_t) { manager_->end_step(); }

void TieredMemory::after_step(int64_t) {
  step_ = manager_->take_step_stats();
  accumulate(totals_, step_);
  rehome_note_ = manager_->take_rehome_note();
  if (print_notes_ && !rehome_note_.empty()) std::printf("keel: tiered memory: %s\n", rehome_note_.c_str());
}

void TieredMemory::print_startup() const {
  const TierConfig& tc = config_;
  std::printf("keel: tiered memory: device %lld MiB (%.1f MB homed there), host %lld MiB (%.1f MB), nvme %.1f MB in %s "
              "(%s), working set %.1f MB, %s, lookahead %d\n",
              static_cast<long long>(tc.device_mib), placement_.bytes[0] / 1e6, static_cast<long long>(tc.host_mib),
              placement_.bytes[1] / 1e6, placement_.bytes[2] / 1e6, tc.nvme_dir.empty() ? "-" : tc.nvme_dir.c_str(),
              io_engine_name(manager_->engine()), placement_.working_set_bytes / 1e6,
              tc.prefetch ? "prefetch on" : "on demand (no prefetch)", tc.lookahead);
  for (const std::string& note : placement_.notes) std::printf("keel: tiered memory: %s\n", note.c_str());
  if (!tc.nvme_dir.empty() && store_.params_homed_in_part()) {
    std::printf("keel: tiered memory: other ranks' parameter and gradient pages (ZeRO-3) have no NVMe slots: "
                "evicted with bytes, they spill to scratch at the file's end\n");
  }
}

void TieredMemory::add_step_fields(double step_ms, nlohmann::json& line) {
  const TierStats& s = step_;
  line["tier_hit_rate"] = offload_hit_rate(s);
  line["tier_stall_ms"] = total_stall_ms(s);
  line["tier_stall_share"] = step_ms > 0 ? total_stall_ms(s) / step_ms : 0.0;
  line["tier_evictions"] = s.evictions;
  line["tier_acquire_ms"] = s.acquire_ms;
  line["tier_stale_refetches"] = s.stale_refetches;
  line["tier_hint_fetches"] = s.hint_fetches;
  line["tier_off_schedule"] = s.off_schedule;
  line["tier_schedule_skips"] = s.schedule_skips;
  for (int i = 0; i < kNumTiers; ++i) {
    const TierCounters& c = s.tier[i];
    const std::string p = std::string("tier_") + tier_name(static_cast<Tier>(i)) + "_";
    line[p + "hit_rate"] = c.hit_rate();
    line[p + "stall_mean_ms"] = c.acquires ? c.stall_ms / static_cast<double>(c.acquires) : 0.0;
    line[p + "stall_p99_ms"] = stall_percentile(c, 0.99);
    line[p + "read_bytes"] = c.bytes_read;
    line[p + "written_bytes"] = c.bytes_written;
    line[p + "resident_bytes"] = c.resident_bytes;
  }
  if (!config_.nvme_dir.empty()) {  // this rank's file: its size (measured, fstat) and its scratch part
    line["tier_nvme_file_bytes"] = manager_->nvme_file_bytes();
    line["tier_nvme_scratch_bytes"] = manager_->nvme_scratch_bytes();
  }
  if (!rehome_note_.empty()) line["tier_rehome"] = rehome_note_;
}

std::string TieredMemory::progress_fragment(double step_ms) const {
  const TierStats& s = step_;
  uint64_t in = 0, out = 0;
  for (const TierCounters& c : s.tier) in += c.bytes_read, out += c.bytes_written;
  char buf[200];
  std::snprintf(buf, sizeof buf, "tiers hit %.1f%% (host %.1f%%, nvme %.1f%%), stall %.1f ms (%.1f%%), %.0f MB in, %.0f MB out",
                100 * offload_hit_rate(s), 100 * s.tier[1].hit_rate(), 100 * s.tier[2].hit_rate(), total_stall_ms(s),
                step_ms > 0 ? 100 * total_stall_ms(s) / step_ms : 0.0, in / 1e6, out / 1e6);
  return buf;
}

void TieredMemory::print_summary() const {
  const TierStats& s = totals_;
  std::printf("keel: tiered memory over this run (first touches of each page per step; device pages never leave):\n");
  std::printf("  %-7s %10s %9s %10s %10s %10s %11s\n", "tier", "homed MB", "hit rate", "stall ms", "p99 ms", "read MB",
              "written MB");
  for (int i = 0; i < kNumTiers; ++i) {
    const TierCounters& c = s.tier[i];
    std::printf("  %-7s %10.1f %8.1f%% %10.1f %10.2f %10.1f %11.1f\n", tier_name(static_cast<Tier>(i)),
                placement_.bytes[i] / 1e6, 100 * c.hit_rate(), c.stall_ms, stall_percentile(c, 0.99), c.bytes_read / 1e6,
                c.bytes_written / 1e6);
  }
  std::printf("  off-device hit rate %.1f%%, %llu evictions, %llu stale copies refetched, %.0f ms inside acquires; "
              "peak device %.1f MB of %lld MiB, host %.1f MB of %lld MiB\n",
              100 * offload_hit_rate(s), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.stale_refetches), s.acquire_ms, s.peak_device_bytes / 1e6,
              static_cast<long long>(config_.device_mib), s.peak_host_bytes / 1e6,
              static_cast<long long>(config_.host_mib));
}

}  // namespace keel
