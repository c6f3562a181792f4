#include "runtime/clip_step.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace keel {

ClipStep::ClipStep(const Config& config, Communicator& dp, ChunkStore& store, ClipModel& model, ClipLoader& data,
                   GradSync& sync, ShardedOptimizer& optimizer)
    : config_(config), dp_(dp), store_(store), model_(model), data_(data), sync_(sync), optimizer_(optimizer) {
  model_.allocate(config.train.batch_size, config.train.seq_len);
}

ClipStepResult ClipStep::run(int64_t step, double lr) {
  const TrainConfig& t = config_.train;
  const int world = dp_.size();
  ClipStepResult r;
  double loss_sum = 0;
  for (int micro = 0; micro < t.grad_accum; ++micro) {
    const ClipBatch& batch = data_.next();
    sync_.begin(micro == t.grad_accum - 1, step);
    // (Each micro-batch's gradient is its loss's, divided over the micro-batches of the step; the
    // ranks' shares sum to it: no 1 / world here, the loss is already over the global batch.)
    const ContrastiveResult c = model_.train_micro_batch(batch, 1.0f / static_cast<float>(t.grad_accum), &sync_, &dp_);
    loss_sum += c.loss;
    r.accuracy_i2t += c.accuracy_i2t / t.grad_accum;
    r.accuracy_t2i += c.accuracy_t2i / t.grad_accum;
  }
  sync_.finish();
  r.sync = sync_.stats();
  optimizer_.clear_frozen_grads(step);
  r.loss = loss_sum / t.grad_accum;  // the same on every rank: each computed the global loss
  const bool sharded = optimizer_.norm_is_sharded();
  double squares = optimizer_.local_grad_squares();
  if (sharded && world > 1) squares = dp_.allreduce_sum(squares);
  r.grad_norm = std::sqrt(squares);
  r.logit_scale = std::exp(std::min<double>(model_.logit_scale(), std::log(model_.spec().logit_scale_max)));
  if (optimizer_.accept(step, r.loss, r.grad_norm)) optimizer_.step(lr, step + 1, optimizer_.clip_for(r.grad_norm));
  return r;
}

RetrievalRecall ClipStep::evaluate(ClipLoader& data, double* loss) {
  store_.apply_pending();
  const int N = data.samples(), D = model_.spec().embed_dim, B = config_.train.batch_size;
  const int world = dp_.size(), rank = dp_.rank();
  // Rank r embeds samples [r * per, (r + 1) * per) in micro-batches of up to B.
  const int per = (N + world - 1) / world;
  std::vector<float> img(static_cast<size_t>(per) * world * D, 0.0f), txt(img.size(), 0.0f);
  for (int first = rank * per; first < std::min(N, (rank + 1) * per); first += B) {
    const int count = std::min({B, N - first, (rank + 1) * per - first});
    model_.embed(data.rows(first, count), &img[static_cast<size_t>(first) * D], &txt[static_cast<size_t>(first) * D]);
  }
  if (world > 1) {
    const std::vector<int> counts(world, per * D);
    std::vector<int> displs(world);
    for (int r = 0; r < world; ++r) displs[r] = r * per * D;
    dp_.allgatherv(img.data(), counts, displs);
    dp_.allgatherv(txt.data(), counts, displs);
  }
  if (loss != nullptr) {
    *loss = contrastive_loss(img.data(), txt.data(), N, D, model_.logit_scale(), model_.spec().logit_scale_max, 0, 0,
                             0.0f, nullptr, nullptr)
                .loss;
  }
  return retrieval_recall(img.data(), txt.data(), N, D);
}

}  // namespace keel
