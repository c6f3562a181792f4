// The start-up line "keel: memory per rank: ...": what one rank holds, figure by figure, each
// counted once, and their sum ("in all", which bench/zero3.py predicts from). Under ZeRO-3 the
// parameters and gradients are the rank's shard plus what is in flight; under bf16 state its bf16
// bits beside the float32 masters of its shard; the planes the memory tiers hold count as the
// tiers' budgets (what is homed on NVMe is not in memory).
#pragma once

#include <string>

#include "comm/sharded_optimizer.h"
#include "core/config.h"
#include "store/tiered_memory.h"

namespace keel {

// `tiers`: null without memory tiers. `moments_mb`: the AdamW moments a rank holds (untiered).
std::string memory_per_rank_line(const TierConfig& tier, const ShardedOptimizer& optimizer, const TieredMemory* tiers,
                                 double moments_mb, double activation_bytes, double buffer_bytes);

}  // namespace keel
