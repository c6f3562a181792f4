// Re-cutting a pipeline's stages while it trains (parallel.repartition_every).
//
// Every `repartition_every` steps (a multiple of monitor.layer_costs_every, so that a fresh
// report of the layer profiler is there), rank 0 asks the configured partitioner
// (pipeline/partitioner.h: static, dp or the Q-learning agent, whose table lives as long as the
// run) for a cut on the measured per-layer costs, predicted for the coming interval's batches
// (each step's cost carried to its sequence length by the FLOP model, averaged: a curriculum that
// lengthens the sequences within the interval is foreseen), and scores the running cut and the proposal on the schedule simulator. When the
// proposal's simulated step is shorter by more than parallel.repartition_threshold (relative),
// every rank learns the new cut (a broadcast) and the trainer moves the stages
// (RankModel rebuilt, pipeline/stage_migration.h moves the state): the next step runs on it.
// Every decision is a `{"event": "repartition"}` line of metrics.jsonl: the cuts, the simulated
// spans, the predicted gain, whether the stages moved and, when they did, what the move cost.
// No decision in the last interval (there is no next step to gain), none without a report since
// the last move (the new stages' profiler starts afresh).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "pipeline/layer_profile.h"
#include "pipeline/partitioner.h"

namespace keel::pipeline {

class Repartitioner final : public StepHook, public MetricsSource {
 public:
  // `cut`: the running cut. `costs`: the step engine's last profiler report (nullptr: none yet).
  // `recut(from, to)`: moves the stages, returning the move's figures (merged into the event).
  Repartitioner(const Config& config, Communicator& world, std::vector<LayerRange> cut,
                std::function<const LayerCosts*()> costs,
                std::function<nlohmann::json(const std::vector<LayerRange>&, const std::vector<LayerRange>&)> recut,
                std::function<void(const nlohmann::json&)> log_event);

  void after_step(int64_t step) override;

  const std::vector<LayerRange>& cut() const { return cut_; }
  int moves() const { return moves_; }

  void print_startup() const override;
  // `repartitions` (moves so far) and `stage_boundaries` (the running cut) in every step line.
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  void print_summary() const override;

 private:
  // The measured costs predicted for the coming interval (its steps' sequence lengths).
  LayerCosts coming_costs(int64_t step, const LayerCosts& costs) const;
  // Rank 0's decision on these costs: the cut to move to (empty: keep), and the event line.
  std::vector<LayerRange> decide(int64_t step, const LayerCosts& costs, nlohmann::json& event);

  const Config& config_;
  Communicator& world_;
  std::vector<LayerRange> cut_;
  std::function<const LayerCosts*()> costs_;
  std::function<nlohmann::json(const std::vector<LayerRange>&, const std::vector<LayerRange>&)> recut_;
  std::function<void(const nlohmann::json&)> log_event_;
  std::unique_ptr<Partitioner> partitioner_;
  int moves_ = 0, decisions_ = 0;
  double moved_ms_ = 0;
};

}  // namespace keel::pipeline
