// DeepSeek's auxiliary-loss-free balancing of a mixture of experts (model.moe_balance = "bias"):
// every MoE block routes by its probabilities plus a per-expert bias (model/moe.h), and after
// every optimizer step this moves each bias by model.moe_bias_rate x sign(mean load - load), the
// loads (pairs routed to each expert over the step) summed over the data-parallel ranks, so every
// rank holds the same biases and N ranks route as one rank with the whole batch. In a pipeline
// each stage moves its own blocks' biases (their loads summed over the stage's replicas), and the
// stages then merge them, so every rank carries every block's. The biases are the step engine's
// carried state: every checkpoint saves the whole model's, a resume (on any number of ranks and
// stages) restores them.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/carried_state.h"
#include "core/config.h"
#include "model/gpt.h"

namespace keel {

class MoeFeedForward;

class MoeBiasBalancer final : public CarriedState {
 public:
  // Over the MoE blocks of `model` this rank holds: all of them, or with a pipeline (`stages`: the
  // replica's pipeline group) its stage's.
  MoeBiasBalancer(const ModelConfig& m, Communicator& dp, GPT& model, Communicator* stages = nullptr);
  // After the optimizer step (every rank): sums the step's loads over the ranks and moves the
  // biases, unless the step was skipped (`applied` false: a non-finite loss or norm, the same on
  // every rank), then starts the next step's loads from zero; with a pipeline, merges the stages'.
  void after_step(bool applied);

  std::string save(int64_t steps_done, std::vector<float>& floats) override;
  std::string check_resume(const std::string& layout, size_t floats) const override;
  void restore(const std::string& layout, const std::vector<float>& floats) override;
  bool replicated() const override { return true; }

 private:
  Communicator& dp_;
  Communicator* stages_;
  float rate_;
  int experts_;
  std::vector<MoeFeedForward*> blocks_;  // this rank's
  std::vector<int> index_;               // each one's place among the model's MoE blocks
  std::vector<float> all_;               // every MoE block's biases [blocks x experts], in layer order
  void merge();                          // this rank's blocks' biases into all_, then over the stages
};

}  // namespace keel
