// One stage: the whole model on every rank. Each micro-batch's forward pass, then its backward
// pass with B then W per layer; the gradient sync (buckets started during the last micro-batch's
// backward as their layers' W complete) over the data-parallel group, with or without ZeRO. With
// model.moe_balance = "bias" the routing biases move after each update (comm/moe_balance.h):
// they are its carried state.
#pragma once

#include "comm/grad_sync.h"
#include "comm/sharded_optimizer.h"
#include "core/config.h"
#include "core/step_engine.h"
#include "data/loader.h"
#include "model/gpt.h"
#include "pipeline/layer_profile.h"
#include "comm/moe_balance.h"

namespace keel {

class SingleStageStep final : public StepEngine {
 public:
  // Allocates the model's activations for train.batch_size x train.seq_len. With
  // monitor.layer_costs_every, the layers' costs are measured (`layer_costs` lines via
  // `log_event`): what a pipeline of this model would be cut by. `tensor`: the model's tensor group
  // (parallel.tensor > 1), over which the gradient norm is summed. `experts`: the expert group
  // (parallel.expert > 1: each rank holds its share of the routed experts), over which the experts'
  // part of the norm is summed.
  SingleStageStep(const Config& config, Communicator& dp, ChunkStore& store, GPT& model, DataLoader& data,
                  GradSync& sync, ShardedOptimizer& optimizer, std::function<void(const nlohmann::json&)> log_event,
                  Communicator* tensor = nullptr, Communicator* experts = nullptr);
  StepResult run(int64_t step, double lr) override;
  double forward_loss(const Batch& batch) override { return model_.forward(batch); }
  MetricsSource* metrics() override { return profiler_.get(); }
  CarriedState* carried_state() override { return balancer_.get(); }

 private:
  const Config& config_;
  Communicator& dp_;
  Communicator* tp_;  // null: no tensor parallelism
  Communicator* ep_;  // null: no expert parallelism
  ChunkStore& store_;
  GPT& model_;
  DataLoader& data_;
  GradSync& sync_;
  ShardedOptimizer& optimizer_;
  std::unique_ptr<pipeline::LayerProfiler> profiler_;
  std::unique_ptr<MoeBiasBalancer> balancer_;  // model.moe_balance = "bias"
};

}  // namespace keel
