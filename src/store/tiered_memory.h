// Tiered memory as a component of a training run ([tier]): the placement of every page, the tier
// manager attached to the chunk store as its residency, and what it reports (per step: hit
// rates, stalls, bytes moved; at the end of the run: a table per tier).
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "store/chunk_store.h"
#include "store/placement.h"
#include "store/tiers.h"

namespace keel {

// The tier manager as the chunk store's residency. Beside the manager's own work it keeps, for
// every gradient page a lease wrote, the sum of squares of its bytes (computed as the lease ends,
// while the page is still present), so that the clipping norm reads cached sums instead of
// fetching every gradient page again.
class TierResidency final : public Residency {
 public:
  TierResidency(TierManager& manager, ChunkStore& store);
  bool always_present() const override { return false; }
  void acquire(std::span<const PageRef> pages) override { manager_.acquire(pages); }
  void release(std::span<const PageRef> pages, bool modified) override;
  int hint(std::span<const PageRef> pages) override { return manager_.hint(pages); }
  uint64_t version(PageRef p) const override { return manager_.version(p); }
  // Declared zero: nothing written back or read, the next fetch is a memset.
  void zero(PageRef p, bool zeroed_in_place) override { manager_.discard_to_zero(p, zeroed_in_place); }
  // A page wholly inside the range is declared zero; the part of a page the range covers is
  // cleared in place (the caller holds a lease on it).
  void discard(Plane plane, int64_t offset, int64_t numel) override;
  // Pages homed in host DRAM are updated there (ZeRO-Offload's CPU optimizer step), except those
  // whose home is their compute address (leased there like any present page).
  bool updates_at_home(PageRef p) const override {
    return manager_.home(p) == Tier::host && !manager_.home_in_place(p);
  }
  void update_at_home(PageRef p, const std::function<void(float*, size_t)>& update) override {
    manager_.update_at_home(p, update);
  }
  bool known_sum_squares(PageRef p, double* out) const override;
  void step_shape_changed() override { manager_.record_again(); }

 private:
  TierManager& manager_;
  ChunkStore& store_;
  struct GradSum {
    double sum = 0;
    uint64_t version = 0;
    bool valid = false;
  };
  std::vector<GradSum> grad_sums_;
};

class TieredMemory final : public MetricsSource, public StepHook {
 public:
  // Places the pages of `store` (finalized; moments sharded if they will be) under the budgets
  // of `config` and attaches a tier manager to the store as its residency. Throws keel::Error
  // naming the key when the budgets cannot hold the state. `print_notes`: print a re-homing of
  // pages (adaptive policy) as it happens (rank 0). `absent_planes` (bit p: plane p): planes the
  // store's residency before this one holds itself (the bf16 training state's parameters and
  // gradients): the tiers neither home nor count them, and that residency wraps the tiers'.
  TieredMemory(const TierConfig& config, ChunkStore& store, bool print_notes, uint8_t absent_planes = 0);
  ~TieredMemory() override;

  TierManager& manager() { return *manager_; }
  const Placement& placement() const { return placement_; }
  // Device bytes left beside the homed pages and two operations' working sets (gradient buckets
  // in flight pin their pages within it).
  int64_t free_device_bytes() const;
  // Before a step: marks its start for the manager's schedule (with deferred updates, a step
  // with nothing pending is not what later steps look like: the first one, or one after an
  // evaluation or a checkpoint, which ran the updates early; from the third step on, one is
  // taken as it is, since then something between steps runs them every time). What ran between
  // the steps (evaluations) goes into the run's totals, not into a step's line.
  void before_step(int64_t step) override;
  // After the step's compute: marks its end (checkpoints and evaluations are off the schedule).
  void step_computed(int64_t step) override;
  // After a step: its counters (its compute and its checkpoint), for the step's report and the
  // run's totals.
  void after_step(int64_t step) override;

  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;

 private:
  const TierConfig& config_;
  ChunkStore& store_;
  Placement placement_;
  std::unique_ptr<TierManager> manager_;
  std::unique_ptr<TierResidency> residency_;
  bool print_notes_;
  TierStats step_, totals_;
  int64_t steps_begun_ = 0;
  std::string rehome_note_;
};

}  // namespace keel
