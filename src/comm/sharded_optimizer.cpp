#include "comm/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <sys/resource.h>

#include "comm/expert_parallel.h"
#include "comm/sharded_params.h"
#include "kernels/cpu/bf16.h"
#include "model/model_layout.h"
#include "store/bf16_state.h"

namespace keel {

ShardedOptimizer::ShardedOptimizer(const Config& config, Communicator& dp, ChunkStore& store)
    : config_(config), dp_(dp), store_(store), adamw_(config.optim) {
  zero_ = dp.size() > 1 ? config.parallel.zero : 0;
  const int P = config.parallel.expert;
  if (zero_ > 0 && experts_sharded(config)) {
    // Sharded experts: the chunks of no expert over the data group, each expert's over its holders
    // (under ZeRO-3 their parameters' homes too: comm/sharded_params.h).
    partition_ = ChunkPartition::balanced_experts_apart(store_, dp.size(), P);
    if (dp.size() > P && zero_ < 3) holders_ = dp.split(dp.rank() % P, dp.rank() / P);
    for (const TensorSpec& t : model_layout(config.model).tensors) {
      if (t.expert < 0) continue;
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      model_expert_bytes_ += n * static_cast<int64_t>(sizeof(float));
    }
    // The moment planes span the owned chunks; the others' pages inside the span are never written
    // (and given back once the weights settled: a load writes the span).
    int first = static_cast<int>(store_.chunks().size()), last = 0;
    for (const Chunk& c : store_.chunks()) {
      if (!owns(c.id)) continue;
      first = std::min(first, c.id);
      last = c.id + 1;
    }
    store_.shard_moments(std::min(first, last), last);
  } else {
    partition_ = ChunkPartition::balanced(store_, zero_ > 0 ? dp.size() : 1);
    // Before loading: the moments are never resident at full size.
    if (zero_ > 0) store_.shard_moments(partition_.first_chunk[dp.rank()], partition_.first_chunk[dp.rank() + 1]);
  }
  // The deferred chunk updates (used where the store's pages move; see step).
  store_.set_updater([this](int chunk) { update_chunk(chunk); });
  if (zero_ == 3) params_ = std::make_unique<ShardedParams>(dp, store_, partition_, config.parallel.zero3_keep,
                                                        config.parallel.zero3_progress_thread);
  const bool bf16_params = config.runtime.param_dtype == StateDtype::bf16;
  const bool bf16_grads = config.runtime.grad_dtype == StateDtype::bf16;
  if (bf16_params || bf16_grads) {
    // Masters where the moments are: the chunks this rank updates (with sharded experts not one
    // range; validate_bf16_state_config refused what this does not combine with).
    std::vector<int> masters;
    for (const Chunk& c : store_.chunks()) {
      if (owns(c.id)) masters.push_back(c.id);
    }
    bf16_ = std::make_unique<Bf16State>(store_, bf16_params, bf16_grads, masters);
    if (params_) {
      // ZeRO-3: the sharded parameters wrap the bf16 state; gathers move the owners' bf16 bits.
      params_->wrap_attached();
      if (bf16_params) params_->gather_bits_into(bf16_.get());
    }
  }
}

ShardedOptimizer::~ShardedOptimizer() = default;

bool ShardedOptimizer::owns(int chunk) const {
  if (!partition_.experts_apart()) {
    const auto [first, last] = own_chunks();
    return chunk >= first && chunk < last;
  }
  return partition_.owns(dp_.rank(), store_.chunks()[chunk]);
}

int64_t ShardedOptimizer::tensor_bytes(bool experts_only, bool owned_only) const {
  int64_t n = 0;
  for (const Chunk& c : store_.chunks()) {
    if ((experts_only && c.expert < 0) || (owned_only && !owns(c.id))) continue;
    for (const Segment& s : c.segments) n += s.numel;
  }
  return n * static_cast<int64_t>(sizeof(float));
}

int64_t ShardedOptimizer::moment_bytes_held() const {
  if (!partition_.experts_apart()) return store_.plane_bytes(Plane::adam_m) + store_.plane_bytes(Plane::adam_v);
  // Each owned chunk's extent (to the next chunk: alignment gaps included, as a plane's), twice.
  const std::vector<Chunk>& chunks = store_.chunks();
  int64_t n = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (owns(chunks[i].id)) n += (i + 1 < chunks.size() ? chunks[i + 1].offset : store_.numel()) - chunks[i].offset;
  }
  return 2 * n * static_cast<int64_t>(sizeof(float));
}

void ShardedOptimizer::weights_settled() {
  if (bf16_) bf16_->settle();  // from here on the bf16 bits and the masters are the state
  if (partition_.experts_apart()) {
    // A load writes the moment planes' whole span: the pages of chunks this rank does not own go
    // back (runs of them, so that only pages shared with owned chunks are zeroed in place).
    const std::vector<Chunk>& chunks = store_.chunks();
    const auto [first, last] = own_chunks();
    for (int c = first; c < last;) {
      if (owns(c)) {
        ++c;
        continue;
      }
      int e = c;
      while (e < last && !owns(e)) ++e;
      const int64_t begin = chunks[c].offset, end = e < static_cast<int>(chunks.size()) ? chunks[e].offset : store_.numel();
      for (Plane p : {Plane::adam_m, Plane::adam_v}) store_.discard(p, begin, end - begin);
      c = e;
    }
  }
  if (!params_) return;
  params_->settled();
  // What start-up left resident, measured before any step: the parameter plane's pages (mincore)
  // and the process's peak resident set so far.
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  startup_ = {store_.resident_bytes(Plane::param), static_cast<int64_t>(usage.ru_maxrss) * 1024};
}

void ShardedOptimizer::residency_attached() {
  // Innermost first: the bf16 state wraps the tiers (the planes it does not hold move through
  // them), and ZeRO-3's sharded parameters wrap whatever is outermost then.
  if (bf16_) bf16_->wrap_attached();
  if (params_) params_->wrap_attached();
}

void ShardedOptimizer::begin_pass(LeasePass pass) {
  if (params_) params_->begin_pass(pass);
}

void ShardedOptimizer::gather_whole_model() {
  if (params_) params_->gather_whole();
}

int64_t ShardedOptimizer::param_bytes_held() const {
  if (bf16_ && bf16_->holds(Plane::param)) return bf16_->held_bytes(Plane::param);
  return params_ ? params_->shard_bytes() : store_.plane_bytes(Plane::param);
}

int64_t ShardedOptimizer::grad_bytes_held() const {
  return bf16_ && bf16_->holds(Plane::grad) ? bf16_->held_bytes(Plane::grad) : store_.plane_bytes(Plane::grad);
}

int64_t ShardedOptimizer::master_bytes_held() const { return bf16_ ? bf16_->master_bytes() : 0; }

ShardedOptimizer::HeldMemory ShardedOptimizer::held_memory(bool tiered) const {
  const bool bf16_params = bf16_ && bf16_->holds(Plane::param), bf16_grads = bf16_ && bf16_->holds(Plane::grad);
  HeldMemory out;
  char text[320];
  auto add = [&](const char* separator) {
    if (!out.text.empty()) out.text += separator;
    out.text += text;
  };
  if (!params_) {
    if (tiered && !bf16_params) {
      std::snprintf(text, sizeof text, "params through the tiers");
    } else {
      const int64_t masters = master_bytes_held();
      out.bytes += param_bytes_held() + masters;
      if (masters > 0) {
        std::snprintf(text, sizeof text, "params %.1f MB (bf16), float32 master weights %.1f MB",
                      param_bytes_held() / 1e6, masters / 1e6);
      } else {
        std::snprintf(text, sizeof text, "params %.1f MB", param_bytes_held() / 1e6);
      }
    }
    add("");
    if (tiered && !bf16_grads) {
      std::snprintf(text, sizeof text, "grads through the tiers");
    } else {
      out.bytes += grad_bytes_held();
      std::snprintf(text, sizeof text, "grads %.1f MB", grad_bytes_held() / 1e6);
    }
    add(", ");
    return out;
  }
  // ZeRO-3. A rank's gradient shard is its parameter shard's chunks (one partition); the other
  // chunks' gradients are resident only while their bucket is being reduce-scattered (then
  // discarded). Figures in float32 bytes; bf16 bits are half of them.
  const int64_t shard = params_->group_max_shard_bytes(), gather = params_->group_max_layer_gather_bytes();
  const int64_t layer = params_->group_max_layer_bytes(), bucket = config_.parallel.bucket_bytes;
  if (bf16_params) {
    // Its own chunks' bits and float32 masters, the gathered layer's bits (no broadcast ahead:
    // gathers into bits are blocking), and a layer's lease widened into float32 pages.
    std::snprintf(text, sizeof text,
                  "params %.1f MB bf16 (its shard) + %.1f MB float32 masters (its shard) + up to %.1f MB bf16 of other "
                  "ranks' layers in flight + %.1f MB float32 pages of the layer in use",
                  shard / 2 / 1e6, shard / 1e6, gather / 2 / 1e6, layer / 1e6);
    out.bytes += shard / 2 + shard + gather / 2 + layer;
  } else if (tiered) {
    std::snprintf(text, sizeof text, "params through the tiers (its shard homed there, other ranks' layers "
                                     "gathered into leased pages)");
  } else {
    std::snprintf(text, sizeof text, "params %.1f MB (its shard) + up to %.1f MB of other ranks' layers in flight",
                  shard / 1e6, gather / 1e6);
    out.bytes += shard + gather;
  }
  add("");
  if (bf16_grads) {
    std::snprintf(text, sizeof text,
                  "grads %.1f MB bf16 (its shard) + the buckets being reduce-scattered (%.1f MB each, bf16) + %.1f MB "
                  "float32 pages of the layer in use",
                  shard / 2 / 1e6, bucket / 2 / 1e6, layer / 1e6);
    out.bytes += shard / 2 + bucket / 2 + layer;
  } else if (tiered) {
    std::snprintf(text, sizeof text, "grads through the tiers (the buckets being reduce-scattered pinned there)");
  } else {
    std::snprintf(text, sizeof text, "grads %.1f MB (its shard) + the buckets being reduce-scattered (%.1f MB each)",
                  shard / 1e6, bucket / 1e6);
    out.bytes += shard + bucket;
  }
  add(", ");
  return out;
}

void ShardedOptimizer::print_startup() const {
  if (bf16_) {
    std::printf("keel: bf16 training state: parameters %s, gradients %s; %.1f MB bf16 parameters, %.1f MB bf16 "
                "gradients, %.1f MB float32 master weights (%s), AdamW moments float32%s\n",
                bf16_->holds(Plane::param) ? "bf16" : "float32", bf16_->holds(Plane::grad) ? "bf16" : "float32",
                bf16_->held_bytes(Plane::param) / 1e6, bf16_->held_bytes(Plane::grad) / 1e6, bf16_->master_bytes() / 1e6,
                zero_ > 0 ? "this rank's ZeRO shard" : "every chunk: this rank updates all",
                cpu_has_bf16() ? "" : "; warning: this CPU has no bf16 instructions: conversions run in scalar code");
  }
  if (config_.parallel.zero == 3 && dp_.size() == 1) {
    std::printf("keel: parallel.zero = 3 on one data-parallel rank shards nothing: it holds every parameter, "
                "gradient and moment\n");
  }
  if (!params_) return;
  std::printf("keel: ZeRO-3 over %d ranks: parameters up to %.1f MB per rank (its shard) of %.1f MB, plus the layers "
              "in flight (up to %.1f MB in use at once with zero3_keep = \"%s\"%s, and the next one's broadcast "
              "ahead, %s); gradients reduce-scattered, moments sharded\n",
              dp_.size(), params_->group_max_shard_bytes() / 1e6, params_->whole_bytes() / 1e6,
              params_->group_max_layer_gather_bytes() / 1e6, to_string(config_.parallel.zero3_keep),
              config_.parallel.zero3_keep == Zero3Keep::none ? "" : ", more while kept",
              params_->progress_thread_running() ? "driven by a progress thread"
              : config_.parallel.zero3_progress_thread ? "driven by MPI calls only: MPI_THREAD_MULTIPLE not granted"
                                                        : "driven by MPI calls only");
  if (partition_.experts_apart()) {
    const int P = partition_.expert_group, D = dp_.size();
    // (In a pipeline a rank's layout holds its stage's blocks: the share is of the stage's experts.)
    const bool staged = config_.parallel.pipeline > 1;
    std::printf("keel: ZeRO-3 with sharded experts: a rank's layout holds %.1f MB of the %s %.1f MB of routed "
                "experts (1/%d: its expert group's share), sharded over the %d rank(s) holding the same experts; the "
                "chunks of no expert over all %d%s\n",
                tensor_bytes(true, false) / 1e6, staged ? "stage's" : "model's",
                (staged ? P * tensor_bytes(true, false) : model_expert_bytes_) / 1e6, P, D / P, D,
                staged ? " of the stage's replicas" : "");
  }
}

void ShardedOptimizer::clear_frozen_grads(int64_t step) {
  for (const Chunk& c : store_.chunks()) {
    if (c.layer >= config_.optim.frozen_at(step)) break;
    if (zero_ >= 2 && !owns(c.id)) continue;
    store_.zero_grad_chunk(c.id);
  }
}

double ShardedOptimizer::local_grad_squares() const {
  if (zero_ >= 2 && partition_.experts_apart()) {
    // The owned chunks (each expert's over its holders: every expert counted once in the group).
    double total = 0;
    for (const Chunk& c : store_.chunks()) {
      if (!owns(c.id)) continue;
      const int layer = c.layer;
      if (layer < static_cast<int>(counts_.size()) && counts_[layer] == 0) continue;
      total += grad_sum_squares(store_, c.id, c.id + 1);
    }
    return total;
  }
  const auto [own_first, own_last] = zero_ >= 2 ? own_chunks() : std::pair<int, int>{0, -1};
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
    // Whole planes: AdamW over this rank's shard, then (ZeRO-1/2) one all-gather of the
    // parameters. Under ZeRO-3 the copies of other ranks' parameters gathered this step are
    // dropped first (every broadcast of them finished: the owners' update makes them stale).
    if (params_) params_->drop_gathered();
    if (partition_.experts_apart()) {
      step_owned(lr, t, clip);
      return;
    }
    adamw_.step(store_, lr, t, clip, counts());
    if (zero_ > 0) gather_parameters(t);
    return;
  }
  // Pages that move: chunk by chunk through the store's updater (each update where its pages
  // are, under a lease), deferred into the next forward pass, or now.
  // Every rank visits every chunk (under ZeRO, in the same order, so each chunk's owner can
  // broadcast its update); frozen layers keep theirs.
  if (params_) params_->drop_gathered();  // (ZeRO-3 over tiers: the owners' updates make them stale)
  deferred_ = {lr, t, clip};
  for (const Chunk& c : store_.chunks()) {
    if (!keeps(c.layer, t)) store_.defer_update(c.id);
  }
  if (!config_.tier.defer_update) store_.apply_pending();
}

void ShardedOptimizer::update_chunk(int chunk) {
  const bool own = owns(chunk);
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
  if (params_) return;  // ZeRO-3: the update stays with its owner until a layer's lease gathers it
  // A chunk of no expert from its owner over the data group; with sharded experts an expert chunk
  // from its owner among the ranks holding it, over them (data == P: a rank alone holds it).
  const bool expert = partition_.experts_apart() && store_.chunks()[chunk].expert >= 0;
  Communicator* over = expert ? holders_.get() : &dp_;
  if (over == nullptr) return;
  const int owner = expert ? partition_.expert_holder(chunk) : partition_.owner(chunk);
  if (bf16_ && bf16_->holds(Plane::param)) {
    // bf16 working parameters: the owner's bits (rounded from its master by the update) are what
    // every rank computes with; they travel as they are, half the bytes of float32.
    const Chunk& c = store_.chunks()[chunk];
    over->broadcast(bf16_->bits(Plane::param, c.offset), static_cast<size_t>(c.numel), owner);
    if (!own) bf16_->bits_written({chunk, Plane::param});
    bf16_broadcast_bytes_ += c.numel * 2;
    return;
  }
  const PageLease use = store_.use_chunk(chunk, {}, {Plane::param});
  std::span<float> p = store_.chunk_view(chunk, Plane::param);
  over->broadcast(p.data(), p.size(), owner);
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

void ShardedOptimizer::add_step_fields(double, nlohmann::json& line) {
  line["skipped_steps"] = skipped_;
  if (bf16_) {
    // This rank's (rank 0's in the line) bf16 state: bytes held, and the float32 pages of the
    // parameter and gradient planes resident now (mincore: the leased pages only, between steps none),
    // and of the bits (under ZeRO-2/3 other ranks' gradient bits are given back once reduce-scattered).
    line["bf16_param_bytes"] = bf16_->held_bytes(Plane::param);
    line["bf16_grad_bytes"] = bf16_->held_bytes(Plane::grad);
    line["bf16_master_bytes"] = bf16_->master_bytes();
    line["bf16_param_resident_bytes"] = bf16_->resident_bytes(Plane::param);
    line["bf16_grad_resident_bytes"] = bf16_->resident_bytes(Plane::grad);
    line["bf16_float_param_peak_bytes"] = bf16_->take_peak_widened_bytes(Plane::param);
    line["bf16_float_grad_peak_bytes"] = bf16_->take_peak_widened_bytes(Plane::grad);
    line["bf16_float_param_resident_bytes"] = store_.resident_bytes(Plane::param);
    line["bf16_float_grad_resident_bytes"] = store_.resident_bytes(Plane::grad);
    line["bf16_param_broadcast_bytes"] = bf16_broadcast_bytes_;
    bf16_broadcast_bytes_ = 0;
  }
  if (partition_.experts_apart()) {
    // Every rank's figures (rank_figures), in world-rank order, from the step's reduction (in a
    // pipeline every stage's replicas: a rank holds its stage's chunks; with tensor groups every
    // tensor rank: a rank holds its tensor shard of them).
    const int k = rank_figure_count(),
              n = dp_.size() * std::max(1, config_.parallel.pipeline) * std::max(1, config_.parallel.tensor);
    check(rank_figures_.size() == static_cast<size_t>(n * k),
          "sharded experts: the step's figures cover " + std::to_string(rank_figures_.size()) + " values, expected " +
              std::to_string(n * k) + " (every rank's)");
    const char* names[] = {"held_param_bytes", "held_expert_param_bytes", "held_moment_bytes",
                           "held_expert_moment_bytes", "moment_resident_bytes"};
    for (int f = 0; f < k; ++f) {
      std::vector<int64_t> per_rank(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) per_rank[static_cast<size_t>(r)] = static_cast<int64_t>(rank_figures_[static_cast<size_t>(r * k + f)]);
      line[names[f]] = per_rank;
    }
    // (A rank's gradient plane is laid out as its parameters: the same bytes.)
    line["held_grad_bytes"] = line["held_param_bytes"];
    line["held_expert_grad_bytes"] = line["held_expert_param_bytes"];
    line["model_expert_param_bytes"] = model_expert_bytes_;
  }
  if (!params_) return;
  // Every rank's figures, measured on that rank (resident pages by mincore), in rank order.
  const ShardedParams::Peaks peaks = params_->take_peaks();
  const double mine[] = {static_cast<double>(params_->shard_bytes()),
                         static_cast<double>(store_.resident_bytes(Plane::param)),
                         static_cast<double>(peaks.resident_bytes),
                         static_cast<double>(peaks.gathered_bytes),
                         static_cast<double>(peaks.ahead_bytes),
                         static_cast<double>(peaks.received_bytes),
                         static_cast<double>(peaks.evaluation_received_bytes),
                         static_cast<double>(store_.resident_bytes(Plane::grad)),
                         static_cast<double>(moment_bytes_held()),  // (sharded experts: the owned chunks', not the span's)
                         static_cast<double>(startup_.param_resident_bytes),
                         static_cast<double>(startup_.peak_rss_bytes)};
  constexpr int kFigures = sizeof mine / sizeof mine[0];
  const int n = dp_.size();
  std::vector<double> all(static_cast<size_t>(kFigures * n), 0.0);
  std::copy(std::begin(mine), std::end(mine), all.begin() + static_cast<ptrdiff_t>(kFigures * dp_.rank()));
  dp_.allreduce_sum(all.data(), all.size());
  const char* names[kFigures] = {"zero3_param_shard_bytes",     "zero3_param_resident_bytes",
                                 "zero3_param_peak_resident_bytes", "zero3_in_flight_peak_bytes",
                                 "zero3_ahead_peak_bytes",      "zero3_gathered_bytes",
                                 "zero3_eval_gathered_bytes",
                                 "zero3_grad_resident_bytes",
                                 "zero3_moment_bytes",
                                 "zero3_startup_param_resident_bytes",
                                 "zero3_startup_peak_rss_bytes"};
  for (int f = 0; f < kFigures; ++f) {
    std::vector<int64_t> per_rank(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) per_rank[static_cast<size_t>(r)] = static_cast<int64_t>(all[static_cast<size_t>(r * kFigures + f)]);
    line[names[f]] = per_rank;
  }
}

int ShardedOptimizer::rank_figure_count() const { return partition_.experts_apart() ? 5 : 0; }

void ShardedOptimizer::rank_figures(std::span<double> out) const {
  if (!partition_.experts_apart()) return;
  // What it holds of the parameters and gradients (its store: every chunk of no expert and its
  // own experts'), the moments it owns, the experts' part of each, and its moment planes' pages
  // resident now (mincore over their span).
  out[0] = static_cast<double>(tensor_bytes(false, false));
  out[1] = static_cast<double>(tensor_bytes(true, false));
  out[2] = static_cast<double>(2 * tensor_bytes(false, true));
  out[3] = static_cast<double>(2 * tensor_bytes(true, true));
  out[4] = static_cast<double>(store_.resident_bytes(Plane::adam_m) + store_.resident_bytes(Plane::adam_v));
}

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
  if (zero_ != 3) {
    dp_.allgatherv(store_.range_view(Plane::param, 0, store_.numel()).data(), partition_.counts(), partition_.displs());
  }
  // The chunks other ranks updated moved to the same version as this rank's.
  const auto [own_first, own_last] = own_chunks();
  for (const Chunk& c : store_.chunks()) {
    if ((c.id < own_first || c.id >= own_last) && !keeps(c.layer, t)) store_.bump_version(c.id);
  }
}

void ShardedOptimizer::step_owned(double lr, int64_t t, float clip) {
  // AdamW::step over the owned chunks: frozen layers drop their gradients, held layers wait.
  for (const Chunk& c : store_.chunks()) {
    if (!owns(c.id)) continue;
    if (c.layer < config_.optim.frozen_at(t - 1)) {
      store_.zero_grad_chunk(c.id);
      continue;
    }
    const int64_t own_t = count_of(c.layer, t);
    if (own_t == 0) continue;
    adamw_.step_chunk(store_, c.id, lr, own_t, clip);
  }
  // AdamW cleared the gradients it consumed; under ZeRO-1 the others' are cleared here for the
  // next step (ZeRO-2/3's reduce-scatter already gave them back).
  for (const Chunk& c : store_.chunks()) {
    if (zero_ == 1 && !owns(c.id)) {
      std::span<float> g = store_.range_view(Plane::grad, c.offset, c.numel);
      std::fill(g.begin(), g.end(), 0.0f);
    }
  }
  if (!params_) broadcast_owned_runs();  // (ZeRO-3: the updates stay with their owners until gathered)
  for (const Chunk& c : store_.chunks()) {
    if (!owns(c.id) && !keeps(c.layer, t)) store_.bump_version(c.id);
  }
}

void ShardedOptimizer::broadcast_owned_runs() {
  const std::vector<Chunk>& chunks = store_.chunks();
  const int n = static_cast<int>(chunks.size());
  auto owner_of = [&](int c) { return chunks[c].expert >= 0 ? partition_.expert_holder(c) : partition_.owner(c); };
  for (int c = 0; c < n;) {
    const bool expert = chunks[c].expert >= 0;
    const int owner = owner_of(c);
    int e = c + 1;
    while (e < n && (chunks[e].expert >= 0) == expert && owner_of(e) == owner) ++e;
    const int64_t offset = chunks[c].offset, numel = chunks[e - 1].offset + chunks[e - 1].numel - offset;
    float* data = store_.range_view(Plane::param, offset, numel).data();
    if (!expert) {
      dp_.broadcast(data, static_cast<size_t>(numel), owner);
    } else if (holders_) {  // (data == P: a rank alone holds its experts)
      holders_->broadcast(data, static_cast<size_t>(numel), owner);
    }
    c = e;
  }
}

}  // namespace keel
