// Where to cut the model into pipeline stages, from per-layer costs (pipeline/layer_profile.h):
// three partitioners behind one interface (costs and memory limits in, boundaries out).
//
//   static     the FLOP model's balanced cut (layout.h cut_stages on layer_costs): what Keel did
//              before it measured anything.
//   dp         exact min-max dynamic programming over the measured per-layer cost (F + B + W +
//              the send / receive time at the stage's edges) under a per-stage memory cap
//              (parameters, gradients and both moments, plus the activations of the micro-batches
//              the schedule keeps in flight on the stage), then scored by the schedule
//              simulator (the largest stage is not the whole story: a schedule's warm-up and
//              drain weigh stages differently): the shortest simulated span of every cut that
//              fits when there are at most 20,000 cuts, else the best single-boundary move from
//              the min-max cut while one shortens the span.
//   qlearning  a tabular Q-learning agent. State: each stage's imbalance (its cost against the
//              mean, in 10 % buckets clamped to +-2) and the trend of the simulated span since its
//              last move (falling, flat, rising). Actions: move one boundary one layer left or
//              right, or keep (2(S-1) + 1). Reward: the simulated span the move saves, relative
//              to the current cut's (keeping earns 0), plus a tenth of the stage costs' sum of
//              squares it saves, relative too (it breaks ties where two stages share the largest
//              cost). Each decision it tries every action on the simulator
//              (counterfactual moves) and learns from all of them; it then takes one action,
//              epsilon-greedy with epsilon = max(0.05, 0.5 * 0.85^decision). Learning rate 0.5,
//              discount 0.9. Seeded: the same costs give the same moves.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "pipeline/layer_profile.h"
#include "pipeline/schedule.h"

namespace keel::pipeline {

struct PartitionProblem {
  LayerCosts costs;
  std::vector<double> flops;  // per layer: the FLOP model (the static partitioner's input)
  ScheduleSpec schedule;      // the schedule the cut will run (its stages: ranks x virtual stages)
  int64_t stage_memory_cap = 0;  // bytes per stage (0 = none)
  // Per pipeline rank, how many times slower it computes than the costs say (empty: all 1): a
  // stage's F, B and W on rank r cost rank_slowdown[r] x its layers'. A re-cut estimates it from
  // what the ranks measured (measured_rank_slowdown); `keel schedule` takes a what-if from
  // runtime.slow_rank / slow_factor.
  std::vector<double> rank_slowdown;
  int stages() const { return schedule.ranks * schedule.virtual_stages; }
  // Each stage's factor from rank_slowdown (1 without one).
  std::vector<double> stage_slowdown() const;
};

// A cut's figures on the simulator.
struct CutScore {
  double span = 0;       // simulated step span (ms, as the costs)
  double bubble = 0;
  double max_stage = 0;  // the most expensive stage's F + B + W + comm
  std::vector<int64_t> stage_bytes;  // memory per stage (state + activations in flight)
  bool fits = true;      // every stage within the cap
};
CutScore score_cut(const PartitionProblem& p, const std::vector<LayerRange>& cut);

// The cut whose largest stage (F + B + W + comm) is least among those within the memory cap:
// the exact min-max dynamic programme the dp partitioner starts from. Throws keel::Error naming
// parallel.stage_memory_mib when no cut fits.
std::vector<LayerRange> min_max_cut(const PartitionProblem& p);

// The first layer of stages 1..S-1 ("3,6,9": parallel.stage_boundaries' form) and back.
std::string boundaries_of(const std::vector<LayerRange>& cut);

class Partitioner {
 public:
  virtual ~Partitioner() = default;
  virtual const char* name() const = 0;
  // The cut for these costs, starting from `current` (the running cut; the learning agent moves
  // from it, the others ignore it). Throws keel::Error when no cut fits the memory cap.
  virtual std::vector<LayerRange> cut(const PartitionProblem& p, const std::vector<LayerRange>& current) = 0;
};

// The problem a config poses: its schedule and stage count, parallel.stage_memory_mib, and the
// costs in parallel.layer_costs or, without a file, the FLOP model's (F = B = W); bytes per layer
// the file lacks are the model's own (parameters; activations of one micro-batch).
PartitionProblem problem_for(const Config& config);
// The same on costs measured in this run (`measured`, in place of parallel.layer_costs' file).
PartitionProblem problem_for(const Config& config, const LayerCosts& measured);

// Each pipeline rank's slowdown under `cut`, estimated from the measured costs in p: per rank the
// median over its blocks of measured forward time over the FLOP model's cost (p.flops), against
// the fastest rank's. Blocks alone (the embedding and the head are memory-bound beside their
// FLOPs) and forward alone (frozen layers skip B and W). A rank holding no block, or whose factor
// is under `noise`, counts as 1; so does every rank when fewer than two hold blocks, or when a
// rank's median block takes under `floor_ms` (too short to tell a slow rank from timer and cache
// noise: layers of microseconds differ by 2-3x between two ranks of this machine by chance).
std::vector<double> measured_rank_slowdown(const PartitionProblem& p, const std::vector<LayerRange>& cut,
                                           double noise = 1.15, double floor_ms = 0.5);

// The best cut (least simulated span) the learning agent reaches in `decisions` decisions from
// `start`; `within` (if given) gets the first decision within 5 % of `optimum` (-1: none).
std::vector<LayerRange> learn_cut(Partitioner& agent, const PartitionProblem& p, std::vector<LayerRange> start,
                                  int decisions, double optimum = 0, int* within = nullptr);

// The cut a config runs at start-up: parallel.stage_boundaries, or its partitioner's.
std::vector<LayerRange> startup_cut(const Config& config);

// The partitioner parallel.partitioner names (static, dp or qlearning).
std::unique_ptr<Partitioner> make_partitioner(PartitionerKind kind, uint64_t seed);

class StaticPartitioner final : public Partitioner {
 public:
  const char* name() const override { return "static"; }
  std::vector<LayerRange> cut(const PartitionProblem& p, const std::vector<LayerRange>& current) override;
};

class DpPartitioner final : public Partitioner {
 public:
  const char* name() const override { return "dp"; }
  std::vector<LayerRange> cut(const PartitionProblem& p, const std::vector<LayerRange>& current) override;
};

class QLearningPartitioner final : public Partitioner {
 public:
  explicit QLearningPartitioner(uint64_t seed) : rng_(seed) {}
  const char* name() const override { return "qlearning"; }
  // One decision: at most one boundary moves by one layer.
  std::vector<LayerRange> cut(const PartitionProblem& p, const std::vector<LayerRange>& current) override;
  int decisions() const { return decisions_; }

 private:
  std::string state_of(const PartitionProblem& p, const std::vector<LayerRange>& cut, double span) const;
  std::vector<double>& q(const std::string& state, int actions);

  Rng rng_;
  std::map<std::string, std::vector<double>> table_;
  int decisions_ = 0;
  double last_span_ = 0;
};

}  // namespace keel::pipeline
