#include "pipeline/repartitioner.h"

#include <algorithm>
#include <cstdio>

#include "pipeline/layout.h"

namespace keel::pipeline {

using json = nlohmann::json;

Repartitioner::Repartitioner(const Config& config, Communicator& world, std::vector<LayerRange> cut,
                             std::function<const LayerCosts*()> costs,
                             std::function<json(const std::vector<LayerRange>&, const std::vector<LayerRange>&)> recut,
                             std::function<void(const json&)> log_event)
    : config_(config),
      world_(world),
      cut_(std::move(cut)),
      costs_(std::move(costs)),
      recut_(std::move(recut)),
      log_event_(std::move(log_event)),
      partitioner_(make_partitioner(config.parallel.partitioner, config.train.seed ^ 0x9E9A7ull)) {}

LayerCosts Repartitioner::coming_costs(int64_t step, const LayerCosts& costs) const {
  // The coming interval's steps step .. step + every - 1, each at its length (a curriculum may
  // change it within): the mean of the costs carried to each, with the longest length's bytes.
  const TrainConfig& t = config_.train;
  const int64_t end = std::min<int64_t>(step + config_.parallel.repartition_every, t.steps);
  LayerCosts mean;
  int longest = 0;
  for (int64_t k = step; k < end; ++k) longest = std::max(longest, t.seq_len_at(k));
  mean = costs.at_seq_len(config_.model, longest);
  for (std::vector<double>* v : {&mean.forward, &mean.backward_input, &mean.backward_weight, &mean.comm}) {
    std::fill(v->begin(), v->end(), 0.0);
  }
  for (int64_t k = step; k < end; ++k) {
    const LayerCosts at = costs.at_seq_len(config_.model, t.seq_len_at(k));
    for (int i = 0; i < at.layers(); ++i) {
      mean.forward[i] += at.forward[i] / static_cast<double>(end - step);
      mean.backward_input[i] += at.backward_input[i] / static_cast<double>(end - step);
      mean.backward_weight[i] += at.backward_weight[i] / static_cast<double>(end - step);
      mean.comm[i] += at.comm[i] / static_cast<double>(end - step);
    }
  }
  return mean;
}

std::vector<LayerRange> Repartitioner::decide(int64_t step, const LayerCosts& costs, json& event) {
  // The problem as the config poses it (schedule, memory cap), on the measured costs predicted for
  // the coming batches.
  PartitionProblem p = problem_for(config_, coming_costs(step, costs));
  // A rank that computes slower than its peers (fewer cores, a busier host, runtime.slow_factor)
  // measured its layers slow: its factor is estimated from the measurements, and its layers' costs
  // are their own divided by it (the problem multiplies whichever stages land on that rank).
  // Rank 0's replica measured the costs; a slow rank of another replica did not show in them.
  p.rank_slowdown = measured_rank_slowdown(p, cut_);
  const Schedule schedule = make_schedule(p.schedule);
  for (size_t s = 0; s < cut_.size(); ++s) {
    const double f = p.rank_slowdown[static_cast<size_t>(schedule.stage_rank[s])];
    for (int i = cut_[s].first; i <= cut_[s].last && f > 1; ++i) {
      for (std::vector<double>* v : {&p.costs.forward, &p.costs.backward_input, &p.costs.backward_weight}) (*v)[i] /= f;
    }
  }
  std::vector<LayerRange> proposal = partitioner_->cut(p, cut_);
  const CutScore now = score_cut(p, cut_), then = score_cut(p, proposal);
  const double gain = now.span > 0 ? (now.span - then.span) / now.span : 0;
  const bool same = boundaries_of(proposal) == boundaries_of(cut_);
  const bool move = !same && then.fits && gain > config_.parallel.repartition_threshold;
  event = {{"event", "repartition"},
           {"step", step},
           {"partitioner", partitioner_->name()},
           {"from", boundaries_of(cut_)},
           {"proposed", boundaries_of(proposal)},
           {"span_ms", now.span},
           {"proposed_span_ms", then.span},
           {"predicted_gain", gain},
           {"seq_len", p.costs.seq_len},
           {"rank_slowdown", p.rank_slowdown},
           {"threshold", config_.parallel.repartition_threshold},
           {"moved", move}};
  return move ? proposal : std::vector<LayerRange>{};
}

void Repartitioner::after_step(int64_t step) {
  const int every = config_.parallel.repartition_every;
  if (every <= 0 || step % every != 0 || step >= config_.train.steps) return;
  // Rank 0 decides; every rank learns the first layers of the new stages (all -1: keep).
  const int S = static_cast<int>(cut_.size());
  std::vector<float> firsts(static_cast<size_t>(S), -1.0f);
  json event;
  if (world_.is_root()) {
    if (const LayerCosts* costs = costs_()) {
      decisions_++;
      const std::vector<LayerRange> next = decide(step, *costs, event);
      for (int s = 0; s < S && !next.empty(); ++s) firsts[s] = static_cast<float>(next[s].first);
    }
  }
  world_.broadcast(firsts.data(), firsts.size(), 0);
  if (firsts[0] < 0) {
    if (!event.is_null() && log_event_) log_event_(event);
    return;
  }
  std::vector<LayerRange> next(static_cast<size_t>(S));
  for (int s = 0; s < S; ++s) {
    next[s].first = static_cast<int>(firsts[s]);
    next[s].last = s + 1 < S ? static_cast<int>(firsts[s + 1]) - 1 : config_.model.n_layer + 1;
  }
  const json moved = recut_(cut_, next);
  cut_ = std::move(next);
  moves_++;
  moved_ms_ += moved.value("move_ms", 0.0);
  if (world_.is_root()) {
    event.update(moved);
    if (log_event_) log_event_(event);
    std::printf("keel: step %lld: stages re-cut %s -> %s (%s; simulated step %.1f -> %.1f ms, %.1f %% shorter); "
                "moved in %.0f ms\n",
                static_cast<long long>(step), event.value("from", "").c_str(), boundaries_of(cut_).c_str(),
                partitioner_->name(), event.value("span_ms", 0.0), event.value("proposed_span_ms", 0.0),
                100 * event.value("predicted_gain", 0.0), moved.value("move_ms", 0.0));
    std::fflush(stdout);
  }
}

void Repartitioner::print_startup() const {
  std::printf("keel: re-cut every %d steps by the %s partitioner on measured layer costs, when the simulated step "
              "gains more than %.1f %%; stages now %s\n",
              config_.parallel.repartition_every, partitioner_->name(), 100 * config_.parallel.repartition_threshold,
              boundaries_of(cut_).c_str());
}

void Repartitioner::add_step_fields(double, json& line) {
  line["repartitions"] = moves_;
  line["stage_boundaries"] = boundaries_of(cut_);
}

void Repartitioner::print_summary() const {
  std::printf("re-cuts: %d of %d decisions moved the stages (%.0f ms moving state); final stages %s\n", moves_,
              decisions_, moved_ms_, boundaries_of(cut_).c_str());
}

}  // namespace keel::pipeline
