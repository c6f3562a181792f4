// One optimizer step of a dual encoder (model/clip.h) on every data-parallel rank: each
// micro-batch's forward through both towers, the features gathered over the data-parallel group,
// the contrastive loss over the global micro-batch, the backward for this rank's samples with the
// gradient sync (buckets started as layers' W complete, descending store ids: loss layer, text
// tower, image tower), the gradient norm and the sharded AdamW update — the same components a
// language model's SingleStageStep drives, over the same chunk store.
//
// With gradient accumulation each micro-batch is a contrastive batch of its own (negatives are the
// micro-batch's samples over all ranks); the step's loss is the mean over micro-batches.
//
// Cross-modal gradient normalisation (clip.grad_balance = "norm"): after the sync, with n_i and n_t
// the two towers' gradient norms, the image tower's gradient is multiplied by sqrt(n_i n_t) / n_i
// and the text tower's by sqrt(n_i n_t) / n_t: both then have the geometric mean of the two norms,
// neither tower's steps dominate the shared embedding, and the product of the norms is kept. The
// clipping norm is taken after it. (AdamW's per-element normalisation undoes a constant scale;
// what the balance changes is the clipping and the moments' mixing over steps as the ratio moves.)
//
// Tower cadences (clip.image_update_every / text_update_every = k): a tower trains on the steps
// whose index is a multiple of k. On the others it runs forward only: its features enter the loss
// as usual (the other tower learns against them), but no backward runs through it, its buckets are
// not synced (GradSync::set_held) and AdamW leaves its parameters and moments alone
// (ShardedOptimizer::set_update_counts; its bias correction counts the tower's own updates). No
// gradient is ever stale: each update is the gradient of that step's batch at the tower's current
// parameters. What is allowed to lag is the tower itself: between its updates it stays as it was
// (up to k - 1 steps behind the other tower), and it learns from 1 / k of the batches. It saves the
// tower's backward (about 2/3 of its compute), its gradient sync and its optimizer work on k - 1 of
// k steps. Which towers a step trains follows from the step alone: a resumed run, and every rank,
// agree without saving anything.
//
// FLIP (clip.vit_mask > 0, a ViT): each training sample keeps a random K = round(P (1 - mask)) of its
// P patches, drawn from (train.seed, the sample's place in the global order): the same sample gets
// the same patches whichever rank reads it, so N ranks still equal one.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "comm/sharded_optimizer.h"
#include "core/config.h"
#include "core/step_engine.h"
#include "data/clip_loader.h"
#include "model/clip.h"

namespace keel {

// The data-parallel group's features gathered over `dp` (an all-gather of equal shares); `dp` must
// outlive it.
FeatureGather feature_gather(Communicator& dp);

struct ClipStepResult : StepResult {
  double accuracy_i2t = 0, accuracy_t2i = 0;  // in-batch top-1, mean over micro-batches
  double logit_scale = 0;                     // exp of the clamped log-scale used this step
  // The synced gradient's norm per part, before clip.grad_balance (image tower, text tower, the
  // temperature), and the factors the balance applied to the towers (1 without it).
  double image_norm = 0, text_norm = 0, scale_norm = 0;
  double image_factor = 1, text_factor = 1;
  TowerMask trained;  // the towers this step's backward and update reached (the cadences)
};

// A step engine (the trainer calls run()) and a metrics source: each step line gets
// "samples_per_s" (image-caption pairs over all ranks), "accuracy_i2t" / "accuracy_t2i" (the share
// of the step's pairs whose right partner scored highest in the gathered batch) and "logit_scale".
class ClipStep final : public StepEngine, public MetricsSource {
 public:
  // Allocates the towers' activations for train.batch_size samples of train.seq_len tokens.
  ClipStep(const Config& config, Communicator& dp, ChunkStore& store, ClipModel& model, ClipLoader& data,
           GradSync& sync, ShardedOptimizer& optimizer);
  StepResult run(int64_t step, double lr) override { return run_clip(step, lr); }
  ClipStepResult run_clip(int64_t step, double lr);
  // A dual encoder has no token windows to score: its evaluation is evaluate() (the workload calls it).
  double forward_loss(const Batch&) override;
  MetricsSource* metrics() override { return this; }
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  // Zero-shot retrieval over every sample of `data` (file order): each rank embeds its share, the
  // embeddings are gathered, recall is computed on all of them (the same on every rank); also the
  // contrastive loss of the whole split as one batch.
  RetrievalRecall evaluate(ClipLoader& data, double* loss = nullptr);

 private:
  const Config& config_;
  Communicator& dp_;
  ChunkStore& store_;
  ClipModel& model_;
  ClipLoader& data_;
  GradSync& sync_;
  ShardedOptimizer& optimizer_;
  ClipStepResult last_;
  std::vector<int> keep_;  // FLIP: this micro-batch's kept patches [B, K]
  // The synced gradient's squared norm of each part (image, text, the loss layer) over the chunks
  // this rank holds whole (ZeRO-2: its own; summed over ranks); with `balance`, scales the towers.
  void measure_and_balance(ClipStepResult& r, bool balance);
  // The towers step `step` trains, set on the sync and the optimizer (update counts by layer).
  TowerMask plan_step(int64_t step);
};

}  // namespace keel
