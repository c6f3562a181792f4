// A pipeline of stages as a step engine: this rank's stages of the model, the stage and tied
// communicators, the executor running the schedule's instruction list, the plan (re-made by
// dynamic micro-batch sizing), gradient prediction and optimizer post-validation, the step's
// bubble and Chrome trace. (Its checkpoints are the Checkpointer's: each stage writes its chunks
// in the whole model's layout; with gradient prediction each rank also saves the state the
// prediction carries between steps, which only the same layout resumes.)
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/grad_sync.h"
#include "comm/moe_balance.h"
#include "comm/process_groups.h"
#include "comm/sharded_optimizer.h"
#include "core/config.h"
#include "core/step_engine.h"
#include "data/loader.h"
#include "model/gpt.h"
#include "pipeline/executor.h"
#include "pipeline/gradient_prediction.h"
#include "pipeline/layer_profile.h"
#include "pipeline/layout.h"
#include "pipeline/micro_batching.h"
#include "store/bf16_state.h"

namespace keel::pipeline {

// The stages of a config's pipeline and this rank's plan, made before the model exists (the
// model holds only this rank's stages).
struct PipelineLayout {
  std::vector<LayerRange> stages;  // every stage's layers
  Plan plan;
  std::vector<LayerRange> mine;    // this rank's stages
  // Every rank validates the whole schedule (the same on all of them) before any message moves.
  static PipelineLayout make(const Config& config, int pipeline_rank);
  // The same for a given cut (a re-cut mid-run).
  static PipelineLayout make(const Config& config, int pipeline_rank, std::vector<LayerRange> stages);
};

class PipelineStep final : public StepEngine, public MetricsSource, public CarriedState {
 public:
  PipelineStep(const Config& config, ProcessGroups& groups, PipelineLayout layout, ChunkStore& store, GPT& model,
               DataLoader& data, GradSync& sync, ShardedOptimizer& optimizer,
               std::function<void(const nlohmann::json&)> log_event);
  ~PipelineStep() override;

  StepResult run(int64_t step, double lr) override;
  double forward_loss(const Batch& batch) override { return executor_->forward_only(batch); }
  MetricsSource* metrics() override { return this; }
  // Gradient prediction's state (below, with model.moe_balance = "bias"'s routing biases after it),
  // or the routing biases alone (comm/moe_balance.h: each stage moves its blocks', every rank
  // carries the whole model's).
  CarriedState* carried_state() override {
    return prediction_ ? static_cast<CarriedState*>(this) : static_cast<CarriedState*>(balancer_.get());
  }
  // Gradient prediction's state at a checkpoint: the deferred W's run first (Executor::
  // run_deferred, under the next step's frozen layers, as that step would run them), then the
  // prediction's state is saved, described with the layout it belongs to (the predictor, the
  // stages and their ranks, the replicas, this rank's store): a resume needs the same layout.
  std::string save(int64_t steps_done, std::vector<float>& floats) override;
  std::string check_resume(const std::string& layout, size_t floats) const override;
  void restore(const std::string& layout, const std::vector<float>& floats) override;
  const LayerCosts* layer_costs() const override { return profiler_ && profiler_->reported() ? &profiler_->costs() : nullptr; }

  // The layout line (and its `event: pipeline` record).
  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;

 private:
  // Runs the pipeline with this plan from the next step on (allocates its activation slots).
  void use_plan(Plan plan);
  // The step's micro-batches through the executor: the sum of their losses on the last stage's
  // rank.
  double run_micro_batches(int T);  // at sequence length T
  // Sums the gradients of every tied group's copies over the ranks that hold one.
  void sum_tied_grads();
  // The global norm and the optimizer update; post-validation when configured.
  void update(int64_t step, double lr, double& loss_sum, StepResult& r);
  // The step's bubble (replica 0), gathered over the replica's ranks; the trace of the last step.
  void report(int64_t step);
  // Dynamic micro-batches: measures steps 2 and 3 at two counts, then runs the count whose
  // simulated step is shortest.
  void adapt_micro_batches(int64_t step);
  StageTimes measured_stage_times();
  void write_trace(int64_t step, const std::vector<std::string>& timelines);
  // The stages and their ranks as words, "0-1@r0 2-3@r1" (layers@rank).
  std::string stage_words() const;
  // The layout gradient prediction's saved state belongs to, in words: what a resume compares.
  std::string prediction_layout() const;

  const Config& config_;
  ProcessGroups& groups_;
  ChunkStore& store_;
  GPT& model_;
  DataLoader& data_;
  GradSync& sync_;
  ShardedOptimizer& optimizer_;
  std::function<void(const nlohmann::json&)> log_event_;  // event lines for metrics.jsonl (rank 0)
  std::vector<LayerRange> stages_;
  // Per tied group of the model: the pipeline ranks holding a copy (null where this rank holds none).
  std::vector<std::unique_ptr<Communicator>> tied_comms_;
  std::unique_ptr<Executor> executor_;
  ScheduleCheck schedule_check_;
  int micro_batches_ = 1;
  // The step's sequences, cut into micro-batches; and the previous step's (read by W's carried
  // into this step).
  std::vector<int> inputs_, targets_, inputs_prev_, targets_prev_;
  StageTimes first_measure_;  // dynamic micro-batches: step 2's stage times
  std::optional<GradientPrediction> prediction_;
  std::unique_ptr<LayerProfiler> profiler_;  // monitor.layer_costs_every > 0
  std::unique_ptr<MoeBiasBalancer> balancer_;  // model.moe_balance = "bias"
  // The step's send / receive time at each layer's stage edges and its quickest receive, from the
  // executor's timeline, for the profiler.
  void profile(int64_t step);
  // post-validation: the float32 planes (those bf16 state does not hold) before the optimistic step
  std::vector<float> backup_;
  Bf16State::Copy bf16_backup_;  // (the planes bf16 training state holds: their bits and masters)
  // The last step's figures (replica 0's bubble and the longest waits over every rank).
  double bubble_ = 0;
  std::vector<double> rank_bubble_;
  double recv_wait_ms_ = 0, activation_mb_ = 0;
  bool rolled_back_ = false;  // post-validation redid this rank's optimizer step (clipping)
};

}  // namespace keel::pipeline
