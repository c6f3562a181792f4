// `keel schedule`: the pipeline a config would run (parallel.pipeline, schedule, micro_batches,
// virtual_stages, stage_boundaries), its stages cut by a partitioner, validated and simulated with
// per-layer F, B, W costs (measured: a file, or a run's metrics.jsonl and its last layer_costs
// line; or by default the FLOP model in units of one forward pass of the whole model), printed as
// a table and a Gantt chart (or one JSON line), with a Chrome trace of the simulated step. The
// command line is parsed, and the config resolved, by the CLI (cli/main.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "pipeline/layout.h"
#include "pipeline/partitioner.h"

namespace keel::pipeline {

struct ScheduleOptions {
  std::optional<PartitionerKind> partitioner;  // --partitioner (none: dp with measured costs, else parallel.partitioner)
  std::optional<std::string> start_cut;    // --start-cut "3,6": where the learning agent starts (none: the static cut)
  int decisions = 50;                      // --decisions: the learning agent's
  int width = 100;                         // --width: the Gantt chart's columns
  bool json = false;                       // --json yes
  std::string trace;                       // --trace FILE.json ("" = none)
};

// The stages chosen for a config, and the schedule planned over them.
struct ScheduleChoice {
  PartitionProblem problem;          // the config's, with parallel.layer_costs' costs if any
  bool measured_costs = false;       // costs from parallel.layer_costs (ms), not the FLOP model
  std::vector<LayerRange> static_cut, start_cut, stages;
  std::string how;                   // how `stages` were chosen (the partitioner, or the key)
  CutScore chosen, base;             // the simulator's figures for `stages` and `static_cut`
  Plan plan;
};

// Cuts and plans `config` (resolved: runtime/job_config.h); throws keel::Error on bad input (the
// config, a partitioner, --start-cut, --decisions), one line naming it.
ScheduleChoice choose_schedule(const Config& config, const ScheduleOptions& o);

// Simulates the chosen schedule, prints it to standard output and writes the trace, if asked.
void print_schedule(const Config& config, const ScheduleChoice& choice, const ScheduleOptions& o);

}  // namespace keel::pipeline
