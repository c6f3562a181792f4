// Dynamic micro-batches: how many micro-batches a step is cut into, chosen from measured stage
// times. Fewer, larger micro-batches pay less per-instruction overhead (kernel launches, messages,
// small matrix products) but leave a larger pipeline bubble; more, smaller ones shrink the bubble
// and cost more in overhead, and the schedule's activations in flight must fit the memory bound.
// From two measured steps at different micro-batch sizes, each stage's F, B and W time is fitted
// as overhead + per-sequence cost; every allowed count is then simulated with those costs and the
// one with the shortest predicted step wins.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt.h"
#include "pipeline/schedule.h"

namespace keel::pipeline {

// Mean F, B and W time (ms) of each stage in one measured step, with its micro-batch size.
struct StageTimes {
  int micro_batch = 0;  // sequences per micro-batch
  std::vector<double> forward, backward_input, backward_weight;  // per stage
};

// The mean duration per stage and op over a timeline's F, B and W intervals (stages with no
// interval on it stay 0). Timelines of several ranks add up: each stage runs on one rank.
void add_stage_times(const std::vector<Interval>& timeline, StageTimes& out);

struct MicroBatchChoice {
  int micro_batches = 0;
  double predicted_ms = 0;  // simulated step (F, B, W) of the choice
  double predicted_bubble = 0;
  std::string reason;       // one line: the choice, what it beat, the fitted costs
};

// The micro-batch count for the step from two measurements at different sizes (a.micro_batch !=
// b.micro_batch). Counts whose activations in flight exceed parallel.activation_mib are skipped.
MicroBatchChoice choose_micro_batches(const Config& config, const std::vector<LayerRange>& stages,
                                      const StageTimes& a, const StageTimes& b);

// The count to measure second, given the first: the allowed count nearest twice it (more, smaller
// micro-batches), else the nearest below it; the same count when none other is allowed.
int probe_micro_batches(const Config& config, int first);

}  // namespace keel::pipeline
