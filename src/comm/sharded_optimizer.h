// The optimizer step of data-parallel training, with ZeRO's sharding: which rank owns which
// chunks' moments (ZeRO-1) and reduced gradients (ZeRO-2), this rank's share of the global
// gradient norm, the AdamW update of the owned chunks, and what follows it (the updated
// parameters reach every rank; under ZeRO-3 they stay with their owner, comm/sharded_params.h). With memory tiers the update runs chunk by chunk through the
// store's updater, deferred into the next forward pass (tier.defer_update).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/zero.h"
#include "core/config.h"
#include "core/error.h"
#include "core/metrics_source.h"
#include "core/rank_figures.h"
#include "optim/adamw.h"
#include "store/chunk_store.h"

namespace keel {

class ShardedParams;  // comm/sharded_params.h
class Bf16State;      // store/bf16_state.h

// A step whose loss or gradient norm is not finite, past what optim.skip_nonfinite_steps allows:
// the run stops (the weights are as the last good step left them).
class NonFiniteStep : public Error {
 public:
  using Error::Error;
};

class ShardedOptimizer final : public MetricsSource, public RankFigures {
 public:
  // `dp`: the data-parallel group (the world without a pipeline, a stage's replicas with one).
  // Shards the store's moments (before anything loads or initialises them) under ZeRO; under
  // ZeRO-3 attaches the sharded parameters to the store as its residency.
  ShardedOptimizer(const Config& config, Communicator& dp, ChunkStore& store);
  ~ShardedOptimizer() override;

  // ZeRO stage in effect (0 on a group of one).
  int zero() const { return zero_; }
  const ChunkPartition& partition() const { return partition_; }
  // Owners of the reduced gradients for GradSync (ZeRO-2), else nullptr.
  const ChunkPartition* scatter_to() const { return zero_ >= 2 ? &partition_ : nullptr; }
  // Chunks [first, last) this rank updates; with sharded experts under ZeRO
  // (partition().experts_apart(), comm/zero.h) the span of them, of which it updates those it owns.
  std::pair<int, int> own_chunks() const { return store_.moment_chunks(); }
  // Whether this rank updates `chunk` (holds its moments and, under ZeRO-2, its reduced gradient).
  bool owns(int chunk) const;

  // After the sync of step `step`: clears the gradients of frozen layers (the owned ones, under ZeRO-2), which
  // neither count towards the norm nor are updated.
  void clear_frozen_grads(int64_t step);  // (0-based: optim.frozen_at)
  // This rank's share of the squared gradient norm: every chunk, or under ZeRO-2 the owned ones
  // (the caller sums the shares over the group); replicas of tied tensors are counted at home.
  double local_grad_squares() const;
  // Whether the group's shares must be summed to get the norm (ZeRO-2).
  bool norm_is_sharded() const { return zero_ >= 2; }
  // The clipping factor for a global norm (1 when no clipping is needed).
  float clip_for(double norm) const;

  // The update of optimizer step t (1-based) with learning rate lr and clipping factor clip:
  // the owned chunks' AdamW update, then every rank's parameters as the owners left them. With
  // tiers, deferred into the next forward pass, chunk by chunk. Gradients are zero after it.
  void step(double lr, int64_t t, float clip);
  // Layers on their own update cadence (a dual encoder's towers, clip.*_update_every): for the
  // steps from now on, each layer's AdamW update count (its bias correction) by layer id, 0 where
  // the layer is held (its parameters, moments, gradient and version stay as they are; it is not
  // counted in the gradient norm). Layers past the end, or an empty vector: the step's own t.
  void set_update_counts(std::vector<int64_t> counts_by_layer) { counts_ = std::move(counts_by_layer); }
  // Every rank, once the weights were drawn or loaded (start-up, resume; under ZeRO-3 a rank's
  // own chunks only): under ZeRO-3 the start-up's resident parameters and peak resident set are
  // measured (metrics.jsonl's zero3_startup_*); otherwise nothing.
  void weights_settled();
  // After another residency was attached to the store (the memory tiers, built after this): the
  // bf16 state (where held) wraps it for the planes it does not hold, then under ZeRO-3 the
  // sharded parameters wrap the outermost; otherwise nothing. Local.
  void residency_attached();
  // Every rank, before a training step and before each evaluation batch: under ZeRO-3 the layer
  // leases from here on are that pass's, broadcast ahead on the last such pass's schedule
  // (ShardedParams::begin_pass); otherwise nothing. Local.
  void begin_pass(LeasePass pass);
  // Collective: under ZeRO-3 every parameter gathered on every rank until the next step (one rank
  // about to run the model alone: samples); otherwise nothing.
  void gather_whole_model();
  // The parameter bytes a rank holds between layers: the whole plane, under ZeRO-3 its shard,
  // under bf16 state the bf16 working copy (2 bytes a parameter; masters: master_bytes_held).
  int64_t param_bytes_held() const;
  // The gradient bytes a rank holds: the plane, or its bf16 bits under grad_dtype = "bf16".
  int64_t grad_bytes_held() const;
  // The float32 master weights a rank holds beside bf16 working parameters (its ZeRO shard's).
  int64_t master_bytes_held() const;
  // The AdamW moments' bytes a rank holds (both planes: its ZeRO shard's, or every chunk's).
  int64_t moment_bytes_held() const;
  // The bf16 training state, where one is held (else nullptr).
  Bf16State* bf16_state() const { return bf16_.get(); }
  // The start-up's "memory per rank" figures of parameters and gradients as a rank holds them
  // (under ZeRO-3 its shard, the largest over the group, plus what is in flight; under bf16 state
  // the bf16 bits, the float32 masters and the float32 pages a layer's lease widens), and their
  // sum in bytes. `tiered`: the memory tiers hold the float32 planes (their bytes are the tiers'
  // budgets, counted by the caller); bf16 state's planes stay out of the tiers.
  struct HeldMemory {
    std::string text;
    int64_t bytes = 0;
  };
  HeldMemory held_memory(bool tiered) const;
  // The plain AdamW step over every owned chunk, now (pipeline post-validation redoes it).
  void step_now(double lr, int64_t t, float clip) { adamw_.step(store_, lr, t, clip, counts()); }

  // The guard of step `step` (0-based), called with its global loss and norm before any update:
  // true when both are finite. Otherwise the step's gradients are dropped (no update: its
  // weights and moments stay as they are), the step is counted as skipped, and NonFiniteStep is
  // thrown once more steps were skipped than optim.skip_nonfinite_steps allows. Every rank sees
  // the same values, so every rank decides the same.
  bool accept(int64_t step, double loss, double grad_norm);
  int64_t skipped_steps() const { return skipped_; }
  // The run's counts so far from the optimizer this one replaces (a pipeline re-cut), and the
  // step's table of every rank's figures (taken before the re-cut, for the step's line).
  void carry_counts(const ShardedOptimizer& before) {
    skipped_ = before.skipped_;
    rank_figures_ = before.rank_figures_;
  }

  // Metrics: skipped_steps (the run's total) in every line; the progress line names them.
  // Under ZeRO-3 also every rank's parameter, gradient and moment bytes (collective: every rank
  // adds its step's fields) and the start-up line of what a rank holds. With sharded experts
  // under ZeRO, every rank's held parameter, gradient and moment bytes, the experts' part of
  // each, its moment planes' resident bytes (mincore), and the whole model's expert parameter
  // bytes: these ride the step's reduction (RankFigures: every rank's, in world-rank order; in a
  // pipeline each stage's replicas report their stage's chunks).
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  int rank_figure_count() const override;
  void rank_figures(std::span<double> out) const override;
  void take_rank_figures(std::span<const double> all) override { rank_figures_.assign(all.begin(), all.end()); }
  void print_startup() const override;
  std::string progress_fragment(double step_ms) const override;

 private:
  // ZeRO without tiers: after this rank updated its shard, every rank receives every parameter
  // (ZeRO-1/2; under ZeRO-3 they stay with their owners).
  void gather_parameters(int64_t t);
  // Sharded experts under ZeRO: the AdamW update of the owned chunks, and (ZeRO-1/2) the owners'
  // parameters broadcast run by run (a run: consecutive chunks of one kind and owner), the
  // chunks of no expert over the data group, the expert chunks over their holders.
  void step_owned(double lr, int64_t t, float clip);
  void broadcast_owned_runs();
  // Float32 bytes of the tensor elements in this rank's chunks (only the expert chunks, only the
  // owned ones, as asked).
  int64_t tensor_bytes(bool experts_only, bool owned_only) const;
  void update_chunk(int chunk);
  const std::vector<int64_t>* counts() const { return counts_.empty() ? nullptr : &counts_; }
  // Whether step t (1-based) leaves the layer alone (frozen, or held by the update counts).
  bool keeps(int layer, int64_t t) const {
    return layer < config_.optim.frozen_at(t - 1) || (layer < static_cast<int>(counts_.size()) && counts_[layer] == 0);
  }
  int64_t count_of(int layer, int64_t t) const { return layer < static_cast<int>(counts_.size()) ? counts_[layer] : t; }

  const Config& config_;
  Communicator& dp_;
  ChunkStore& store_;
  AdamW adamw_;
  int zero_ = 0;
  ChunkPartition partition_;
  // Sharded experts under ZeRO-1/2 with data > P: the data ranks holding this rank's experts.
  std::unique_ptr<Communicator> holders_;
  std::vector<double> rank_figures_;  // the step's table of every rank's (take_rank_figures)
  int64_t model_expert_bytes_ = 0;          // the whole model's expert parameters (float32 bytes)
  std::unique_ptr<ShardedParams> params_;  // ZeRO-3
  std::unique_ptr<Bf16State> bf16_;        // runtime.param_dtype / grad_dtype = "bf16"
  int64_t bf16_broadcast_bytes_ = 0;       // bf16 parameters the owners broadcast since the last line
  struct Startup {  // ZeRO-3: measured once the weights were drawn or loaded (weights_settled)
    int64_t param_resident_bytes = 0, peak_rss_bytes = 0;
  } startup_;
  int64_t skipped_ = 0;
  std::vector<int64_t> counts_;
  struct Deferred {  // the update deferred into the next forward pass
    double lr = 0;
    int64_t t = 0;
    float clip = 1.0f;
  } deferred_;
};

}  // namespace keel
