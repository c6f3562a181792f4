// `keel simulate`: a config's training step predicted on a described cluster (sim/step_model.h),
// printed as a breakdown (or one JSON line), with a Chrome trace of the simulated step.
#pragma once

#include <string>
#include <vector>

namespace keel::sim {

struct SimulateOptions {
  std::string config;                // a Keel config ("" = the built-in default)
  std::vector<std::string> sets;     // --set section.key=value
  std::string cluster;               // the cluster file
  int nodes = 0;                     // --nodes: the cluster's node count instead of the file's (0: the file's)
  int tensor = 1;                    // --tensor
  bool recompute = false;            // --recompute yes
  bool tiers = false;                // --tiers yes: memory tiers (sim/tier_model.h)
  bool overlap_sync = true;          // --overlap-sync no: the sync after the backward (SimLayout)
  std::string layer_costs;           // --layer-costs FILE (a run's metrics.jsonl or a costs object)
  std::string trace;                 // --trace FILE.json ("" = none)
  bool json = false;                 // --json yes
  bool search = false;               // --search yes: rank the layouts instead (sim/search.h)
  int top = 5;                       // --top N: how many of them to show
  std::string stack = "keel";        // --stack NAME: the software stack whose run is predicted (sim/stack.h)
  std::string stacks;                // --stacks FILE: where NAME is defined ("" with the built-in keel)
  int vocab = 0;                     // --vocab N: the model's vocabulary instead of the config's (0: the config's)
};

// Returns the exit status; throws keel::Error on bad input (one line, naming it).
int simulate_command(const SimulateOptions& o);

}  // namespace keel::sim
