#include "runtime/single_stage_step.h"

#include <algorithm>
#include <cmath>

#include "comm/expert_parallel.h"
#include "comm/tensor_parallel.h"

namespace keel {

SingleStageStep::SingleStageStep(const Config& config, Communicator& dp, ChunkStore& store, GPT& model,
                                 DataLoader& data, GradSync& sync, ShardedOptimizer& optimizer,
                                 std::function<void(const nlohmann::json&)> log_event, Communicator* tensor,
                                 Communicator* experts)
    : config_(config),
      dp_(dp),
      tp_(tensor),
      ep_(experts),
      store_(store),
      model_(model),
      data_(data),
      sync_(sync),
      optimizer_(optimizer) {
  // (a context group's rank holds T / context of each sequence: model/context_group.h)
  model_.allocate(config.train.batch_size, config.train.longest_seq_len() / std::max(1, config.parallel.context));
  if (config.model.moe() && config.model.moe_balance == MoeBalance::bias) {
    balancer_ = std::make_unique<MoeBiasBalancer>(config.model, dp, model);
  }
  if (config.monitor.layer_costs_every > 0) {
    profiler_ = std::make_unique<pipeline::LayerProfiler>(model, nullptr, config.monitor.layer_costs_every,
                                                          std::move(log_event));
  }
}

StepResult SingleStageStep::run(int64_t step, double lr) {
  const TrainConfig& t = config_.train;
  const int world = dp_.size();
  // Gradients are zero here: the store starts zeroed and AdamW clears them as it consumes them.
  // Each rank's gradient is scaled for the global batch, so the sum over ranks is the gradient
  // of the mean loss over every rank's tokens: what one rank with world x the batch computes.
  double loss_sum = 0;
  if (profiler_) model_.take_layer_times();  // (evaluations between steps are not the step's)
  model_.set_frozen_layers(config_.optim.frozen_at(step));
  const int T = t.seq_len_at(step);
  for (int micro = 0; micro < t.grad_accum; ++micro) {
    Batch batch = data_.next(T);
    batch.grad_scale = 1.0f / (static_cast<float>(batch.B) * batch.T * t.grad_accum * world);
    loss_sum += model_.forward(batch);
    // The forward pass ran every deferred update (each before its chunk's first use); none may
    // still wait once gradients are written.
    if (micro == 0) store_.apply_pending();
    sync_.begin(micro == t.grad_accum - 1, step);
    model_.backward(batch, false, &sync_);
  }
  sync_.finish();
  if (tp_ && config_.sync.codec != SyncCodec::none) tensor_share_replicated_grads(model_, *tp_);
  StepResult r;
  r.sync = sync_.stats();
  optimizer_.clear_frozen_grads(step);
  // One sum over ranks for the loss and (ZeRO-2 ranks hold only their shard of the reduced
  // gradient) the squared gradient norm.
  const bool sharded = optimizer_.norm_is_sharded();
  // (Tensor parallel under ZeRO-2: the owned chunks' share, then summed over the tensor group.)
  const auto owned = [&](int chunk) { return optimizer_.owns(chunk); };
  const double own = !sharded ? 0.0
                     : tp_    ? tensor_grad_share(model_, tp_->rank(), owned)
                              : optimizer_.local_grad_squares();
  double sums[2] = {loss_sum, own};
  if (world > 1) dp_.allreduce_sum(sums, 2);
  r.loss = sums[0] / world / t.grad_accum;
  // Tensor parallel: the group's shards make the whole model's norm (comm/tensor_parallel.h).
  // Sharded experts: each expert's squares once, from the rank of the expert group holding it.
  r.grad_norm = std::sqrt(sharded ? (tp_ ? tp_->allreduce_sum(sums[1]) : sums[1])
                          : tp_   ? tensor_grad_squares(model_, *tp_, ep_)
                          : ep_   ? expert_grad_squares(store_, *ep_)
                                  : optimizer_.local_grad_squares());
  const bool accepted = optimizer_.accept(step, r.loss, r.grad_norm);
  if (accepted) optimizer_.step(lr, step + 1, optimizer_.clip_for(r.grad_norm));
  if (balancer_) balancer_->after_step(accepted);
  if (profiler_) profiler_->after_step(step + 1, T, t.batch_size, t.grad_accum, nullptr, -1);
  return r;
}

}  // namespace keel
