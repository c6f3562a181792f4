#include "runtime/rank_model.h"

#include <algorithm>

#include "comm/sync_policy.h"
#include "runtime/clip_step.h"
#include "runtime/single_stage_step.h"
#include "store/placement.h"

namespace keel {

namespace {

// Everything built on a finalized store but the engine: the sharded optimizer (ZeRO shards the
// moments before anything loads or initialises them), the gradient sync and its report.
void build_optimizer_and_sync(RankModel& r, const Config& config, Communicator& dp, std::vector<CodecParams> codecs,
                              std::vector<int> cut_layers = {}) {
  r.optimizer = std::make_unique<ShardedOptimizer>(config, dp, *r.store);
  GradSyncOptions options;
  options.bucket_bytes = config.parallel.bucket_bytes;
  options.scatter_to = r.optimizer->scatter_to();
  if (Bf16State* state = r.optimizer->bf16_state(); state != nullptr && state->holds(Plane::grad)) options.bf16 = state;
  options.cut_layers = std::move(cut_layers);
  if (experts_sharded(config)) options.expert_group = config.parallel.expert;
  if (!codecs.empty()) {
    options.codecs = std::move(codecs);
    options.seed = config.train.seed ^ 0x5EEDC0DECull;
    options.warmup_steps = config.sync.warmup_steps;
    options.shape = config.sync.shape;
  }
  r.sync = std::make_unique<GradSync>(dp, *r.store, std::move(options));
  r.sync_report = std::make_unique<SyncReport>(config, dp, *r.sync);
}

// With tiers, everything from here on (loading a checkpoint, drawing or moving in the weights)
// goes through the tiers page by page: the full state is never resident at once.
void attach_tiers(RankModel& r, const Config& config, ProcessGroups& groups) {
  if (!tiering_enabled(config.tier)) return;
  // bf16 training state holds its planes itself (bits and masters in this rank's memory): the
  // tiers move the others (the moments).
  const Bf16State* bf16 = r.optimizer->bf16_state();
  r.tiers = std::make_unique<TieredMemory>(config.tier, *r.store, groups.world().is_root(),
                                           bf16 != nullptr ? bf16->held_planes() : uint8_t{0});
  r.optimizer->residency_attached();  // ZeRO-3: a rank's shard homed by the tiers; bf16 state wraps them
  // Gradient buckets in flight pin their pages: keep them within what the device budget leaves
  // beside the homed pages and one operation's working set (at least one bucket).
  // Experts homed by routing share (tier.experts) take device room later: with data parallelism
  // the buckets keep half of it.
  const bool by_frequency = config.tier.experts == TierExperts::by_frequency;
  const bool halve = by_frequency && groups.dp().size() > 1;
  const int64_t buckets = std::max(config.parallel.bucket_bytes, r.tiers->free_device_bytes() / (halve ? 2 : 1));
  r.sync->limit_in_flight(buckets);
  // (bf16 parameters: the experts' parameter pages are not tiered; bf16 gradients alone: their
  // parameter pages are, and those are what the routing decides.)
  if (config.model.moe() && r.model != nullptr && (bf16 == nullptr || !bf16->holds(Plane::param))) {
    const int64_t reserve = 2 * r.tiers->placement().working_set_bytes + (groups.dp().size() > 1 ? buckets : 0);
    r.expert_tiers = std::make_unique<ExpertTiers>(config.tier, *r.store, *r.tiers, *r.model, groups.dp(), reserve,
                                                   by_frequency ? config.tier.experts_every : 0,
                                                   groups.world().is_root(), groups.pipelined() ? &groups.pp() : nullptr,
                                                   bf16 != nullptr ? bf16->held_planes() : uint8_t{0});
  }
}

}  // namespace

std::unique_ptr<RankModel> RankModel::build(const Config& config, ProcessGroups& groups, DataLoader& train,
                                            std::optional<pipeline::PipelineLayout> layout,
                                            std::function<void(const nlohmann::json&)> log_event) {
  auto r = std::make_unique<RankModel>();
  const bool tiered = tiering_enabled(config.tier);
  Communicator& dp = groups.dp();
  r->store = std::make_unique<ChunkStore>(config.store.chunk_bytes);
  if (groups.tp() != nullptr) {
    r->tensor_group = std::make_unique<MpiTensorGroup>(*groups.tp(), config.parallel.sequence_parallel);
  }
  if (groups.cp() != nullptr) r->context_group = std::make_unique<MpiContextGroup>(*groups.cp());
  if (groups.ep() != nullptr) r->expert_group = std::make_unique<MpiExpertGroup>(*groups.ep());
  const bool bf16 = config.runtime.precision == Precision::bf16;
  r->model = std::make_unique<GPT>(config.model, *r->store, layout ? layout->mine : std::vector<LayerRange>{}, bf16,
                                   MathMode::uniform(bf16 ? MatmulPrecision::bf16 : MatmulPrecision::fp32),
                                   recompute_plan(config.train, config.model.n_layer), r->tensor_group.get(),
                                   r->context_group.get(), experts_sharded(config) ? r->expert_group.get() : nullptr);
  if (r->expert_group && !experts_sharded(config)) attach_expert_group(*r->model, *r->expert_group);
  if (config.runtime.slow_rank == groups.world().rank()) r->model->set_slowdown(config.runtime.slow_factor);
  if (r->expert_group) {  // float32 parameters: this rank's tensors, the whole model's
    int64_t whole = 0;
    for (const TensorSpec& t : model_layout(config.model).tensors) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      whole += n;
    }
    r->expert_group->set_param_bytes(r->store->param_count() * 4, whole * 4);
  }
  r->store->set_huge_page_alignment(tiered);
  // Under ZeRO-3 a rank only ever writes its own shard's pages (the rest arrive under leases).
  const bool zero3 = config.parallel.zero == 3 && dp.size() > 1;
  r->store->finalize(/*touch_params=*/!tiered && !zero3);
  const bool compressed = dp.size() > 1 && sync_compressed(config.sync);
  build_optimizer_and_sync(*r, config, dp,
                           compressed ? sync_chunk_codecs(config.sync, config.model.n_layer, *r->store)
                                      : std::vector<CodecParams>{});
  // ZeRO-3 gathers a layer's parameters under its layer lease: a MoE block's experts come with it
  // (but those a rank alone holds).
  if (experts_gathered_with_layers(config, dp.size())) gather_experts_with_layers(*r->model);
  // (Or, experts homed by routing share, apart: only those some holder routed rows to.)
  if (experts_gathered_apart(config, dp.size())) r->expert_holders = gather_experts_apart(*r->model, config, dp);
  if (groups.tp() != nullptr) {
    // Under ZeRO-1/2 the moments are shared out over the data-parallel group (the optimizer's partition).
    const bool sharded = r->optimizer->zero() >= 1;
    const ExpertPlace experts =
        experts_sharded(config) ? ExpertPlace{groups.ep()->rank(), groups.ep()->size()} : ExpertPlace{};
    r->whole_state = std::make_unique<WholeModelState>(config, *groups.tp(), *r->model, sharded ? &dp : nullptr,
                                                       sharded ? &r->optimizer->partition() : nullptr, experts);
  }
  if (layout) {
    r->engine = std::make_unique<pipeline::PipelineStep>(config, groups, std::move(*layout), *r->store, *r->model,
                                                         train, *r->sync, *r->optimizer, log_event);
  } else {
    r->engine = std::make_unique<SingleStageStep>(config, dp, *r->store, *r->model, train, *r->sync, *r->optimizer,
                                                  log_event, groups.tp(), experts_sharded(config) ? groups.ep() : nullptr);
  }
  attach_tiers(*r, config, groups);
  if (config.model.moe()) {
    r->moe_report = std::make_unique<MoeRoutingReport>(dp, *r->model, config.model,
                                                       groups.pipelined() ? &groups.pp() : nullptr);
  }
  return r;
}

std::unique_ptr<RankModel> RankModel::build_clip(const Config& config, ProcessGroups& groups, ClipLoader& train,
                                                 std::function<void(const nlohmann::json&)>) {
  auto r = std::make_unique<RankModel>();
  const bool tiered = tiering_enabled(config.tier);
  Communicator& dp = groups.dp();
  r->store = std::make_unique<ChunkStore>(config.store.chunk_bytes);
  r->clip =
      std::make_unique<ClipModel>(clip_spec(config.clip, train.image_size()), config.model, *r->store,
                                  config.runtime.precision == Precision::bf16 ? MatmulPrecision::bf16 : MatmulPrecision::fp32);
  r->store->set_huge_page_alignment(tiered);
  r->store->finalize(/*touch_params=*/!tiered);
  // Buckets end at the towers' edges: a tower off its update cadence is held out of the sync.
  const int text_first = r->clip->text().first_layer();
  build_optimizer_and_sync(*r, config, dp, {}, {text_first, r->clip->loss_layer()});
  r->engine = std::make_unique<ClipStep>(config, dp, *r->store, *r->clip, train, *r->sync, *r->optimizer);
  attach_tiers(*r, config, groups);
  return r;
}

std::vector<MetricsSource*> RankModel::sources() const {
  std::vector<MetricsSource*> out = {sync_report.get(), optimizer.get()};
  if (tiers) out.push_back(tiers.get());
  if (expert_tiers) out.push_back(expert_tiers.get());
  if (tensor_group) out.push_back(tensor_group.get());
  if (expert_group) out.push_back(expert_group.get());
  if (MetricsSource* own = engine->metrics()) out.push_back(own);
  if (moe_report) out.push_back(moe_report.get());
  return out;
}

}  // namespace keel
