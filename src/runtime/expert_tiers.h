// A mixture of experts' routed experts in the memory tiers, as a component of a tiered run with
// MoE blocks: what each expert's pages saw per step (the step line's `tier_experts`: per MoE
// block and expert, first touches, hits, stall and bytes read of its parameter and gradient
// pages, and its home), and when asked to (`rehome_every` > 0) the experts' homes, planned every
// rehome_every optimizer steps from the pairs routed to each expert since the last plan, summed
// over the data-parallel group (store/expert_homes.h: most chosen on the device, then host DRAM,
// then NVMe, with hysteresis) and moved by the tier manager (TierManager::rehome_pages); with bf16
// gradients (store/bf16_state.h, outside the tiers) an expert's parameter pages alone. With
// sharded experts (parallel.expert > 1) a rank's store, and so its tiers, hold only its own
// experts: it reports and re-homes those (named by their global numbers in the block). In a
// pipeline a rank holds its stage's MoE blocks: it counts and re-homes those, and the line holds
// every block's, merged over the stages (each block on one stage: the others add zeros, exactly).
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/gpt.h"
#include "store/tiered_memory.h"

namespace keel {

class ExpertTiers final : public MetricsSource, public StepHook {
 public:
  // Over the MoE blocks of `model` whose experts' chunks `store` holds (Chunk::expert). The
  // experts' re-homed pages are their parameter and gradient pages (the moments stay where the
  // placement put them: only the optimizer touches them). `device_reserve`: device bytes kept
  // free of homed pages beside the experts (the working window, gradient buckets in flight).
  // `rehome_every`: optimizer steps between two re-homings by routing share (0: never); the
  // shares are summed over `dp` (collective at each re-homing: every rank of it plans at the same steps).
  // `stages`: the replica's pipeline group (null: none), over which the line's figures merge.
  // `absent_planes` (bit p: plane p): planes the tiers do not hold (bf16 gradients,
  // store/bf16_state.h): an expert's pages are then its pages of the other plane.
  ExpertTiers(const TierConfig& config, ChunkStore& store, TieredMemory& tiers, GPT& model, Communicator& dp,
              int64_t device_reserve, int rehome_every, bool print_notes, Communicator* stages = nullptr,
              uint8_t absent_planes = 0);

  // Takes the step's routing counts (before the routing report resets them) and each expert's
  // page counters; every experts_every steps under by_frequency, re-homes the experts.
  void after_step(int64_t step) override;
  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;
  // A pipeline's re-cut (every rank, after the step's hooks ran and before its line; collective
  // over the stages): this component, built over the new stages' blocks, takes over `from`'s (the
  // old stages'): the pairs routed to each block's experts since the last plan, the step's and the
  // run's page counters (each block's to the stage now holding it), and, under by_frequency, the
  // shares of the last plan, from which it re-homes its experts at once within its own rooms (the
  // homes the last plan would have given them on this stage).
  void carry(const ExpertTiers& from);

 private:
  struct Expert {
    int block = 0;                // index among the MoE blocks
    int index = 0;                // the expert's number in its block (of all the block's experts)
    std::vector<PageRef> pages;   // its parameter and gradient pages (those the tiers hold)
    int64_t bytes = 0;            // their bytes
    Tier home = Tier::nvme;
    PageCounters step, total;
  };
  const TierConfig& config_;
  TierManager& manager_;
  Communicator& dp_;
  Communicator* stages_;
  std::vector<MoeStats*> stats_;
  // Per MoE block held here and expert of the block (every one, held here or not): the pairs this
  // rank's tokens routed to it since the last plan; and (by_frequency) the shares of the last plan.
  std::vector<double> routed_, planned_;
  bool planned_once_ = false;  // a plan ran (on every rank alike: the same steps)
  int block_experts_ = 0;
  std::vector<int> layers_;      // per MoE block held here: its store layer
  std::vector<int> all_layers_;  // the store layer of every MoE block of the model, in order
  std::vector<int> index_;       // per MoE block held here: its place among all_layers_
  std::vector<Expert> experts_;
  int64_t device_room_ = 0, host_room_ = 0;
  int rehome_every_ = 0;
  bool print_notes_;
  std::string note_;        // the last re-homing, for the step line
  int64_t rehomings_ = 0;   // plans that moved pages
  void rehome();
  // Homes the experts by `shares` (per held block and expert, as routed_) and moves their pages.
  void plan_and_move(const std::vector<double>& shares);
  // One line's figures of an expert: this rank's, or in a pipeline every stage's.
  struct Figures {
    int layer = 0, index = 0;
    PageCounters step;
    Tier home = Tier::nvme;
  };
  std::vector<Figures> line_figures();
};

}  // namespace keel
