#include "comm/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace keel {

ShardedOptimizer::ShardedOptimizer(const Config& config, Communicator& dp, ChunkStore& store)
    : config_(config), dp_(dp), store_(store), adamw_(config.optim) {
  zero_ = dp.size() > 1 ? config.parallel.zero : 0;
  partition_ = ChunkPartition::balanced(store_, zero_ > 0 ? dp.size() : 1);
  // Before loading: the moments are never resident at full size.
  if (zero_ > 0) store_.shard_moments(partition_.first_chunk[dp.rank()], partition_.first_chunk[dp.rank() + 1]);
  // The deferred chunk updates (used where the store's pages move; see step).
  store_.set_updater([this](int chunk) { update_chunk(chunk); });
}

void ShardedOptimizer::clear_frozen_grads(int64_t step) {
  const auto [own_first, own_last] = own_chunks();
  for (const Chunk& c : store_.chunks()) {
    if (c.layer >= config_.optim.frozen_at(step)) break;
    if (zero_ == 2 && (c.id < own_first || c.id >= own_last)) continue;
    store_.zero_grad_chunk(c.id);
  }
}

double ShardedOptimizer::local_grad_squares() const {
  const auto [own_first, own_last] = zero_ == 2 ? own_chunks() : std::pair<int, int>{0, -1};
  if (counts_.empty()) return grad_sum_squares(store_, own_first, own_last);
  // Held layers' gradients (accumulating towards a later update, or none) are not this step's.
  const int last = own_last < 0 ? static_cast<int>(store_.chunks().size()) : own_last;
  double total = 0;
  for (int c = own_first; c < last; ++c) {
    const int layer = store_.chunks()[c].layer;
    if (layer < static_cast<int>(counts_.size()) && counts_[layer] == 0) continue;
    total += grad_sum_squares(store_, c, c + 1);
  }
  return total;
}

float ShardedOptimizer::clip_for(double norm) const {
  const double max_norm = config_.optim.grad_clip;
  return max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / norm) : 1.0f;
}

void ShardedOptimizer::step(double lr, int64_t t, float clip) {
  if (store_.residency().always_present()) {
    // Whole planes: AdamW over this rank's shard, then (ZeRO) one all-gather of the parameters.
    adamw_.step(store_, lr, t, clip, counts());
    if (zero_ > 0) gather_parameters(t);
    return;
  }
  // Pages that move: chunk by chunk through the store's updater (each update where its pages
  // are, under a lease), deferred into the next forward pass, or now.
  // Every rank visits every chunk (under ZeRO, in the same order, so each chunk's owner can
  // broadcast its update); frozen layers keep theirs.
  deferred_ = {lr, t, clip};
  for (const Chunk& c : store_.chunks()) {
    if (!keeps(c.layer, t)) store_.defer_update(c.id);
  }
  if (!config_.tier.defer_update) store_.apply_pending();
}

void ShardedOptimizer::update_chunk(int chunk) {
  const auto [own_first, own_last] = own_chunks();
  const bool own = chunk >= own_first && chunk < own_last;
  if (own) {
    adamw_.step_chunk(store_, chunk, deferred_.lr, count_of(store_.chunks()[chunk].layer, deferred_.t), deferred_.clip);
  }
  if (zero_ == 0) return;
  // ZeRO with tiers: the owner's update reaches every rank chunk by chunk (the whole-plane
  // all-gather would need the whole plane resident). The gradient was the owner's to consume.
  if (!own) {
    store_.zero_grad_chunk(chunk);
    store_.bump_version(chunk);
  }
  const int owner = partition_.owner(chunk);
  const PageLease use = store_.use_chunk(chunk, {}, {Plane::param});
  std::span<float> p = store_.chunk_view(chunk, Plane::param);
  dp_.broadcast(p.data(), p.size(), owner);
}

bool ShardedOptimizer::accept(int64_t step, double loss, double grad_norm) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) return true;
  // Nothing of this step reaches the weights: every gradient (this rank's share) back to zero.
  store_.discard(Plane::grad, 0, store_.numel());
  skipped_++;
  char what[160];
  std::snprintf(what, sizeof what, "step %lld: loss %g, gradient norm %g (not finite)", static_cast<long long>(step + 1),
                loss, grad_norm);
  const int allowed = config_.optim.skip_nonfinite_steps;
  if (skipped_ > allowed) {
    throw NonFiniteStep(std::string(what) + ": training stopped before the update (" + std::to_string(skipped_ - 1) +
                        " such step(s) skipped before; optim.skip_nonfinite_steps = " + std::to_string(allowed) + ")");
  }
  if (dp_.is_root()) {
    std::printf("keel: %s: skipped, no update (%lld of optim.skip_nonfinite_steps = %d)\n", what,
                static_cast<long long>(skipped_), allowed);
    std::fflush(stdout);
  }
  return false;
}

void ShardedOptimizer::add_step_fields(double, nlohmann::json& line) { line["skipped_steps"] = skipped_; }

std::string ShardedOptimizer::progress_fragment(double) const {
  return skipped_ > 0 ? std::to_string(skipped_) + " step(s) skipped (not finite)" : "";
}

void ShardedOptimizer::gather_parameters(int64_t t) {
  // AdamW cleared the gradients it consumed (this rank's shard). Under ZeRO-2 the reduce-scatter
  // already discarded the rest; under ZeRO-1 clear it here for the next step (kept mapped: the
  // next backward writes all of it again).
  const int r = dp_.rank();
  if (zero_ == 1) {
    std::span<float> grads = store_.range_view(Plane::grad, 0, store_.numel());
    std::fill(grads.begin(), grads.begin() + partition_.begin[r], 0.0f);
    std::fill(grads.begin() + partition_.begin[r + 1], grads.end(), 0.0f);
  }
  dp_.allgatherv(store_.range_view(Plane::param, 0, store_.numel()).data(), partition_.counts(), partition_.displs());
  // The chunks other ranks updated moved to the same version as this rank's.
  const auto [own_first, own_last] = own_chunks();
  for (const Chunk& c : store_.chunks()) {
    if ((c.id < own_first || c.id >= own_last) && !keeps(c.layer, t)) store_.bump_version(c.id);
  }
}

}  // namespace keel
