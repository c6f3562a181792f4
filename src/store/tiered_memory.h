// Tiered memory as a component of a training run ([tier]): the placement of every page, the tier
// manager attached to the chunk store, and what it reports (per step: hit rates, stalls, bytes
// moved; at the end of the run: a table per tier).
#pragma once

#include <memory>

#include "core/config.h"
#include "core/metrics_source.h"
#include "store/chunk_store.h"
#include "store/placement.h"
#include "store/tiers.h"

namespace keel {

class TieredMemory final : public MetricsSource {
 public:
  // Places the pages of `store` (finalized; moments sharded if they will be) under the budgets
  // of `config` and attaches a tier manager to the store. Throws keel::Error naming the key
  // when the budgets cannot hold the state.
  TieredMemory(const TierConfig& config, ChunkStore& store);
  ~TieredMemory() override;

  TierManager& manager() { return *manager_; }
  const Placement& placement() const { return placement_; }
  // Device bytes left beside the homed pages and two operations' working sets (gradient buckets
  // in flight pin their pages within it).
  int64_t free_device_bytes() const;
  // At the end of every step: its counters, for the step's report and the run's totals; a
  // re-homing of pages (adaptive policy) is printed at once with `print_notes` (rank 0).
  void end_step(bool print_notes);

  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;

 private:
  const TierConfig& config_;
  ChunkStore& store_;
  Placement placement_;
  std::unique_ptr<TierManager> manager_;
  TierStats step_, totals_;
  std::string rehome_note_;
};

}  // namespace keel
