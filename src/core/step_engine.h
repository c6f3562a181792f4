// How one optimizer step runs: the forward and backward passes of its micro-batches, the
// data-parallel gradient sync, the gradient norm and the optimizer update. Two engines: one stage
// (runtime/single_stage_step.h: the whole model on every rank) and a pipeline of stages
// (pipeline/pipeline_step.h). The training loop (runtime/trainer.h) only calls this interface.
#pragma once

#include <cstdint>
#include <string>

#include "core/carried_state.h"
#include "core/metrics_source.h"
#include "core/sync_stats.h"

namespace keel::pipeline {
struct LayerCosts;
}  // namespace keel::pipeline

namespace keel {

struct Batch;

// What a step engine reports about one step; the loop adds time, throughput and memory.
struct StepResult {
  double loss = 0;       // mean training loss over the step's tokens (the same on every rank)
  double grad_norm = 0;  // global, before clipping
  SyncStats sync;        // this rank's data-parallel sync
};

class StepEngine {
 public:
  virtual ~StepEngine() = default;
  // Optimizer step `step` (0-based) with learning rate `lr`: reads the step's batches from the
  // training data, computes gradients, syncs them over data-parallel ranks and updates the
  // weights (or leaves the update deferred into the next forward pass, with tiers).
  virtual StepResult run(int64_t step, double lr) = 0;
  // The mean loss of `batch`, forward only, on the ranks that compute it (0 elsewhere: a
  // pipeline's non-last stages).
  virtual double forward_loss(const Batch& batch) = 0;
  // The engine's own figures (a pipeline's bubble), or nullptr.
  virtual MetricsSource* metrics() { return nullptr; }
  // The state it carries from one step into the next beyond the chunk store's, for checkpoints,
  // or nullptr when it carries none.
  virtual CarriedState* carried_state() { return nullptr; }
  // The per-layer costs its profiler last reported (monitor.layer_costs_every), or nullptr before
  // the first report: what a pipeline re-cut decides on.
  virtual const pipeline::LayerCosts* layer_costs() const { return nullptr; }
};

}  // namespace keel
