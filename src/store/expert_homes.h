// Homes for a mixture of experts' routed experts by how often the router chooses them
// (tier.experts = "by_frequency"): the most chosen experts' pages on the device, the next on
// host DRAM, the rest on NVMe. A plan is a value (one tier per expert), computed from measured
// shares alone, so it is tested against a brute-force answer and the runner (runtime/expert_tiers.h)
// only moves pages.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"

namespace keel {

struct ExpertHomesInput {
  std::span<const double> shares;   // per expert: (token, choice) pairs routed to it since the last plan
  std::span<const int64_t> bytes;   // per expert: the bytes its re-homed pages take (device or host)
  std::span<const Tier> current;    // per expert: where its pages live now
  int64_t device_room = 0;          // bytes the device tier may give experts
  int64_t host_room = 0;            // bytes host DRAM may give experts
  bool nvme = false;                // an NVMe tier exists (else what fits nowhere stays on host)
  // An expert that holds a tier keeps it against a challenger whose share is less than
  // `hysteresis` times its own (>= 1; 1 = no hysteresis): shares that wobble do not move pages.
  double hysteresis = 1.25;
};

// Requires shares, bytes and current of one size. The tier of each expert: experts are taken by
// decreasing share (an incumbent of the tier counting `hysteresis` times its share; a tie goes to
// the incumbent, then to the lower index) and given the device while their bytes fit device_room, then likewise host DRAM within
// host_room, the rest NVMe (without NVMe: host, whatever the room). An expert whose bytes do not
// fit the room left is passed over for a smaller one after it.
std::vector<Tier> plan_expert_homes(const ExpertHomesInput& in);

}  // namespace keel
