// `keel simulate --search yes`: the layouts of one model on one cluster ranked by simulated
// throughput within device memory (sim/step_model.h predicts each).
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "sim/cluster.h"
#include "sim/step_model.h"

namespace keel::sim {

struct Candidate {
  int tensor = 1, pipeline = 1, zero = 0, micro_batches = 1;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  SyncCodec codec = SyncCodec::none;
  bool recompute = false;
  bool tiers = false;  // memory tiers (tried where the layout does not fit device memory alone)
  StepPrediction prediction;
  std::string describe() const;  // "TP 8 x PP 4, ZeRO-1, zb-v, 32 micro-batches, sync none, recompute"
};

struct SearchResult {
  std::vector<Candidate> ranked;  // layouts that fit, fastest first
  int tried = 0;                  // layouts predicted (valid for Keel's schedules and the model)
  int rejected = 0;               // of those, the ones that do not fit device memory, even with tiers
  double least_gib = 0;           // the least memory per device any tried layout needs
};

// Every layout of `base`'s model and step on `cluster`: tensor degrees dividing the node and the
// heads, pipeline degrees (stages within the layers), ZeRO 0-2, Keel's schedules, micro-batch
// counts dividing a replica's sequences (micro-batches of at most 16 sequences), sync none or
// hybrid, with and without recomputation; a layout that does not fit device memory is tried again
// with memory tiers (sim/tier_model.h) over the node's host memory and NVMe drives. The step keeps `base`'s sequences (train.batch_size x
// train.grad_accum x its data-parallel width on the cluster). Layouts Keel refuses (a schedule's
// constraints, more stages than layers) are skipped.
SearchResult search_layouts(const Config& base, const Cluster& cluster);

}  // namespace keel::sim
