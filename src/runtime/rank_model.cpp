#include "runtime/rank_model.h"

#include <algorithm>

#include "comm/sync_policy.h"
#include "runtime/single_stage_step.h"
#include "store/placement.h"

namespace keel {

std::unique_ptr<RankModel> RankModel::build(const Config& config, ProcessGroups& groups, DataLoader& train,
                                            std::optional<pipeline::PipelineLayout> layout,
                                            std::function<void(const nlohmann::json&)> log_event) {
  auto r = std::make_unique<RankModel>();
  const bool tiered = tiering_enabled(config.tier);
  Communicator& dp = groups.dp();
  r->store = std::make_unique<ChunkStore>(config.store.chunk_bytes);
  r->model = std::make_unique<GPT>(config.model, *r->store, layout ? layout->mine : std::vector<LayerRange>{},
                                   config.runtime.precision == "bf16");
  if (config.runtime.slow_rank == groups.world().rank()) r->model->set_slowdown(config.runtime.slow_factor);
  r->store->set_huge_page_alignment(tiered);
  r->store->finalize(/*touch_params=*/!tiered);
  // ZeRO shards the moments before anything loads or initialises them.
  r->optimizer = std::make_unique<ShardedOptimizer>(config, dp, *r->store);
  GradSyncOptions options;
  options.bucket_bytes = config.parallel.bucket_bytes;
  options.scatter_to = r->optimizer->scatter_to();
  if (dp.size() > 1 && sync_compressed(config.sync)) {
    options.codecs = sync_chunk_codecs(config.sync, config.model.n_layer, *r->store);
    options.seed = config.train.seed ^ 0x5EEDC0DECull;
    options.warmup_steps = config.sync.warmup_steps;
    options.shape = sync_sum_shape(config.sync);
  }
  r->sync = std::make_unique<GradSync>(dp, *r->store, std::move(options));
  r->sync_report = std::make_unique<SyncReport>(config, dp, *r->sync);
  if (layout) {
    r->engine = std::make_unique<pipeline::PipelineStep>(config, groups, std::move(*layout), *r->store, *r->model,
                                                         train, *r->sync, *r->optimizer, log_event);
  } else {
    r->engine = std::make_unique<SingleStageStep>(config, dp, *r->store, *r->model, train, *r->sync, *r->optimizer,
                                                  log_event);
  }
  // With tiers, everything from here on (loading a checkpoint, drawing or moving in the weights)
  // goes through the tiers page by page: the full state is never resident at once.
  if (tiered) {
    r->tiers = std::make_unique<TieredMemory>(config.tier, *r->store, groups.world().is_root());
    // Gradient buckets in flight pin their pages: keep them within what the device budget leaves
    // beside the homed pages and one operation's working set (at least one bucket).
    r->sync->limit_in_flight(std::max(config.parallel.bucket_bytes, r->tiers->free_device_bytes()));
  }
  return r;
}

std::vector<MetricsSource*> RankModel::sources() const {
  std::vector<MetricsSource*> out = {sync_report.get(), optimizer.get()};
  if (tiers) out.push_back(tiers.get());
  if (MetricsSource* own = engine->metrics()) out.push_back(own);
  return out;
}

}  // namespace keel
