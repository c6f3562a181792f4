// This rank's part of the model and every component built on which layers it holds: the chunk
// store, the model, the sharded optimizer, the gradient sync and its report, the memory tiers and
// the step engine. The trainer builds one at start-up; a pipeline re-cut mid-run
// (pipeline/repartitioner.h) builds one for the new stages, moves the state into it
// (pipeline/stage_migration.h) and drops the old one.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "comm/context_parallel.h"
#include "comm/expert_parallel.h"
#include "comm/grad_sync.h"
#include "comm/process_groups.h"
#include "comm/sharded_optimizer.h"
#include "comm/sync_report.h"
#include "comm/tensor_parallel.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_engine.h"
#include "data/clip_loader.h"
#include "data/loader.h"
#include "model/clip.h"
#include "model/gpt.h"
#include "pipeline/pipeline_step.h"
#include "runtime/expert_tiers.h"
#include "runtime/moe_report.h"
#include "store/chunk_store.h"
#include "store/tiered_memory.h"

namespace keel {

struct RankModel {
  // Declared in construction order; destroyed in reverse: the tiers drain their transfers into
  // the store before it goes, everything holding leases goes before the tiers.
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<MpiTensorGroup> tensor_group;  // parallel.tensor > 1: the model's tensor group
  std::unique_ptr<MpiContextGroup> context_group;  // parallel.context > 1: the model's context group
  std::unique_ptr<MpiExpertGroup> expert_group;    // parallel.expert > 1: the MoE blocks' expert group
  // ZeRO-3 gathering experts apart (comm/expert_parallel.h experts_gathered_apart): their holders
  std::unique_ptr<MpiExpertHolders> expert_holders;
  std::unique_ptr<GPT> model;       // a language model's layers (null for a dual encoder)
  std::unique_ptr<ClipModel> clip;  // a dual encoder's towers (null for a language model)
  std::unique_ptr<ShardedOptimizer> optimizer;
  std::unique_ptr<GradSync> sync;
  std::unique_ptr<SyncReport> sync_report;
  std::unique_ptr<StepEngine> engine;
  std::unique_ptr<TieredMemory> tiers;  // null without tiers
  std::unique_ptr<MoeRoutingReport> moe_report;  // a mixture of experts' routing figures (null without)
  std::unique_ptr<ExpertTiers> expert_tiers;     // tiers and a mixture of experts: per expert (null without)
  // parallel.tensor > 1: the whole model's parameters and moments, for checkpoints.
  std::unique_ptr<WholeModelState> whole_state;

  // The layers this rank holds under `layout` (none: the whole model) and everything on them.
  // Nothing initialised: the weights are drawn, loaded or moved in by the caller.
  static std::unique_ptr<RankModel> build(const Config& config, ProcessGroups& groups, DataLoader& train,
                                          std::optional<pipeline::PipelineLayout> layout,
                                          std::function<void(const nlohmann::json&)> log_event);

  // A dual encoder ([clip]) on every data-parallel rank: both towers in one store, its ClipStep.
  static std::unique_ptr<RankModel> build_clip(const Config& config, ProcessGroups& groups, ClipLoader& train,
                                               std::function<void(const nlohmann::json&)> log_event);

  // The figures its components report, in the order the progress line shows them.
  std::vector<MetricsSource*> sources() const;
};

}  // namespace keel
