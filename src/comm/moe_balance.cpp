#include "runtime/moe_balance.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/cpu/moe.h"
#include "model/moe.h"

namespace keel {

MoeBiasBalancer::MoeBiasBalancer(const ModelConfig& m, Communicator& dp, GPT& model)
    : dp_(dp), rate_(static_cast<float>(m.moe_bias_rate)), experts_(m.moe_experts) {
  for (int l = 0; l < model.num_layers(); ++l) {
    if (MoeFeedForward* moe = model.layer(l).moe()) blocks_.push_back(moe);
  }
  check(!blocks_.empty(), "model.moe_balance = \"bias\": the model has no mixture-of-experts block");
}

void MoeBiasBalancer::after_step(bool applied) {
  if (!applied) {
    for (MoeFeedForward* b : blocks_) std::fill(b->step_load().begin(), b->step_load().end(), 0.0);
    return;
  }
  std::vector<double> load;
  load.reserve(blocks_.size() * experts_);
  for (MoeFeedForward* b : blocks_) load.insert(load.end(), b->step_load().begin(), b->step_load().end());
  if (dp_.size() > 1) dp_.allreduce_sum(load.data(), load.size());  // (counts: exact in any order)
  for (size_t i = 0; i < blocks_.size(); ++i) {
    moe::update_balance_bias(blocks_[i]->routing_bias().data(), load.data() + i * experts_, experts_, rate_);
    std::fill(blocks_[i]->step_load().begin(), blocks_[i]->step_load().end(), 0.0);
  }
}

namespace {

std::string layout_of(size_t blocks, int experts) {
  const nlohmann::json j = {
      {"what", "the routing biases of model.moe_balance = \"bias\" (" + std::to_string(blocks) + " MoE blocks x " +
                   std::to_string(experts) + " experts)"},
      {"moe_blocks", blocks},
      {"experts", experts}};
  return j.dump();
}

}  // namespace

std::string MoeBiasBalancer::save(int64_t, std::vector<float>& floats) {
  for (MoeFeedForward* b : blocks_) floats.insert(floats.end(), b->routing_bias().begin(), b->routing_bias().end());
  return layout_of(blocks_.size(), experts_);
}

std::string MoeBiasBalancer::check_resume(const std::string& layout, size_t floats) const {
  if (layout.empty()) return "";
  const std::string mine = layout_of(blocks_.size(), experts_);
  std::string what;
  try {
    what = nlohmann::json::parse(layout).at("what").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    what = "an unreadable description";
  }
  if (layout != mine) {
    return "its ranks saved " + what + ", this run has " + nlohmann::json::parse(mine).at("what").get<std::string>() +
           " (model.moe_experts / moe_every differ)";
  }
  if (floats != blocks_.size() * experts_) {
    return "its routing biases hold " + std::to_string(floats) + " floats, expected " +
           std::to_string(blocks_.size() * experts_) + " (" + what + ")";
  }
  return "";
}

void MoeBiasBalancer::restore(const std::string& layout, const std::vector<float>& floats) {
  for (size_t i = 0; i < blocks_.size(); ++i) {
    std::vector<float>& bias = blocks_[i]->routing_bias();
    if (layout.empty()) {  // none saved (a run balanced by "aux" until here): the biases start from zero
      std::fill(bias.begin(), bias.end(), 0.0f);
    } else {
      std::copy(floats.begin() + i * experts_, floats.begin() + (i + 1) * experts_, bias.begin());
    }
    std::fill(blocks_[i]->step_load().begin(), blocks_[i]->step_load().end(), 0.0);
  }
}

}  // namespace keel
