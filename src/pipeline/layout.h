// How a job is laid out as a grid of data-parallel x pipeline ranks, and how the model's layers
// are cut into pipeline stages. World rank = replica * pipeline + pipeline rank: the stages of
// one data-parallel replica are consecutive ranks (on one machine first, where messages between
// stages are cheapest); each stage's replicas form its data-parallel group.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt.h"
#include "pipeline/schedule.h"

namespace keel::pipeline {

// Relative cost of each of the model's n_layer + 2 layers (embedding, blocks, head) for one
// token at sequence length T: forward matmul FLOPs plus the elementwise work of the embedding and
// the loss. What the default stage cut balances.
std::vector<double> layer_costs(const ModelConfig& model, int T);

// Cuts layers 0..costs.size()-1 into `stages` contiguous non-empty ranges. boundaries "" = balanced:
// the cut whose most expensive stage costs least (exact dynamic programme); otherwise the
// comma-separated first layers of stages 1..stages-1 ("3,6,9"). Throws keel::Error naming
// `parallel.stage_boundaries` or `parallel.pipeline` when the cut is impossible.
std::vector<LayerRange> cut_stages(const std::vector<double>& costs, int stages, const std::string& boundaries);

// Checks the [parallel] pipeline keys against the model and the job, after Config::resolve
// (called by resolve_job_config).
void validate_pipeline_config(const ParallelConfig& parallel, const TrainConfig& train, int n_layer, int world_size);

// Micro-batches per step of the pipeline: parallel.micro_batches, or train.grad_accum when 0.
int micro_batches(const Config& config);
// Virtual stages per rank: parallel.virtual_stages, or the schedule's own when 0.
int virtual_stages(const ParallelConfig& parallel);

// A schedule ready to run: validated, with its activations in flight per rank.
struct Plan {
  Schedule schedule;
  ScheduleCheck check;  // peak_in_flight and (weighted by each stage's bytes) peak_bytes per rank
  int micro_batch = 0;  // sequences per micro-batch
};

// The schedule of `config` for m micro-batches splitting the step's train.batch_size x
// train.grad_accum sequences over `stages`, validated. Throws keel::Error naming
// parallel.activation_mib when its activations in flight exceed that bound on some rank.
Plan plan(const Config& config, const std::vector<LayerRange>& stages, int m);

// The micro-batch counts the schedule allows for the step (divisors of its sequences; for the
// interleaved schedule, multiples of the pipeline ranks), ascending.
std::vector<int> allowed_micro_batches(const Config& config);

}  // namespace keel::pipeline
