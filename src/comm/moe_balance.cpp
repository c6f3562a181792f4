#include "comm/moe_balance.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/cpu/moe.h"
#include "model/moe.h"

namespace keel {

MoeBiasBalancer::MoeBiasBalancer(const ModelConfig& m, Communicator& dp, GPT& model, Communicator* stages)
    : dp_(dp), stages_(stages), rate_(static_cast<float>(m.moe_bias_rate)), experts_(m.moe_experts) {
  int blocks = 0;  // the model's MoE blocks before each layer
  for (int l = 0; l < m.n_layer; ++l) {
    if (!m.moe_block(l)) continue;
    if (model.holds_any({l + 1})) {
      if (MoeFeedForward* moe = model.layer(l + 1).moe()) {
        blocks_.push_back(moe);
        index_.push_back(blocks);
      }
    }
    ++blocks;
  }
  check(blocks > 0, "model.moe_balance = \"bias\": the model has no mixture-of-experts block");
  all_.assign(static_cast<size_t>(blocks) * experts_, 0.0f);
}

void MoeBiasBalancer::after_step(bool applied) {
  if (!applied) {
    for (MoeFeedForward* b : blocks_) std::fill(b->step_load().begin(), b->step_load().end(), 0.0);
    return;
  }
  std::vector<double> load;
  load.reserve(blocks_.size() * experts_);
  for (MoeFeedForward* b : blocks_) load.insert(load.end(), b->step_load().begin(), b->step_load().end());
  if (dp_.size() > 1 && !load.empty()) dp_.allreduce_sum(load.data(), load.size());  // (counts: exact in any order)
  for (size_t i = 0; i < blocks_.size(); ++i) {
    moe::update_balance_bias(blocks_[i]->routing_bias().data(), load.data() + i * experts_, experts_, rate_);
    std::fill(blocks_[i]->step_load().begin(), blocks_[i]->step_load().end(), 0.0);
  }
  merge();
}

void MoeBiasBalancer::merge() {
  // Each block lives on one stage: the others add zeros to its biases (exact).
  if (stages_ != nullptr) std::fill(all_.begin(), all_.end(), 0.0f);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const std::vector<float>& bias = blocks_[i]->routing_bias();
    std::copy(bias.begin(), bias.end(), all_.begin() + static_cast<std::ptrdiff_t>(index_[i]) * experts_);
  }
  if (stages_ != nullptr && stages_->size() > 1) stages_->allreduce_sum(all_.data(), all_.size());
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
  floats.insert(floats.end(), all_.begin(), all_.end());
  return layout_of(all_.size() / experts_, experts_);
}

std::string MoeBiasBalancer::check_resume(const std::string& layout, size_t floats) const {
  if (layout.empty()) return "";
  const std::string mine = layout_of(all_.size() / experts_, experts_);
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
  if (floats != all_.size()) {
    return "its routing biases hold " + std::to_string(floats) + " floats, expected " + std::to_string(all_.size()) +
           " (" + what + ")";
  }
  return "";
}

void MoeBiasBalancer::restore(const std::string& layout, const std::vector<float>& floats) {
  // None saved (a run balanced by "aux" until here): the biases start from zero.
  if (layout.empty()) {
    std::fill(all_.begin(), all_.end(), 0.0f);
  } else {
    std::copy(floats.begin(), floats.begin() + static_cast<std::ptrdiff_t>(all_.size()), all_.begin());
  }
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const auto at = all_.begin() + static_cast<std::ptrdiff_t>(index_[i]) * experts_;
    std::copy(at, at + experts_, blocks_[i]->routing_bias().begin());
    std::fill(blocks_[i]->step_load().begin(), blocks_[i]->step_load().end(), 0.0);
  }
}

}  // namespace keel
