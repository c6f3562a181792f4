// What a mixture of experts' routers measured (model/moe.h MoeStats), per MoE block and optimizer
// step, summed over the data-parallel ranks (and in a pipeline merged over the stages): the step line's `moe_layers` (per block: pairs routed
// to each expert, load imbalance = the busiest expert's pairs over the mean, dropped pairs, mean
// router entropy in nats, the balancing loss, the routing biases under model.moe_balance = "bias")
// and its summaries `moe_imbalance` (the largest block's), `moe_dropped` (all blocks') and
// `moe_entropy` (the blocks' mean), which the alerts, the Prometheus endpoint and the report read.
// With expert parallelism also `moe_expert_rows_bytes` (the rank's experts' side resident: the rows
// its experts received at most so far, to whole pages) and `moe_expert_rows_reserved_bytes` (the
// address space kept for the dropless worst case, P N k rows per block and slot).
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/metrics_source.h"
#include "model/gpt.h"

namespace keel {

struct MoeStats;
class MoeFeedForward;

// One block's figures of one step (all ranks').
struct MoeStepFigures {
  int layer = 0;
  std::vector<double> tokens;  // per expert: (token, choice) pairs routed to it, dropped ones too
  double imbalance = 0;        // max over experts of tokens / their mean (1 = perfectly even)
  double dropped = 0;          // pairs over capacity
  double entropy = 0;          // the router's mean entropy per token (nats)
  double aux = 0;              // the balancing loss, mean over sequences
};

// Imbalance, entropy and the balancing loss of one block from `stats` summed over ranks.
MoeStepFigures moe_step_figures(const MoeStats& stats);

class MoeRoutingReport final : public MetricsSource {
 public:
  // Over the MoE blocks of `model` (`m`'s) this rank holds: all of them, or with a pipeline
  // (`stages`: the replica's pipeline group) its stage's; the line holds every block's, merged
  // over the stages as one rank holding the whole model would report them.
  MoeRoutingReport(Communicator& dp, GPT& model, const ModelConfig& m, Communicator* stages = nullptr);
  // (Every rank: sums the blocks' stats over the ranks and stages, then starts them from zero.)
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;
  // A pipeline's re-cut (every rank, after the step's hooks ran and before its line): this report,
  // built over the new stages' blocks, takes over `from`'s (the old stages'): the step's counts
  // not yet in a line, each block's moved to the stage now holding it (summed over the stages,
  // the others adding zeros: exact), and the run's totals, so the line and the summary read as
  // without the re-cut.
  void carry(const MoeRoutingReport& from);

 private:
  Communicator& dp_;
  Communicator* stages_;
  std::vector<MoeStats*> stats_;
  std::vector<MoeFeedForward*> blocks_;
  std::vector<int> layers_;  // the store layer of every MoE block of the model, in order
  std::vector<int> index_;   // each of this rank's blocks' place among them
  int experts_ = 0;
  bool bias_ = false;  // model.moe_balance = "bias": the line holds each block's biases
  std::vector<MoeStepFigures> last_;
  // Over the run, per block: pairs per expert, dropped pairs, the largest step imbalance.
  std::vector<MoeStepFigures> total_;
  int64_t steps_ = 0;
};

}  // namespace keel
