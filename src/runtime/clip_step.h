// One optimizer step of a dual encoder (model/clip.h) on every data-parallel rank: each
// micro-batch's forward through both towers, the features gathered over the data-parallel group,
// the contrastive loss over the global micro-batch, the backward for this rank's samples with the
// gradient sync (buckets started as layers' W complete, descending store ids: loss layer, text
// tower, image tower), the gradient norm and the sharded AdamW update — the same components a
// language model's SingleStageStep drives, over the same chunk store.
//
// With gradient accumulation each micro-batch is a contrastive batch of its own (negatives are the
// micro-batch's samples over all ranks); the step's loss is the mean over micro-batches.
#pragma once

#include <cstdint>

#include "comm/grad_sync.h"
#include "comm/sharded_optimizer.h"
#include "core/config.h"
#include "data/clip_loader.h"
#include "model/clip.h"
#include "runtime/step_engine.h"

namespace keel {

struct ClipStepResult : StepResult {
  double accuracy_i2t = 0, accuracy_t2i = 0;  // in-batch top-1, mean over micro-batches
  double logit_scale = 0;                     // exp of the clamped log-scale used this step
};

class ClipStep {
 public:
  // Allocates the towers' activations for train.batch_size samples of train.seq_len tokens.
  ClipStep(const Config& config, Communicator& dp, ChunkStore& store, ClipModel& model, ClipLoader& data,
           GradSync& sync, ShardedOptimizer& optimizer);
  ClipStepResult run(int64_t step, double lr);
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
};

}  // namespace keel
