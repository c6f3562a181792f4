#include "runtime/memory_line.h"

#include <algorithm>
#include <cstdio>

#include "store/bf16_state.h"
#include "store/placement.h"

namespace keel {

std::string memory_per_rank_line(const TierConfig& tier, const ShardedOptimizer& optimizer, const TieredMemory* tiers,
                                 double moments_mb, double activation_bytes, double buffer_bytes) {
  const ShardedOptimizer::HeldMemory held = optimizer.held_memory(tiers != nullptr);
  char moments[320];
  double in_all = static_cast<double>(held.bytes);
  if (tiers == nullptr) {
    std::snprintf(moments, sizeof moments, "AdamW moments %.1f MB", moments_mb);
    in_all += moments_mb * 1e6;
  } else {
    // The device budget bounds the tiered pages present, the host budget their host copies.
    const Placement& placed = tiers->placement();
    const double tiered = static_cast<double>(placed.bytes[0] + placed.bytes[1] + placed.bytes[2]);
    const double present = std::min(tiered, static_cast<double>(tier.device_mib << 20));
    const double host = std::min(tiered, static_cast<double>(tier.host_mib << 20));
    const Bf16State* bf16 = optimizer.bf16_state();
    const bool moments_only = bf16 != nullptr && bf16->holds(Plane::param) && bf16->holds(Plane::grad);
    std::snprintf(moments, sizeof moments,
                  "%s through the tiers: up to %.1f MB present (tier.device_mib) + %.1f MB host copies (tier.host_mib)",
                  moments_only ? "AdamW moments" : "AdamW moments and the float32 planes above", present / 1e6,
                  host / 1e6);
    in_all += present + host;
  }
  in_all += activation_bytes + buffer_bytes;
  char line[1024];
  std::snprintf(line, sizeof line, "keel: memory per rank: %s, %s, activations %.1f MB, checkpoint buffers %.1f MB; %.1f MB in all",
                held.text.c_str(), moments, activation_bytes / 1e6, buffer_bytes / 1e6, in_all / 1e6);
  return line;
}

}  // namespace keel
