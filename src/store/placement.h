// Where each page of the chunk store lives between uses ([tier] in the config): the seed's
// classes by chunk kind, overrides by layer range and for the optimizer's moments, demoted
// (device -> host -> NVMe) where a budget is short, so that the tier manager never exceeds one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"
#include "store/tiers.h"

namespace keel {

// Checks the [tier] section; throws keel::Error("config key 'tier.X': ...") on a bad value.
void validate_tier_config(const TierConfig& t, int n_layer);
bool tiering_enabled(const TierConfig& t);

struct Placement {
  std::vector<Tier> homes;         // per page: homes[chunk * kNumPlanes + plane]
  int64_t working_set_bytes = 0;   // the largest set of pages one operation pins
  std::vector<std::string> notes;  // demotions made to fit the budgets, for the log
  int64_t bytes[kNumTiers] = {};   // bytes homed on each tier
};

// The homes for `store` (finalized, moments possibly sharded). Throws keel::Error naming the
// budget when even demotion cannot fit: a device budget below one operation's working set, or
// pages that must go to NVMe without tier.nvme_dir.
// `absent_planes` (bit p: plane p): planes another residency holds (TierOptions::absent_planes),
// neither homed nor counted.
Placement place_pages(const TierConfig& t, const ChunkStore& store, uint8_t absent_planes = 0);

TierOptions tier_options(const TierConfig& t);

}  // namespace keel
