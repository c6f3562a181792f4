#include "store/placement.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/text.h"

namespace keel {

namespace {

struct LayerRule {
  int lo = 0, hi = 0;  // inclusive; hi = -1: open
  Tier tier = Tier::device;
};

std::vector<LayerRule> parse_layer_rules(const std::string& text) {
  std::vector<LayerRule> rules;
  if (trim(text).empty()) return rules;
  std::stringstream in(text);
  std::string entry;
  while (std::getline(in, entry, ',')) {
    const std::string e = trim(entry);
    auto bad = [&](const std::string& why) {
      return Error("config key 'tier.layers': entry '" + e + "': " + why +
                   " (expected LO-HI:tier entries separated by commas, e.g. \"0-0:host,1-4:nvme\")");
    };
    const size_t colon = e.find(':');
    if (colon == std::string::npos) throw bad("no ':tier'");
    const std::string range = trim(e.substr(0, colon));
    const size_t dash = range.find('-');
    if (dash == std::string::npos) throw bad("no LO-HI range");
    LayerRule r;
    r.tier = parse_enum<Tier>(trim(e.substr(colon + 1)), "tier.layers");
    try {
      size_t used = 0;
      const std::string lo = trim(range.substr(0, dash)), hi = trim(range.substr(dash + 1));
      r.lo = std::stoi(lo, &used);
      if (used != lo.size() || r.lo < 0) throw bad("LO is not a whole number >= 0");
      if (hi.empty()) {
        r.hi = -1;
      } else {
        r.hi = std::stoi(hi, &used);
        if (used != hi.size() || r.hi < r.lo) throw bad("HI is not a whole number >= LO");
      }
    } catch (const std::logic_error&) {
      throw bad("bounds are not whole numbers");
    }
    rules.push_back(r);
  }
  return rules;
}

}  // namespace

bool tiering_enabled(const TierConfig& t) { return t.device_mib > 0; }

void validate_tier_config(const TierConfig& t, int n_layer) {
  auto require = [](bool ok, const std::string& key, const std::string& want, const std::string& found) {
    if (!ok) throw Error("config key '" + key + "': expected " + want + ", found " + found);
  };
  require(t.device_mib >= 0, "tier.device_mib", ">= 0 (0 = tiering off)", std::to_string(t.device_mib));
  require(t.host_mib >= 0, "tier.host_mib", ">= 0", std::to_string(t.host_mib));
  require(t.lookahead >= 0, "tier.lookahead", ">= 0", std::to_string(t.lookahead));
  for (const LayerRule& r : parse_layer_rules(t.layers)) {
    require(r.lo <= n_layer + 1, "tier.layers", "layers 0.." + std::to_string(n_layer + 1), std::to_string(r.lo));
  }
  // (Every ZeRO stage combines with tiers: under ZeRO-3 the policy homes a rank's shard; other
  // ranks' parameter pages come by broadcast into the compute tier, comm/sharded_params.h.)
}

TierOptions tier_options(const TierConfig& t) {
  TierOptions o;
  o.device_bytes = t.device_mib << 20;
  o.host_bytes = t.host_mib << 20;
  o.nvme_dir = t.nvme_dir;
  o.engine = t.engine;
  o.lookahead = t.lookahead;
  o.prefetch = t.prefetch;
  o.verify = t.verify;
  o.adaptive = t.policy == TierPolicy::adaptive;
  return o;
}

Placement place_pages(const TierConfig& t, const ChunkStore& store, uint8_t absent_planes) {
  Placement out;
  const auto& chunks = store.chunks();
  const int n = static_cast<int>(chunks.size());
  const int m_begin = store.moment_chunks().first, m_end = store.moment_chunks().second;
  // ZeRO-3 with an NVMe tier: other ranks' parameter and gradient pages are transient (tiers.h),
  // homed nowhere: no budget, no slot (nvme stands for their zero home and scratch slots).
  const bool sharded = !t.nvme_dir.empty() && store.params_homed_in_part();
  auto transient = [&](int c, int p) { return sharded && p <= static_cast<int>(Plane::grad) && !store.param_homed(c); };
  auto exists = [&](int c, int p) {
    return ((absent_planes >> p) & 1) == 0 && (p < static_cast<int>(Plane::adam_m) || (c >= m_begin && c < m_end)) &&
           !transient(c, p);
  };
  const std::vector<LayerRule> rules = parse_layer_rules(t.layers);
  out.homes.assign(static_cast<size_t>(n) * kNumPlanes, Tier::device);
  for (int c = 0; c < n; ++c) {
    const Chunk& ch = chunks[c];
    Tier home = Tier::device;
    switch (ch.kind) {
      case ChunkKind::embedding:
      case ChunkKind::head: home = t.embedding; break;
      case ChunkKind::attention: home = t.attention; break;
      case ChunkKind::ffn: home = t.ffn; break;
      case ChunkKind::norm: home = t.norm; break;
    }
    for (const LayerRule& r : rules)
      if (ch.layer >= r.lo && (r.hi < 0 || ch.layer <= r.hi)) home = r.tier;
    for (int p = 0; p < kNumPlanes; ++p) {
      const bool moment = p >= static_cast<int>(Plane::adam_m);
      out.homes[c * kNumPlanes + p] = transient(c, p) ? Tier::nvme : moment && t.optimizer.has_value() ? *t.optimizer : home;
    }
  }
  // The largest set one operation pins: a layer's parameters (or gradients), plus the
  // embedding's for the tied head, or one chunk's four planes in the optimizer. A mixture of
  // experts leases its routed experts one at a time (model/moe.h): its layer's pages outside the
  // experts and its largest expert's; under ZeRO-3 (a store whose parameters are homed in part:
  // ChunkStore::home_params) it leases its whole layer, every expert gathered with it (or, its
  // experts gathered apart, comm/expert_parallel.h experts_gathered_apart, one at a time: the
  // whole layer is then an upper bound).
  int last_layer = 0;
  for (const Chunk& ch : chunks) last_layer = std::max(last_layer, ch.layer);
  std::vector<int64_t> layer_bytes(static_cast<size_t>(last_layer) + 1, 0);
  std::vector<int64_t> largest_expert(static_cast<size_t>(last_layer) + 1, 0);
  std::map<std::pair<int, int>, int64_t> expert_bytes;  // (layer, expert)
  int64_t largest_chunk = 0;
  const bool whole_layers = store.params_homed_in_part();
  for (const Chunk& ch : chunks) {
    if (ch.expert >= 0 && !whole_layers) {
      int64_t& b = expert_bytes[{ch.layer, ch.expert}];
      b += 4 * ch.numel;
      largest_expert[ch.layer] = std::max(largest_expert[ch.layer], b);
    } else {
      layer_bytes[ch.layer] += 4 * ch.numel;
    }
    largest_chunk = std::max<int64_t>(largest_chunk, 4 * ch.numel);
  }
  for (int l = 0; l <= last_layer; ++l) layer_bytes[l] += largest_expert[l];
  // Planes held elsewhere (absent_planes) are not in any working set here: a layer's leases pass
  // the tiers nothing when both its parameters and gradients are held so.
  int tiered_planes = 0;
  for (int p = 0; p < kNumPlanes; ++p) tiered_planes += ((absent_planes >> p) & 1) == 0 ? 1 : 0;
  const bool layers_tiered = ((absent_planes >> static_cast<int>(Plane::param)) & 1) == 0 ||
                             ((absent_planes >> static_cast<int>(Plane::grad)) & 1) == 0;
  int64_t ws = tiered_planes * largest_chunk;
  for (int l = 0; layers_tiered && l <= last_layer; ++l) {
    ws = std::max(ws, layer_bytes[l] + (l == last_layer && l > 0 ? layer_bytes[0] : 0));
  }
  out.working_set_bytes = ws;

  const int64_t device_budget = t.device_mib << 20, host_budget = t.host_mib << 20;
  // Bytes a page takes on a tier: host and NVMe slots are whole 4 KiB pages. Kept as running
  // totals per tier (demotion moves pages one at a time).
  auto bytes_on = [&](int c, Tier tier) {
    return tier == Tier::device ? 4 * chunks[c].numel : (4 * chunks[c].numel + 4095) / 4096 * 4096;
  };
  int64_t totals[kNumTiers] = {};
  for (int c = 0; c < n; ++c)
    for (int p = 0; p < kNumPlanes; ++p)
      if (exists(c, p)) totals[static_cast<int>(out.homes[c * kNumPlanes + p])] += bytes_on(c, out.homes[c * kNumPlanes + p]);
  auto total = [&](Tier tier) { return totals[static_cast<int>(tier)]; };
  // Demote from `from` to `to`, moments first, then gradients, then parameters (the pages used
  // least often per byte), larger chunks first, until `fits` holds.
  auto demote = [&](Tier from, Tier to, const std::function<bool()>& fits, const char* why) {
    int64_t moved = 0;
    for (int p = kNumPlanes - 1; p >= 0 && !fits(); --p) {
      std::vector<int> order;
      for (int c = 0; c < n; ++c)
        if (exists(c, p) && out.homes[c * kNumPlanes + p] == from) order.push_back(c);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return chunks[a].numel > chunks[b].numel; });
      for (int c : order) {
        if (fits()) break;
        out.homes[c * kNumPlanes + p] = to;
        totals[static_cast<int>(from)] -= bytes_on(c, from);
        totals[static_cast<int>(to)] += bytes_on(c, to);
        moved += 4 * chunks[c].numel;
      }
    }
    if (moved > 0) {
      out.notes.push_back(format_mib(moved) + " moved from " + tier_name(from) + " to " + tier_name(to) + " (" + why + ")");
    }
  };
  const int64_t staging = 2 * ((largest_chunk + 4095) / 4096 * 4096);
  // Prefetching needs room for the next operation's pages beside the current one's: the device
  // tier keeps two working sets free of homed pages where it can (one where it cannot).
  demote(Tier::device, Tier::host,
         [&] { return total(Tier::device) + (t.prefetch ? 2 : 1) * ws <= device_budget || total(Tier::device) == 0; },
         "tier.device_mib leaves room for the working window only");
  demote(Tier::host, Tier::nvme, [&] { return total(Tier::host) + staging <= host_budget; },
         "tier.host_mib is short");
  if (total(Tier::device) + ws > device_budget) {
    throw Error("config key 'tier.device_mib': " + std::to_string(t.device_mib) + " MiB cannot hold one operation's working set (" +
                format_mib(ws) + ": the largest layer's parameters, with the embedding for the tied head)");
  }
  for (int tier = 0; tier < kNumTiers; ++tier) out.bytes[tier] = total(static_cast<Tier>(tier));
  if (out.bytes[static_cast<int>(Tier::nvme)] > 0 && t.nvme_dir.empty()) {
    throw Error("config key 'tier.nvme_dir': " + format_mib(out.bytes[static_cast<int>(Tier::nvme)]) +
                " of pages go to the NVMe tier (by class or for want of budget) but no directory is set");
  }
  return out;
}

}  // namespace keel
