#include "runtime/moe_report.h"

#include <algorithm>
#include <cstdio>

#include "model/moe.h"

namespace keel {

MoeStepFigures moe_step_figures(const MoeStats& s) {
  MoeStepFigures f;
  f.layer = s.layer;
  f.tokens = s.tokens;
  double total = 0, most = 0;
  for (double t : s.tokens) total += t, most = std::max(most, t);
  const double mean = s.tokens.empty() ? 0 : total / static_cast<double>(s.tokens.size());
  f.imbalance = mean > 0 ? most / mean : 0;
  f.dropped = s.dropped;
  f.entropy = s.token_count > 0 ? s.entropy_sum / s.token_count : 0;
  f.aux = s.sequences > 0 ? s.aux_sum / s.sequences : 0;
  return f;
}

MoeRoutingReport::MoeRoutingReport(Communicator& dp, GPT& model, const ModelConfig& m, Communicator* stages)
    : dp_(dp), stages_(stages), experts_(m.moe_experts), bias_(m.moe_balance == MoeBalance::bias) {
  for (int l = 0; l < m.n_layer; ++l) {
    if (!m.moe_block(l)) continue;
    if (model.holds_any({l + 1})) {
      if (MoeStats* s = model.layer(l + 1).moe_stats()) {
        stats_.push_back(s);
        blocks_.push_back(model.layer(l + 1).moe());
        index_.push_back(static_cast<int>(layers_.size()));
      }
    }
    layers_.push_back(l + 1);
  }
}

void MoeRoutingReport::add_step_fields(double, nlohmann::json& line) {
  // Expert parallelism: this rank's (rank 0's in the line) experts' side, as resident now and as
  // kept for the worst case (model/moe.h MoeActivations).
  int64_t side = 0, reserved = 0;
  for (const MoeFeedForward* b : blocks_) side += b->expert_side_resident_bytes(), reserved += b->expert_side_reserved_bytes();
  if (reserved > 0) {
    line["moe_expert_rows_bytes"] = side;
    line["moe_expert_rows_reserved_bytes"] = reserved;
  }
  // Every block's stats in one vector: tokens per expert, then pairs, dropped, entropy, tokens,
  // balancing loss, sequences.
  const size_t width = static_cast<size_t>(experts_) + 6;
  std::vector<double> sums;
  for (const MoeStats* s : stats_) {
    sums.insert(sums.end(), s->tokens.begin(), s->tokens.end());
    sums.insert(sums.end(), {s->pairs, s->dropped, s->entropy_sum, s->token_count, s->aux_sum, s->sequences});
  }
  if (dp_.size() > 1 && !sums.empty()) dp_.allreduce_sum(sums.data(), sums.size());
  for (MoeStats* s : stats_) s->reset();
  // Every block of the model in its row (with its biases after the sums): this rank's, and with a
  // pipeline the other stages' (each block on one stage: the others add zeros, exactly).
  const size_t row = width + (bias_ ? static_cast<size_t>(experts_) : 0);
  std::vector<double> table(layers_.size() * row, 0.0);
  for (size_t i = 0; i < stats_.size(); ++i) {
    const auto at = table.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(index_[i]) * row);
    std::copy(sums.begin() + static_cast<std::ptrdiff_t>(i * width), sums.begin() + static_cast<std::ptrdiff_t>((i + 1) * width), at);
    if (bias_) std::copy(blocks_[i]->routing_bias().begin(), blocks_[i]->routing_bias().end(), at + static_cast<std::ptrdiff_t>(width));
  }
  if (stages_ != nullptr && stages_->size() > 1 && !table.empty()) stages_->allreduce_sum(table.data(), table.size());
  last_.clear();
  std::vector<std::vector<float>> biases;
  for (size_t b = 0; b < layers_.size(); ++b) {
    const double* r = table.data() + b * row;
    MoeStats all;
    all.layer = layers_[b];
    all.tokens.assign(r, r + experts_);
    size_t at = static_cast<size_t>(experts_);
    all.pairs = r[at++], all.dropped = r[at++], all.entropy_sum = r[at++], all.token_count = r[at++];
    all.aux_sum = r[at++], all.sequences = r[at++];
    last_.push_back(moe_step_figures(all));
    if (bias_) biases.emplace_back(r + width, r + row);
  }
  if (last_.empty() || last_.front().tokens.empty()) return;
  if (total_.empty()) total_ = last_;
  else {
    for (size_t i = 0; i < last_.size(); ++i) {
      for (size_t e = 0; e < last_[i].tokens.size(); ++e) total_[i].tokens[e] += last_[i].tokens[e];
      total_[i].dropped += last_[i].dropped;
      total_[i].imbalance = std::max(total_[i].imbalance, last_[i].imbalance);
    }
  }
  steps_++;
  nlohmann::json layers = nlohmann::json::array();
  double imbalance = 0, dropped = 0, entropy = 0;
  for (size_t i = 0; i < last_.size(); ++i) {
    const MoeStepFigures& f = last_[i];
    nlohmann::json j = {{"layer", f.layer},   {"tokens", f.tokens},   {"imbalance", f.imbalance},
                        {"dropped", f.dropped}, {"entropy", f.entropy}, {"aux", f.aux}};
    if (bias_) j["bias"] = biases[i];
    layers.push_back(std::move(j));
    imbalance = std::max(imbalance, f.imbalance);
    dropped += f.dropped;
    entropy += f.entropy / static_cast<double>(last_.size());
  }
  line["moe_imbalance"] = imbalance;
  line["moe_dropped"] = dropped;
  line["moe_entropy"] = entropy;
  line["moe_layers"] = std::move(layers);
}

void MoeRoutingReport::carry(const MoeRoutingReport& from) {
  const size_t width = static_cast<size_t>(experts_) + 6;  // as add_step_fields' rows
  std::vector<double> table(layers_.size() * width, 0.0);
  for (size_t i = 0; i < from.stats_.size(); ++i) {
    const MoeStats& s = *from.stats_[i];
    double* r = table.data() + static_cast<size_t>(from.index_[i]) * width;
    std::copy(s.tokens.begin(), s.tokens.end(), r);
    size_t at = static_cast<size_t>(experts_);
    r[at++] = s.pairs, r[at++] = s.dropped, r[at++] = s.entropy_sum, r[at++] = s.token_count;
    r[at++] = s.aux_sum, r[at++] = s.sequences;
  }
  if (stages_ != nullptr && stages_->size() > 1 && !table.empty()) stages_->allreduce_sum(table.data(), table.size());
  for (size_t i = 0; i < stats_.size(); ++i) {
    MoeStats& s = *stats_[i];
    const double* r = table.data() + static_cast<size_t>(index_[i]) * width;
    std::copy(r, r + experts_, s.tokens.begin());
    size_t at = static_cast<size_t>(experts_);
    s.pairs = r[at++], s.dropped = r[at++], s.entropy_sum = r[at++], s.token_count = r[at++];
    s.aux_sum = r[at++], s.sequences = r[at++];
  }
  last_ = from.last_;
  total_ = from.total_;
  steps_ = from.steps_;
}

std::string MoeRoutingReport::progress_fragment(double) const {
  if (last_.empty()) return "";
  double imbalance = 0, dropped = 0;
  for (const MoeStepFigures& f : last_) imbalance = std::max(imbalance, f.imbalance), dropped += f.dropped;
  char text[64];
  std::snprintf(text, sizeof text, "MoE imb %.2f", imbalance);
  std::string out = text;
  if (dropped > 0) {
    std::snprintf(text, sizeof text, " drop %.0f", dropped);
    out += text;
  }
  return out;
}

void MoeRoutingReport::print_summary() const {
  for (const MoeStepFigures& f : total_) {
    double total = 0, most = 0, least = 1e300;
    for (double t : f.tokens) total += t, most = std::max(most, t), least = std::min(least, t);
    const double mean = total / static_cast<double>(f.tokens.size());
    std::printf("keel: MoE block %d over %lld steps: busiest expert %.2fx the mean, idlest %.2fx, worst step %.2fx; "
                "%.0f of %.0f pairs dropped\n",
                f.layer, static_cast<long long>(steps_), mean > 0 ? most / mean : 0.0, mean > 0 ? least / mean : 0.0,
                f.imbalance, f.dropped, total);
  }
}

}  // namespace keel
