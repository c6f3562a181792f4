#include "runtime/trainer.h"

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/sync_policy.h"
#include "core/env.h"
#include "core/error.h"
#include "core/fileio.h"
#include "kernels/cpu/blas.h"
#include "pipeline/layout.h"
#include "runtime/generate.h"

namespace keel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The p-th percentile (0..1) of a tier's wait per first touch, hits counting as zero waits.
double stall_percentile(const TierCounters& c, double p) {
  if (c.acquires == 0 || c.stalls_ms.empty()) return 0;
  std::vector<float> misses = c.stalls_ms;
  std::sort(misses.begin(), misses.end());
  const uint64_t k = static_cast<uint64_t>(std::ceil(p * static_cast<double>(c.acquires)));
  const uint64_t zeros = c.acquires - misses.size();
  if (k <= zeros) return 0;
  return misses[std::min<size_t>(misses.size() - 1, static_cast<size_t>(k - zeros - 1))];
}

// Hit rate over the pages that live off the device (host and NVMe homes).
double offload_hit_rate(const TierStats& s) {
  uint64_t a = 0, h = 0;
  for (Tier t : {Tier::host, Tier::nvme}) {
    a += s.tier[static_cast<int>(t)].acquires;
    h += s.tier[static_cast<int>(t)].hits;
  }
  return a ? static_cast<double>(h) / static_cast<double>(a) : 1.0;
}

double total_stall_ms(const TierStats& s) {
  double ms = 0;
  for (const TierCounters& c : s.tier) ms += c.stall_ms;
  return ms;
}

void tier_json(const TierStats& s, double step_ms, nlohmann::json& line) {
  line["tier_hit_rate"] = offload_hit_rate(s);
  line["tier_stall_ms"] = total_stall_ms(s);
  line["tier_stall_share"] = step_ms > 0 ? total_stall_ms(s) / step_ms : 0.0;
  line["tier_evictions"] = s.evictions;
  line["tier_acquire_ms"] = s.acquire_ms;
  line["tier_stale_refetches"] = s.stale_refetches;
  line["tier_hint_fetches"] = s.hint_fetches;
  for (int i = 0; i < kNumTiers; ++i) {
    const TierCounters& c = s.tier[i];
    const std::string p = std::string("tier_") + tier_name(static_cast<Tier>(i)) + "_";
    line[p + "hit_rate"] = c.hit_rate();
    line[p + "stall_mean_ms"] = c.acquires ? c.stall_ms / static_cast<double>(c.acquires) : 0.0;
    line[p + "stall_p99_ms"] = stall_percentile(c, 0.99);
    line[p + "read_bytes"] = c.bytes_read;
    line[p + "written_bytes"] = c.bytes_written;
    line[p + "resident_bytes"] = c.resident_bytes;
  }
}

std::string tier_progress(const TierStats& s, double step_ms) {
  uint64_t in = 0, out = 0;
  for (const TierCounters& c : s.tier) in += c.bytes_read, out += c.bytes_written;
  char buf[200];
  std::snprintf(buf, sizeof buf, "tiers hit %.1f%% (host %.1f%%, nvme %.1f%%), stall %.1f ms (%.1f%%), %.0f MB in, %.0f MB out",
                100 * offload_hit_rate(s), 100 * s.tier[1].hit_rate(), 100 * s.tier[2].hit_rate(), total_stall_ms(s),
                step_ms > 0 ? 100 * total_stall_ms(s) / step_ms : 0.0, in / 1e6, out / 1e6);
  return buf;
}

double peak_rss_mb() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Trainer::Trainer(Config config, Communicator& comm)
    : config_(std::move(config)), comm_(comm), optimizer_(config_.optim) {
  if (config_.runtime.threads > 0) omp_set_num_threads(config_.runtime.threads);
  check_blas();

  const ModelConfig& m = config_.model;
  if (!config_.data.tokenizer.empty() && fs::exists(config_.data.tokenizer)) {
    tokenizer_ = Tokenizer::load(config_.data.tokenizer);
    check(m.vocab_size >= tokenizer_->vocab_size(),
          "model.vocab_size: expected at least the vocabulary of tokenizer " + config_.data.tokenizer + " (" +
              std::to_string(tokenizer_->vocab_size()) + "), found " + std::to_string(m.vocab_size));
  }
  const TrainConfig& t = config_.train;
  const int rank = comm_.rank(), world = comm_.size();
  const int P = config_.parallel.pipeline;
  std::vector<LayerRange> my_stages;  // empty: the whole model
  std::optional<pipeline::Plan> plan;
  if (P > 1) {
    // World rank = replica * P + pipeline rank: a replica's stages are consecutive ranks.
    dp_comm_ = comm_.split(rank % P, rank / P);
    pp_comm_ = comm_.split(rank / P, rank % P);
    const int S = P * pipeline::virtual_stages(config_.parallel);
    stages_ = pipeline::cut_stages(pipeline::layer_costs(m, t.seq_len), S, config_.parallel.stage_boundaries);
    // Every rank validates the whole schedule (the same on all of them) before any message moves.
    plan = pipeline::plan(config_, stages_, pipeline::micro_batches(config_));
    for (int s : plan->schedule.stages_of(pp_comm_->rank())) my_stages.push_back(stages_[s]);
  }
  const int dp_rank = dp().rank(), dp_size = dp().size();
  train_data_ = std::make_unique<DataLoader>(config_.data.train, t.batch_size, t.seq_len, m.vocab_size, true, t.seed,
                                             dp_rank, dp_size);
  val_data_ = std::make_unique<DataLoader>(config_.data.val, t.batch_size, t.seq_len, m.vocab_size, false, t.seed,
                                           dp_rank, dp_size);

  store_ = std::make_unique<ChunkStore>(config_.store.chunk_bytes);
  model_ = std::make_unique<GPT>(m, *store_, my_stages);
  store_->set_huge_page_alignment(tiering_enabled(config_.tier));
  store_->finalize(/*touch_params=*/!tiering_enabled(config_.tier));
  const int zero = dp_size > 1 ? config_.parallel.zero : 0;
  partition_ = ChunkPartition::balanced(*store_, zero > 0 ? dp_size : 1);
  GradSyncOptions sync_options;
  sync_options.bucket_bytes = config_.parallel.bucket_bytes;
  sync_options.scatter_to = zero == 2 ? &partition_ : nullptr;
  if (dp_size > 1 && sync_compressed(config_.sync)) {
    sync_options.codecs = sync_chunk_codecs(config_.sync, m.n_layer, *store_);
    sync_options.seed = t.seed ^ 0x5EEDC0DECull;
    sync_options.warmup_steps = config_.sync.warmup_steps;
    sync_options.shape = sync_sum_shape(config_.sync);
  }
  sync_ = std::make_unique<GradSync>(dp(), *store_, std::move(sync_options));
  if (zero > 0) {  // before loading: the moments are never resident at full size
    store_->shard_moments(partition_.first_chunk[dp_rank], partition_.first_chunk[dp_rank + 1]);
  }
  if (P > 1) {
    use_plan(std::move(*plan));
    // The tied embedding: ranks holding a copy of wte (the first and the last stage) sum its gradient.
    const bool tied = executor_->holds_first_stage() || executor_->holds_last_stage();
    tied_comm_ = pp_comm_->split(tied ? 0 : 1, pp_comm_->rank());
    if (!model_->has_layer(0)) {
      while (first_untied_chunk_ < static_cast<int>(store_->chunks().size()) &&
             store_->chunks()[first_untied_chunk_].layer == 0) {
        first_untied_chunk_++;
      }
    }
  } else {
    model_->allocate(t.batch_size, t.seq_len);
  }
  writers_ = ChunkPartition::balanced(*store_, world);
  ckpt_root_ = t.run_dir + "/ckpt";
  // A checkpoint directory without a manifest is what a crash during a write leaves behind.
  if (comm_.is_root()) remove_incomplete_checkpoints(ckpt_root_);
  double loaded_peak_gflops = 0;
  // A job restarted by `keel launch --max-restarts` continues from its own newest checkpoint when
  // it has one, whatever train.resume says (that was where the first attempt started).
  const bool restarted = std::getenv("KEEL_RESTART") != nullptr;
  const bool automatic = t.resume == "auto" || (restarted && (!list_checkpoints(ckpt_root_).empty() ||
                                                              Env::get().exists(ckpt_root_ + "/manifest.json")));
  const std::string resume = automatic ? ckpt_root_ : t.resume;
  std::vector<std::string> candidates;
  if (!resume.empty()) {
    if (automatic) {
      if (!list_checkpoints(resume).empty() || Env::get().exists(resume + "/manifest.json")) {
        candidates = checkpoint_candidates(resume);
      }
    } else {
      candidates = checkpoint_candidates(resume);
    }
  }
  // With tiers, everything from here on (loading a checkpoint, drawing the weights) goes through
  // the tiers page by page: the full state is never resident at once.
  if (tiering_enabled(config_.tier)) attach_tiers();
  // Every rank must load the same checkpoint: a candidate is used only if it verified on all ranks.
  std::string last_why;
  for (size_t i = 0; i < candidates.size() && resumed_from_.empty(); ++i) {
    std::string why;
    TrainState state;
    std::vector<float> residual;
    std::string residual_note;
    try {
      state = load_checkpoint(candidates[i], *store_, config_, LoadMode::resume, world);
      residual_note = load_residuals(state, residual);
    } catch (const Error& e) {
      why = e.what();
    }
    if (comm_.allreduce_max(why.empty() ? 0.0 : 1.0) == 0.0) {
      resumed_from_ = candidates[i];
      steps_done_ = state.step;
      train_data_->set_position(state.data);
      loaded_peak_gflops = state.peak_gflops;
      if (!residual.empty()) sync_->restore_residuals(residual);
      if (!residual_note.empty() && comm_.is_root()) std::fprintf(stderr, "keel: %s\n", residual_note.c_str());
      break;
    }
    last_why = why.empty() ? "checkpoint " + candidates[i] + ": rejected by another rank" : why;
    if (!why.empty() && (automatic || i + 1 < candidates.size())) {
      std::fprintf(stderr, "keel: %scheckpoint rejected: %s\n",
                   world > 1 ? ("[rank " + std::to_string(rank) + "] ").c_str() : "", why.c_str());
    }
  }
  // An explicit resume must succeed; "auto" starts afresh when nothing usable is there.
  check(automatic || candidates.empty() || !resumed_from_.empty(),
        candidates.size() == 1 ? last_why : "checkpoint " + resume + ": no usable checkpoint (" + last_why + ")");
  resumed_ = !resumed_from_.empty();
  if (!resumed_) {
    if (!candidates.empty() && comm_.is_root()) {
      std::fprintf(stderr, "keel: no usable checkpoint under %s: starting from step 0\n", resume.c_str());
    }
    // A failed load may have written into the store: start from a clean state.
    if (!candidates.empty()) {
      const auto [mfirst, mlast] = store_->moment_chunks();
      for (int c = mfirst; c < mlast; ++c) {
        for (Plane p : {Plane::adam_m, Plane::adam_v}) {
          if (tiers_) {
            tiers_->discard_to_zero({c, p});
            continue;
          }
          std::span<float> v = store_->chunk_view(c, p);
          std::fill(v.begin(), v.end(), 0.0f);
        }
      }
      for (const Chunk& c : store_->chunks()) store_->set_version(c.id, 0);
    }
    model_->init_weights(t.seed);
  }
  ckpt_ = std::make_unique<CheckpointWriter>(*store_, config_.checkpoint, rank, writers_.first_chunk[rank],
                                             writers_.first_chunk[rank + 1], t.checkpoint_every > 0);

  // Every rank uses rank 0's measurement so MFU figures agree; a resumed run reuses the writer's.
  const double peak = config_.runtime.peak_gflops > 0 ? config_.runtime.peak_gflops : loaded_peak_gflops;
  peak_gflops_ = peak > 0 ? peak : comm_.allreduce_max(comm_.is_root() ? measure_sgemm_gflops() : 0.0);
  if (comm_.is_root()) {
    fs::create_directories(t.run_dir);
    write_file(t.run_dir + "/config.toml", config_.to_toml());
    // A resumed run continues its metrics (without the steps it is about to replay); a fresh run
    // starts them anew.
    // A restarted job that found no checkpoint starts from step 0 but keeps the record of its
    // earlier failures and recoveries.
    const bool keep = resumed_ || std::getenv("KEEL_RESTART") != nullptr;
    if (keep) trim_metrics(steps_done_);
    metrics_.open(t.run_dir + "/metrics.jsonl", keep ? std::ios::app : std::ios::trunc);
    check(metrics_.good(), "run directory " + t.run_dir + ": cannot write metrics.jsonl");
  }
}

Trainer::~Trainer() = default;

void Trainer::attach_tiers() {
  store_->prefer_huge_pages();
  placement_ = place_pages(config_.tier, *store_);
  // Gradient buckets in flight pin their pages: keep them within what the device budget leaves
  // beside the homed pages and one operation's working set (at least one bucket).
  sync_->limit_in_flight(std::max(config_.parallel.bucket_bytes,
                                  (config_.tier.device_mib << 20) - placement_.bytes[0] - 2 * placement_.working_set_bytes));
  TierOptions options = tier_options(config_.tier);
  options.reserve_bytes = 2 * placement_.working_set_bytes;  // adaptive: room for the working window
  tiers_ = std::make_unique<TierManager>(*store_, options, placement_.homes);
  store_->attach_tiers(tiers_.get());
  store_->set_updater([this](int chunk) {
    const auto [own_first, own_last] = store_->moment_chunks();
    const bool own = chunk >= own_first && chunk < own_last;
    if (own) optimizer_.step_chunk(*store_, chunk, deferred_.lr, deferred_.t, deferred_.clip);
    if (dp().size() == 1 || config_.parallel.zero == 0) return;
    // ZeRO with tiers: the owner's update reaches every rank chunk by chunk (the whole-plane
    // all-gather would need the whole plane resident). The gradient was the owner's to consume.
    if (!own) {
      store_->zero_grad_chunk(chunk);
      store_->bump_version(chunk);
    }
    int owner = 0;
    while (partition_.first_chunk[owner + 1] <= chunk) owner++;
    const PageLease use = store_->use_chunk(chunk, {}, {Plane::param});
    std::span<float> p = store_->chunk_view(chunk, Plane::param);
    dp().broadcast(p.data(), p.size(), owner);
  });
}

std::string Trainer::load_residuals(const TrainState& state, std::vector<float>& out) {
  out.clear();
  if (sync_->residual_size() == 0) return "";
  const RankState* mine = nullptr;
  for (const RankState& r : state.ranks) {
    if (r.rank == comm_.rank()) mine = &r;
  }
  const std::string layout = sync_->residual_layout();
  if (state.ranks.size() != static_cast<size_t>(comm_.size()) || mine == nullptr || !mine->has_residual) {
    return "checkpoint " + state.dir + " holds no compression residuals for this layout (written by " +
           std::to_string(state.ranks.size()) + " rank(s)): error feedback starts from zero";
  }
  if (mine->residual_layout != layout) {
    return "checkpoint " + state.dir + ": compression residuals dropped (saved for " + mine->residual_layout +
           "; this run has " + layout + "): error feedback starts from zero";
  }
  out = read_rank_residual(state.dir, comm_.rank());
  check(out.size() == sync_->residual_size(), "checkpoint " + state.dir + ": residual of rank " +
                                                  std::to_string(comm_.rank()) + " has the wrong size");
  return "";
}

void Trainer::gather_parameters() {
  // AdamW cleared the gradients it consumed (this rank's shard). Under ZeRO-2 the reduce-scatter
  // already discarded the rest; under ZeRO-1 clear it here for the next step (kept mapped: the
  // next backward writes all of it again).
  const int r = dp().rank();
  if (config_.parallel.zero == 1) {
    std::span<float> grads = store_->range_view(Plane::grad, 0, store_->numel());
    std::fill(grads.begin(), grads.begin() + partition_.begin[r], 0.0f);
    std::fill(grads.begin() + partition_.begin[r + 1], grads.end(), 0.0f);
  }
  dp().allgatherv(store_->range_view(Plane::param, 0, store_->numel()).data(), partition_.counts(),
                   partition_.displs());
  // The chunks other ranks updated moved to the same version as this rank's.
  const auto [own_first, own_last] = store_->moment_chunks();
  for (const Chunk& c : store_->chunks()) {
    if ((c.id < own_first || c.id >= own_last) && c.layer >= config_.optim.freeze_layers) store_->bump_version(c.id);
  }
}

void Trainer::log_json(const std::string& line) {
  if (!comm_.is_root()) return;
  metrics_ << line << '\n';
  metrics_.flush();
}

StepStats Trainer::step() {
  const TrainConfig& t = config_.train;
  const auto t0 = std::chrono::steady_clock::now();
  StepStats s;
  const bool defer = tiers_ && config_.tier.defer_update;
  // With deferred updates the first step (nothing pending yet) is not what later steps look like.
  if (tiers_) tiers_->begin_step(!defer || store_->any_pending());
  s.lr = learning_rate(config_.optim, static_cast<int>(steps_done_), t.steps);
  // Gradients are zero here: the store starts zeroed and AdamW clears them as it consumes them.
  // Each rank's gradient is scaled for the global batch, so the sum over ranks is the gradient
  // of the mean loss over every rank's tokens: what one rank with world x the batch computes.
  const int world = dp().size();  // data-parallel ranks (the world without a pipeline)
  const int step_micro_batches = micro_batches_;  // dynamic micro-batches may change it after the step
  double loss_sum = 0;
  if (executor_) {
    sync_->begin(true, steps_done_);  // W notifications reach it for the last micro-batch only
    loss_sum = pipeline_backward();
  } else {
    for (int micro = 0; micro < t.grad_accum; ++micro) {
      Batch batch = train_data_->next();
      batch.grad_scale = 1.0f / (static_cast<float>(batch.B) * batch.T * t.grad_accum * world);
      loss_sum += model_->forward(batch);
      // The forward pass ran every deferred update (each before its chunk's first use); none may
      // still wait once gradients are written.
      if (micro == 0) store_->apply_pending();
      sync_->begin(micro == t.grad_accum - 1, steps_done_);
      model_->backward(batch, false, sync_.get());
    }
  }
  const auto sync_start = std::chrono::steady_clock::now();
  if (executor_ && !predicted_.empty()) predict_deferred_gradients();
  if (executor_) tie_embedding_grads();  // before the sync takes the embedding's bucket
  sync_->finish();
  s.sync = sync_->stats();
  const int zero = world > 1 ? config_.parallel.zero : 0;
  const auto [own_first, own_last] = store_->moment_chunks();
  // One sum over ranks for the loss and (ZeRO-2 ranks hold only their shard of the reduced
  // gradient) the squared gradient norm.
  // Frozen layers' gradients do not count towards the norm (they are not parameters being trained).
  for (const Chunk& c : store_->chunks()) {
    if (c.layer >= config_.optim.freeze_layers) break;
    if (zero == 2 && (c.id < own_first || c.id >= own_last)) continue;
    store_->zero_grad_chunk(c.id);
  }
  const bool post_validate = executor_ && config_.parallel.post_validate;
  double squares = 0;
  Communicator::Request norm_request;
  if (post_validate) {
    // The sum over the stages runs while this rank steps optimistically (below).
    squares = grad_sum_squares(*store_, first_untied_chunk_);
    norm_request = pp_comm_->iallreduce_sum(&squares, 1);
  } else if (executor_) {
    // Each stage's share of the norm (the tied embedding counted once, on the first stage), summed
    // over the replica's stages; the loss lives on the last stage, averaged over replicas.
    // Under ZeRO-2 each replica holds the summed gradient of its own chunks only.
    squares = zero == 2 ? comm_.allreduce_sum(grad_sum_squares(*store_, std::max(own_first, first_untied_chunk_), own_last))
                        : pp_comm_->allreduce_sum(grad_sum_squares(*store_, first_untied_chunk_));
    s.grad_norm = std::sqrt(squares);
    loss_sum = comm_.allreduce_sum(loss_sum) / world;
  } else {
    double sums[2] = {loss_sum, zero == 2 ? grad_sum_squares(*store_, own_first, own_last) : 0.0};
    if (world > 1) comm_.allreduce_sum(sums, 2);
    loss_sum = sums[0] / world;
    s.grad_norm = std::sqrt(zero == 2 ? sums[1] : grad_sum_squares(*store_));
  }
  auto clip_for = [&](double norm) {
    return config_.optim.grad_clip > 0 && norm > config_.optim.grad_clip ? static_cast<float>(config_.optim.grad_clip / norm)
                                                                          : 1.0f;
  };
  float clip = clip_for(s.grad_norm);
  if (post_validate) {
    // Zero Bubble's post-validation: step as if the norm needs no clipping, from a copy kept in
    // case it does; once the norm is known, redo the step from the copy if it did. The same
    // arithmetic as waiting: the same bytes.
    const Plane planes[4] = {Plane::param, Plane::grad, Plane::adam_m, Plane::adam_v};
    const size_t n = static_cast<size_t>(store_->numel());
    backup_.resize(4 * n);
    for (int k = 0; k < 4; ++k) {
      const std::span<float> v = store_->range_view(planes[k], 0, store_->numel());
      std::copy(v.begin(), v.end(), backup_.begin() + k * n);
    }
    optimizer_.step(*store_, s.lr, steps_done_ + 1, 1.0f);
    pp_comm_->wait(norm_request);
    s.grad_norm = std::sqrt(squares);
    clip = clip_for(s.grad_norm);
    if (clip != 1.0f) {
      for (int k = 0; k < 4; ++k) {
        const std::span<float> v = store_->range_view(planes[k], 0, store_->numel());
        std::copy_n(backup_.begin() + k * n, n, v.begin());
      }
      optimizer_.step(*store_, s.lr, steps_done_ + 1, clip);
      s.rolled_back = true;
    }
    loss_sum = comm_.allreduce_sum(loss_sum) / world;
  } else if (tiers_) {
    // Chunk by chunk through the store's updater (see attach_tiers): deferred into the next
    // forward pass, or now. Every rank visits every chunk (under ZeRO, in the same order, so
    // each chunk's owner can broadcast its update); frozen layers keep theirs.
    deferred_ = {s.lr, steps_done_ + 1, clip};
    for (const Chunk& c : store_->chunks()) {
      if (c.layer >= config_.optim.freeze_layers) store_->defer_update(c.id);
    }
    if (!defer) store_->apply_pending();
  } else {
    optimizer_.step(*store_, s.lr, steps_done_ + 1, clip);
  }
  if (zero > 0 && !tiers_) gather_parameters();
  if (executor_ && !predicted_.empty()) carry_prediction();
  if (executor_) {
    executor_->record(pipeline::Op::grad_sync, sync_start, std::chrono::steady_clock::now());
    pipeline_report(s);
    if (config_.parallel.dynamic_micro_batches) adapt_micro_batches();
  }
  steps_done_++;
  // One max over ranks for the spread of sync waits and the memory high-water mark.
  // A background checkpoint write still running on any rank keeps the checkpoint in flight.
  const bool writing = ckpt_->in_flight() && !ckpt_->done();
  double maxima[4] = {-s.sync.exposed_ms, s.sync.exposed_ms, peak_rss_mb(), writing ? 1.0 : 0.0};
  if (comm_.size() > 1) comm_.allreduce_max(maxima, 4);
  s.sync.exposed_min_ms = -maxima[0];
  s.sync.imbalance_ms = maxima[1] + maxima[0];
  s.peak_rss_mb = maxima[2];
  if (ckpt_->in_flight() && maxima[3] == 0.0) commit_checkpoint();  // every rank has written its part

  // A periodic checkpoint begins here, so the step's time includes what it costs training (the
  // snapshot copy; with checkpoint.async = false the whole write). The last step's checkpoint is
  // the final save of run().
  if (t.checkpoint_every > 0 && steps_done_ % t.checkpoint_every == 0 && steps_done_ != t.steps) {
    begin_checkpoint(ckpt_root_);
  }
  s.ckpt_stall_ms = pending_stall_ms_;
  pending_stall_ms_ = 0;
  if (tiers_) s.tiers = tiers_->take_step_stats();
  const double seconds = seconds_since(t0);
  const double tokens = static_cast<double>(t.batch_size) * t.seq_len * t.grad_accum * world;
  s.step = steps_done_;
  s.loss = loss_sum / (executor_ ? step_micro_batches : t.grad_accum);
  s.ms = seconds * 1e3;
  s.tokens_per_s = tokens / seconds;
  s.mfu = model_->train_flops_per_token(t.seq_len) * s.tokens_per_s / (peak_gflops_ * 1e9 * comm_.size());
  if (world > 1) {
    constexpr size_t kJitterWindow = 20;
    sync_latencies_ms_.push_back(s.sync.latency_ms);
    if (sync_latencies_ms_.size() > kJitterWindow) sync_latencies_ms_.pop_front();
    double mean = 0, var = 0;
    for (double x : sync_latencies_ms_) mean += x;
    mean /= sync_latencies_ms_.size();
    for (double x : sync_latencies_ms_) var += (x - mean) * (x - mean);
    s.sync_jitter = mean > 0 ? std::sqrt(var / sync_latencies_ms_.size()) / mean : 0;
  }
  return s;
}

void Trainer::use_plan(pipeline::Plan plan) {
  const TrainConfig& t = config_.train;
  micro_batches_ = plan.schedule.spec.micro;
  schedule_check_ = plan.check;
  // Activation slots from the schedule's proven peak of micro-batches in flight; evaluation sends
  // whole batches of train.batch_size through the stages.
  const bool predict = config_.parallel.predict_gradients != "off";
  const int deferred_stages = predict ? static_cast<int>(plan.schedule.stages_of(pp_comm_->rank()).size()) : 0;
  if (executor_) check(!executor_->defers_last_weights(), "pipeline: a new plan with gradient prediction");
  executor_.reset();
  model_->allocate(std::max(plan.micro_batch, t.batch_size), t.seq_len,
                   pipeline::Executor::slots_needed(schedule_check_, pp_comm_->rank(), deferred_stages));
  executor_ = std::make_unique<pipeline::Executor>(*model_, *pp_comm_, std::move(plan.schedule), stages_,
                                                   config_.parallel.lookahead);
  // Lookahead: the chunk store hears which layers the next instructions use.
  executor_->set_lookahead_hook([this](const std::vector<LayerHint>& hints) { store_->hint_layers(hints); });
  // A new plan is a new order of leases: the tiers record it afresh.
  if (tiers_) tiers_->record_again();
  if (predict) {
    const size_t n = static_cast<size_t>(store_->numel());
    predicted_.assign(n, 0.0f);
    measured_.assign(n, 0.0f);
    snapshot_.assign(n, 0.0f);
    executor_->defer_last_weights([this](bool before) {
      std::span<float> g = store_->range_view(Plane::grad, 0, store_->numel());
      if (before) {
        std::copy(g.begin(), g.end(), snapshot_.begin());
        return;
      }
      for (size_t i = 0; i < g.size(); ++i) measured_[i] = g[i] - snapshot_[i];
      measured_valid_ = true;
    });
  }
}

void Trainer::predict_deferred_gradients() {
  // The plane holds: -(last step's prediction) + what the carried W's added + this step's own
  // gradients but the last micro-batch's W. Add a prediction of that W.
  std::span<float> g = store_->range_view(Plane::grad, 0, store_->numel());
  const std::string& how = config_.parallel.predict_gradients;
  // momentum: an exponential average (0.9) of what the W added in earlier steps, started from
  // the first measurement; previous: the last measurement alone; mean (and before any
  // measurement): the step's other micro-batches' mean.
  if (how == "momentum" && measured_valid_) {
    if (momentum_.empty()) momentum_.assign(measured_.begin(), measured_.end());
    for (size_t i = 0; i < g.size(); ++i) momentum_[i] = 0.9f * momentum_[i] + 0.1f * measured_[i];
  }
  const float share = 1.0f / static_cast<float>(micro_batches_ - 1);
  if (how == "lstm") {
    // Per chunk: the LSTM's blend a * mean + b * previous (pipeline/gradient_predictor.h), after
    // it learned from how its last blend compared with the W's true gradient, now measured.
    if (!lstm_) {
      lstm_ = std::make_unique<pipeline::GradientPredictor>(static_cast<int>(store_->chunks().size()));
      lstm_mean_.assign(g.size(), 0.0f);
      lstm_previous_.assign(g.size(), 0.0f);
    }
    std::vector<float> mean(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const float carried = measured_valid_ ? measured_[i] - predicted_[i] : 0.0f;
      mean[i] = (g[i] - carried) * share;
    }
    for (const Chunk& c : store_->chunks()) {
      const size_t at = static_cast<size_t>(c.offset), n = static_cast<size_t>(c.numel);
      auto part = [&](std::vector<float>& v) { return std::span<const float>(v.data() + at, n); };
      if (measured_valid_) lstm_->learn(c.id, part(lstm_mean_), part(lstm_previous_), part(measured_));
      std::vector<float>& previous = measured_valid_ ? measured_ : lstm_previous_;
      if (!measured_valid_) std::fill_n(lstm_previous_.begin() + at, n, 0.0f);
      const auto [a, b] = lstm_->blend(c.id, part(mean), part(previous));
      for (size_t i = at; i < at + n; ++i) {
        predicted_[i] = a * mean[i] + b * previous[i];
        g[i] += predicted_[i];
      }
    }
    lstm_mean_.swap(mean);
    if (measured_valid_) lstm_previous_.assign(measured_.begin(), measured_.end());
    measured_valid_ = false;
    return;
  }
  const bool history = measured_valid_ && how != "mean";
  const std::vector<float>& past = how == "momentum" ? momentum_ : measured_;
  for (size_t i = 0; i < g.size(); ++i) {
    const float carried = measured_valid_ ? measured_[i] - predicted_[i] : 0.0f;
    const float p = history ? past[i] : (g[i] - carried) * share;
    predicted_[i] = p;
    g[i] += p;
  }
  measured_valid_ = false;
}

void Trainer::carry_prediction() {
  // The update used the prediction: its negative stays, for the true gradient to correct.
  std::span<float> g = store_->range_view(Plane::grad, 0, store_->numel());
  for (size_t i = 0; i < g.size(); ++i) g[i] = -predicted_[i];
  for (const Chunk& c : store_->chunks()) {
    if (c.layer >= config_.optim.freeze_layers) break;
    store_->zero_grad_chunk(c.id);
  }
}

pipeline::StageTimes Trainer::measured_stage_times() {
  pipeline::StageTimes times;
  times.micro_batch = config_.train.batch_size * config_.train.grad_accum / micro_batches_;
  const int S = static_cast<int>(stages_.size());
  times.forward.assign(S, 0.0);
  times.backward_input.assign(S, 0.0);
  times.backward_weight.assign(S, 0.0);
  pipeline::add_stage_times(executor_->timeline(), times);
  // Each stage runs on one rank of the replica: the sums put every stage's times everywhere.
  std::vector<double> all;
  for (const auto* v : {&times.forward, &times.backward_input, &times.backward_weight}) all.insert(all.end(), v->begin(), v->end());
  pp_comm_->allreduce_sum(all.data(), all.size());
  for (int s = 0; s < S; ++s) {
    times.forward[s] = all[s];
    times.backward_input[s] = all[S + s];
    times.backward_weight[s] = all[2 * S + s];
  }
  return times;
}

void Trainer::adapt_micro_batches() {
  const int64_t step = steps_done_ + 1;  // the step just measured (step 1 pays for warm-up)
  if (step != 2 && step != 3) return;
  const pipeline::StageTimes times = measured_stage_times();
  std::string reason;
  int m = micro_batches_;
  if (step == 2) {
    first_measure_ = times;
    m = pipeline::probe_micro_batches(config_, micro_batches_);
    reason = "measuring a second count";
  } else {
    // Every rank runs what rank 0 (replica 0's measurement) chose.
    if (first_measure_.micro_batch != times.micro_batch) {
      const pipeline::MicroBatchChoice c = pipeline::choose_micro_batches(config_, stages_, first_measure_, times);
      m = c.micro_batches;
      reason = c.reason;
    }
    m = static_cast<int>(comm_.broadcast(static_cast<int64_t>(m)));
  }
  if (comm_.is_root()) {
    std::printf("keel: step %lld: pipeline micro-batches %d -> %d (%s)\n", static_cast<long long>(step), micro_batches_, m,
                reason.c_str());
    std::fflush(stdout);
    log_json(json({{"event", "micro_batches"}, {"step", step}, {"from", micro_batches_}, {"to", m}, {"reason", reason}}).dump());
  }
  if (m != micro_batches_) use_plan(pipeline::plan(config_, stages_, m));
}

double Trainer::pipeline_backward() {
  const TrainConfig& t = config_.train;
  const int T = t.seq_len, sequences = t.batch_size * t.grad_accum, b = sequences / micro_batches_;
  // The step reads the same grad_accum batches one rank would, then cuts them into the
  // pipeline's micro-batches (every rank reads them: stage 0 needs the inputs, the last stage the
  // targets; the rest only their shape).
  // W's carried into this step read the previous step's tokens (the embedding's W does).
  std::swap(step_inputs_, step_inputs_prev_);
  std::swap(step_targets_, step_targets_prev_);
  step_inputs_.resize(static_cast<size_t>(sequences) * T);
  step_targets_.resize(step_inputs_.size());
  for (int k = 0; k < t.grad_accum; ++k) {
    const Batch batch = train_data_->next();
    const size_t n = static_cast<size_t>(batch.B) * T, at = static_cast<size_t>(k) * t.batch_size * T;
    std::copy(batch.inputs, batch.inputs + n, step_inputs_.begin() + at);
    std::copy(batch.targets, batch.targets + n, step_targets_.begin() + at);
  }
  std::vector<Batch> micro(micro_batches_);
  for (int j = 0; j < micro_batches_; ++j) {
    micro[j].inputs = step_inputs_.data() + static_cast<size_t>(j) * b * T;
    micro[j].targets = step_targets_.data() + static_cast<size_t>(j) * b * T;
    micro[j].B = b;
    micro[j].T = T;
    micro[j].grad_scale = 1.0f / (static_cast<float>(b) * T * micro_batches_ * dp().size());
  }
  return executor_->run_step(micro, dp().size() > 1 ? sync_.get() : nullptr);
}

void Trainer::tie_embedding_grads() {
  if (tied_comm_ == nullptr || tied_comm_->size() < 2) return;
  if (!executor_->holds_first_stage() && !executor_->holds_last_stage()) return;
  for (int id = 0; id < static_cast<int>(store_->tensors().size()); ++id) {
    if (store_->tensors()[id].spec.name != "wte") continue;
    const PageLease use = store_->use_tensor(id, {Plane::grad}, {Plane::grad});
    std::span<float> g = store_->view(id, Plane::grad);
    tied_comm_->allreduce_sum(g.data(), g.size());
  }
}

namespace {

// One rank's timeline as text for gathering: "op micro stage start end" per interval.
std::string encode_timeline(const std::vector<pipeline::Interval>& timeline) {
  std::ostringstream out;
  out.precision(17);
  for (const pipeline::Interval& iv : timeline) {
    out << static_cast<int>(iv.instr.op) << ' ' << iv.instr.micro << ' ' << iv.instr.stage << ' ' << iv.start << ' '
        << iv.end << '\n';
  }
  return out.str();
}

std::vector<pipeline::Interval> decode_timeline(const std::string& text) {
  std::vector<pipeline::Interval> timeline;
  std::istringstream in(text);
  int op = 0;
  pipeline::Interval iv;
  while (in >> op >> iv.instr.micro >> iv.instr.stage >> iv.start >> iv.end) {
    iv.instr.op = static_cast<pipeline::Op>(op);
    timeline.push_back(iv);
  }
  return timeline;
}

}  // namespace

void Trainer::pipeline_report(StepStats& s) {
  const pipeline::ExecutorStats& e = executor_->stats();
  double maxima[2] = {e.recv_wait_ms, e.peak_activation_bytes / 1e6};
  comm_.allreduce_max(maxima, 2);
  s.recv_wait_ms = maxima[0];
  s.activation_mb = maxima[1];
  // The bubble of replica 0, measured on its ranks' common clock origin (pipeline/executor.h).
  const std::string mine = encode_timeline(executor_->timeline());
  const std::vector<std::string> parts = pp_comm_->gather_strings(mine);
  if (comm_.is_root()) {
    pipeline::Timeline timeline;
    for (const std::string& p : parts) timeline.per_rank.push_back(decode_timeline(p));
    pipeline::account_bubble(timeline);
    s.bubble = timeline.bubble;
    s.rank_bubble = timeline.rank_bubble;
  }
  if (config_.parallel.trace && steps_done_ + 1 == config_.train.steps) {
    last_timelines_ = comm_.gather_strings(mine);
    write_pipeline_trace();
  }
}

void Trainer::write_pipeline_trace() {
  if (!comm_.is_root()) return;
  pipeline::Timeline timeline;
  for (const std::string& p : last_timelines_) timeline.per_rank.push_back(decode_timeline(p));
  const std::string path = config_.train.run_dir + "/pipeline_trace.json";
  const std::string trace = pipeline::chrome_trace(timeline, "keel " + config_.parallel.schedule + " step " +
                                                                  std::to_string(steps_done_ + 1));
  write_file_atomic(path, {ByteRange{trace.data(), trace.size()}});
  // The same step as a text Gantt chart (replica 0), under the run's summary.
  timeline.per_rank.resize(config_.parallel.pipeline);
  pipeline::account_bubble(timeline);
  std::printf("keel: pipeline timeline of step %lld (replica 0; F forward, B input grads, W weight grads, S sync + "
              "optimizer, . idle), bubble %.1f%%; Chrome trace %s\n%s",
              static_cast<long long>(steps_done_ + 1), 100 * timeline.bubble, path.c_str(),
              pipeline::gantt(timeline, 100).c_str());
  std::fflush(stdout);
}

std::string Trainer::save_assembled(const std::string& root) {
  const int P = config_.parallel.pipeline;
  store_->apply_pending();  // the state after the last step's update
  // The whole model's tensors in order, by name (a registry: nothing allocated).
  ChunkStore registry(config_.store.chunk_bytes);
  const GPT whole(config_.model, registry);
  std::vector<int> stage_of_layer(model_->num_layers());
  for (size_t st = 0; st < stages_.size(); ++st) {
    for (int l = stages_[st].first; l <= stages_[st].last; ++l) stage_of_layer[l] = static_cast<int>(st);
  }
  const std::vector<int>& stage_rank = executor_->schedule().stage_rank;
  auto local_id = [&](const std::string& name) {
    for (int id = 0; id < static_cast<int>(store_->tensors().size()); ++id) {
      if (store_->tensors()[id].spec.name == name) return id;
    }
    return -1;
  };
  const Plane planes[3] = {Plane::param, Plane::adam_m, Plane::adam_v};
  // ZeRO: each replica of a stage holds a shard of its moments; replica 0 gathers them whole.
  const bool sharded = config_.parallel.zero > 0 && dp().size() > 1;
  std::vector<float> gathered[3];
  if (sharded) {
    const int r = dp().rank();
    for (int k = 1; k < 3; ++k) {
      if (r == 0) gathered[k].resize(static_cast<size_t>(store_->numel()));
      const PageLease use = store_->use_range(planes[k], partition_.begin[r], partition_.begin[r + 1] - partition_.begin[r], false);
      const std::span<float> own = store_->range_view(planes[k], partition_.begin[r], partition_.begin[r + 1] - partition_.begin[r]);
      if (r == 0) std::copy(own.begin(), own.end(), gathered[k].begin());
      dp().gatherv_to_root(own.data(), gathered[k].data(), partition_.counts(), partition_.displs());
    }
  }
  // This rank's copy of one of its tensors' planes (replica 0).
  auto copy_of = [&](int local, int k, float* to) {
    const TensorInfo& info = store_->tensors()[local];
    if (sharded && k > 0) {
      std::copy_n(gathered[k].data() + info.offset, info.numel, to);
      return;
    }
    const PageLease use = store_->use_tensor(local, {planes[k]});
    const std::span<float> from = store_->view(local, planes[k]);
    std::copy(from.begin(), from.end(), to);
  };
  std::string dir;
  if (comm_.rank() < P) {  // replica 0
    std::unique_ptr<ChunkStore> full;
    if (comm_.is_root()) {
      full = std::make_unique<ChunkStore>(config_.store.chunk_bytes);
      GPT assembled(config_.model, *full);
      full->finalize();
    }
    for (int id = 0; id < static_cast<int>(registry.tensors().size()); ++id) {
      const TensorSpec& spec = registry.tensors()[id].spec;
      const int owner = stage_rank[stage_of_layer[spec.layer]];  // wte: the embedding's stage
      for (int k = 0; k < 3; ++k) {
        if (comm_.is_root()) {
          std::span<float> to = full->view(id, planes[k]);
          if (owner == 0) {
            copy_of(local_id(spec.name), k, to.data());
          } else {
            Communicator::Request r = pp_comm_->irecv(to.data(), to.size(), owner, id * 3 + k);
            pp_comm_->wait(r);
          }
        } else if (owner == pp_comm_->rank()) {
          std::vector<float> from(static_cast<size_t>(store_->tensors()[local_id(spec.name)].numel));
          copy_of(local_id(spec.name), k, from.data());
          Communicator::Request r = pp_comm_->isend(from.data(), from.size(), 0, id * 3 + k);
          pp_comm_->wait(r);
        }
      }
    }
    if (comm_.is_root()) {
      Config single = config_;  // the layout of one rank
      single.parallel.pipeline = 1;
      single.parallel.micro_batches = 0;
      single.parallel.stage_boundaries.clear();
      single.parallel.virtual_stages = 0;
      RankState state;
      state.data = train_data_->position();
      dir = save_checkpoint(root, *full, single, state, steps_done_, peak_gflops_);
    }
  }
  comm_.barrier();
  return dir;
}

double Trainer::evaluate(int batches) {
  // Every rank evaluates its share of the same global windows.
  batches = static_cast<int>(std::min<uint64_t>(batches, val_data_->num_windows()));
  store_->apply_pending();
  double sum = 0;
  for (int i = 0; i < batches; ++i) {
    sum += executor_ ? executor_->forward_only(val_data_->window(i)) : model_->forward(val_data_->window(i));
  }
  // With a pipeline only the last stage's ranks hold losses.
  return comm_.allreduce_sum(sum) / (static_cast<double>(batches) * dp().size());
}

void Trainer::save(const std::string& root) {
  if (ckpt_->in_flight() && ckpt_step_ == steps_done_ && ckpt_inflight_root_ == root) {
    commit_checkpoint();  // this very state is being written already
    return;
  }
  begin_checkpoint(root);
  if (ckpt_->in_flight()) commit_checkpoint();
}

void Trainer::begin_checkpoint(const std::string& root) {
  const auto t0 = std::chrono::steady_clock::now();
  store_->apply_pending();  // the checkpoint holds the state after the step's update
  if (ckpt_->in_flight()) commit_checkpoint();  // one checkpoint in flight at a time
  RankState state;
  state.rank = comm_.rank();
  state.data = train_data_->position();
  // Rank 0 names the checkpoint (a later attempt at a step that already has one gets a new name).
  const int attempt = static_cast<int>(comm_.broadcast(comm_.is_root() ? next_checkpoint_attempt(root, steps_done_) : 0));
  if (sync_->residual_size() > 0) {
    sync_->copy_residuals(residual_scratch_);
    state.has_residual = true;
    state.residual_layout = sync_->residual_layout();
  }
  ckpt_->begin(root, steps_done_, state, attempt, &residual_scratch_);
  ckpt_step_ = steps_done_;
  ckpt_inflight_root_ = root;
  ckpt_begin_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  pending_stall_ms_ += ckpt_begin_ms_;
  if (!config_.checkpoint.async) commit_checkpoint();
}

void Trainer::commit_checkpoint() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string part = ckpt_->finish();
  const std::vector<std::string> parts = comm_.gather_strings(part);
  int64_t ok = 0;
  if (comm_.is_root()) {
    CheckpointStats st;
    std::string failure;
    try {
      failure = publish_checkpoint(ckpt_inflight_root_, parts, *store_, config_, comm_.size(), peak_gflops_,
                                   config_.checkpoint.keep, &st);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    ok = failure.empty() ? 1 : 0;
    const double stall = ckpt_begin_ms_ +
                         std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::string name = ckpt_->name();
    if (ok) {
      std::printf("keel: checkpoint %s: %s, %.1f MB written for %.1f MB of state (%.0f %%)", name.c_str(),
                  st.full ? "full" : "differential", st.written_bytes / 1e6, st.raw_bytes / 1e6,
                  st.raw_bytes > 0 ? 100.0 * st.written_bytes / st.raw_bytes : 0.0);
      if (!st.full) std::printf(", %d of %d chunk planes unchanged, %d as XOR deltas", st.unchanged, st.records, st.xor_records);
      std::printf("; step stall %.1f ms, background write %.0f ms\n", stall, st.write_ms);
    } else {
      const std::vector<std::string> kept = list_checkpoints(ckpt_inflight_root_);
      std::printf("keel: checkpoint %s not written: %s; newest checkpoint: %s\n", name.c_str(), failure.c_str(),
                  kept.empty() ? "none" : kept.front().c_str());
    }
    std::fflush(stdout);
    json event = {{"event", "checkpoint"}, {"step", ckpt_step_}, {"name", name}, {"ok", ok != 0},
                  {"full", st.full}, {"raw_bytes", st.raw_bytes}, {"written_bytes", st.written_bytes},
                  {"records", st.records}, {"unchanged", st.unchanged}, {"xor_records", st.xor_records},
                  {"stall_ms", stall}, {"write_ms", st.write_ms}};
    if (!ok) event["error"] = failure;
    log_json(event.dump());
  }
  ok = comm_.broadcast(ok);
  ckpt_->committed(ok != 0);
  pending_stall_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void Trainer::trim_metrics(int64_t step) {
  const std::string path = config_.train.run_dir + "/metrics.jsonl";
  if (!fs::exists(path)) return;
  std::istringstream in(read_text_file(path));
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      const json j = json::parse(line);
      // Steps to be replayed go; recovery events stay (they describe this run's history).
      if (j.contains("step") && j.at("step").get<int64_t>() > step && !j.contains("event")) continue;
      if (j.value("event", "") == "checkpoint" && j.at("step").get<int64_t>() > step) continue;
    } catch (const json::exception&) {
      continue;  // a line cut short by the crash
    }
    kept += line + '\n';
  }
  write_file_atomic(path, {ByteRange{kept.data(), kept.size()}});
}

void Trainer::accumulate_sync(const SyncStats& s) {
  for (const LayerSyncStats& l : s.layers) {
    LayerSyncStats& total = sync_totals_[l.layer];
    total.layer = l.layer;
    total.raw_bytes += l.raw_bytes;
    total.wire_bytes += l.wire_bytes;
    if (l.codec != "none" || total.codec.empty()) total.codec = l.codec;  // the codec once compression started
  }
  sync_encode_ms_ += s.encode_ms;
  sync_decode_ms_ += s.decode_ms;
}

void Trainer::accumulate_tiers(const TierStats& s) {
  for (int i = 0; i < kNumTiers; ++i) {
    TierCounters& a = tier_totals_.tier[i];
    const TierCounters& b = s.tier[i];
    a.acquires += b.acquires;
    a.hits += b.hits;
    a.stall_ms += b.stall_ms;
    a.stalls_ms.insert(a.stalls_ms.end(), b.stalls_ms.begin(), b.stalls_ms.end());
    a.bytes_read += b.bytes_read;
    a.bytes_written += b.bytes_written;
    a.resident_bytes = b.resident_bytes;
  }
  tier_totals_.evictions += s.evictions;
  tier_totals_.acquire_ms += s.acquire_ms;
  tier_totals_.stale_refetches += s.stale_refetches;
  tier_totals_.hint_fetches += s.hint_fetches;
  tier_totals_.peak_device_bytes = s.peak_device_bytes;
  tier_totals_.peak_host_bytes = s.peak_host_bytes;
}

void Trainer::print_tier_summary() {
  if (!tiers_ || !comm_.is_root()) return;
  const TierStats& s = tier_totals_;
  std::printf("keel: tiered memory over this run (first touches of each page per step; device pages never leave):\n");
  std::printf("  %-7s %10s %9s %10s %10s %10s %11s\n", "tier", "homed MB", "hit rate", "stall ms", "p99 ms", "read MB",
              "written MB");
  for (int i = 0; i < kNumTiers; ++i) {
    const TierCounters& c = s.tier[i];
    std::printf("  %-7s %10.1f %8.1f%% %10.1f %10.2f %10.1f %11.1f\n", tier_name(static_cast<Tier>(i)),
                placement_.bytes[i] / 1e6, 100 * c.hit_rate(), c.stall_ms, stall_percentile(c, 0.99), c.bytes_read / 1e6,
                c.bytes_written / 1e6);
  }
  std::printf("  off-device hit rate %.1f%%, %llu evictions, %llu stale copies refetched, %.0f ms inside acquires; "
              "peak device %.1f MB of %lld MiB, host %.1f MB of %lld MiB\n",
              100 * offload_hit_rate(s), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.stale_refetches), s.acquire_ms, s.peak_device_bytes / 1e6,
              static_cast<long long>(config_.tier.device_mib), s.peak_host_bytes / 1e6,
              static_cast<long long>(config_.tier.host_mib));
}

void Trainer::print_sync_summary() {
  if (!comm_.is_root() || sync_totals_.empty()) return;
  const int n_layer = config_.model.n_layer;
  // Ratios are against what a ring all-reduce of float32 sends.
  const double ring = 2.0 * (dp().size() - 1) / dp().size();
  std::printf("keel: compressed sync over this run (rank 0: MB of float32 gradient, MB sent)\n");
  std::printf("  %-14s %-12s %10s %10s %8s\n", "layer", "codec", "raw MB", "sent MB", "ratio");
  double raw = 0, wire = 0;
  for (const auto& [layer, l] : sync_totals_) {
    const std::string name = l.layer == 0 ? "embeddings" : l.layer > n_layer ? "final norm" : "block " + std::to_string(l.layer - 1);
    std::printf("  %-14s %-12s %10.1f %10.2f %7.1fx\n", name.c_str(), l.codec.c_str(), l.raw_bytes / 1e6,
                l.wire_bytes / 1e6, l.wire_bytes > 0 ? l.raw_bytes * ring / l.wire_bytes : 0.0);
    raw += l.raw_bytes * ring;
    wire += l.wire_bytes;
  }
  std::printf("  total: %.1f MB sent instead of %.1f MB (%.1f %% fewer bytes), codec time %.0f ms encode + %.0f ms decode\n",
              wire / 1e6, raw / 1e6, raw > 0 ? 100 * (1 - wire / raw) : 0.0, sync_encode_ms_, sync_decode_ms_);
  std::fflush(stdout);
}

void Trainer::print_samples() {
  if (!comm_.is_root() || !tokenizer_ || !tokenizer_->can_encode() || config_.train.sample_tokens == 0) return;
  Rng rng(config_.train.seed ^ 0xC0FFEEull);
  SampleOptions options;
  options.max_new_tokens = config_.train.sample_tokens;
  options.stop_token = tokenizer_->eot_token();
  std::printf("samples (temperature %.1f, top-k %d):\n", options.temperature, options.top_k);
  for (int i = 0; i < config_.train.samples; ++i) {
    const std::vector<int> prompt = {tokenizer_->eot_token()};
    std::vector<int> out = generate(*model_, config_.train.seq_len, prompt, options, rng);
    std::string text = tokenizer_->decode(std::vector<int>(out.begin() + 1, out.end()));
    std::printf("--- sample %d ---\n%s\n", i + 1, text.c_str());
  }
  std::fflush(stdout);
}

RunSummary Trainer::run() {
  const TrainConfig& t = config_.train;
  const ModelConfig& m = config_.model;
  const bool root = comm_.is_root();
  const int world = dp().size();  // data-parallel ranks
  RunSummary summary;
  if (root) {
    std::printf("keel: model L=%d H=%d C=%d V=%d (%.2fM parameters, %zu chunks), batch %dx%d x%d x%d ranks, %d threads/rank\n",
                m.n_layer, m.n_head, m.n_embd, m.vocab_size, store_->param_count() / 1e6, store_->chunks().size(),
                t.batch_size, t.seq_len, t.grad_accum, world, omp_get_max_threads());
    std::printf("keel: train %s (%llu tokens), val %s (%llu tokens), run dir %s, SGEMM peak %.1f GFLOP/s\n",
                config_.data.train.c_str(), static_cast<unsigned long long>(train_data_->num_tokens()),
                config_.data.val.c_str(), static_cast<unsigned long long>(val_data_->num_tokens()), t.run_dir.c_str(),
                peak_gflops_);
    if (world > 1) {
      std::printf("keel: data parallel over %d ranks, %d gradient buckets of up to %.1f MiB, ZeRO-%d\n", world,
                  sync_->num_buckets(), config_.parallel.bucket_bytes / 1048576.0, config_.parallel.zero);
      if (sync_->compression_configured()) {
        const SyncConfig& sc = config_.sync;
        std::printf("keel: compressed sync \"%s\"%s%s: %d of %d buckets through codecs, error feedback on",
                    sc.codec.c_str(), sc.codec == "hybrid" ? ", policy " : "",
                    sc.codec == "hybrid" ? (sc.policy.empty() ? default_sync_policy(m.n_layer) : sc.policy).c_str()
                                         : "",
                    sync_->num_compressed_buckets(), sync_->num_buckets());
        if (sc.warmup_steps > 0) std::printf(", first %d steps uncompressed", sc.warmup_steps);
        std::printf("\n");
      }
    }
  }
  if (executor_ && root) {
    const pipeline::Schedule& sc = executor_->schedule();
    std::string cut;
    for (size_t i = 0; i < stages_.size(); ++i) {
      cut += (i ? " " : "") + std::to_string(stages_[i].first) + "-" + std::to_string(stages_[i].last) + "@r" +
             std::to_string(sc.stage_rank[i]);
    }
    int peak = 0;
    for (int p : schedule_check_.peak_in_flight) peak = std::max(peak, p);
    std::printf("keel: pipeline of %d ranks x %d data-parallel replica(s), schedule %s, %d stages (layers@rank: %s), "
                "%d micro-batches of %d sequences, at most %d in flight per rank (%.1f MB of activations)\n",
                sc.spec.ranks, dp().size(), pipeline::kind_name(sc.spec.kind), sc.num_stages(), cut.c_str(),
                micro_batches_, t.batch_size * t.grad_accum / micro_batches_, peak,
                *std::max_element(schedule_check_.peak_bytes.begin(), schedule_check_.peak_bytes.end()) / 1e6);    json stages = json::array();
    for (const LayerRange& r : stages_) stages.push_back({r.first, r.last});
    log_json(json({{"event", "pipeline"}, {"schedule", pipeline::kind_name(sc.spec.kind)}, {"ranks", sc.spec.ranks},
                   {"replicas", dp().size()}, {"stages", stages}, {"stage_rank", sc.stage_rank},
                   {"micro_batches", micro_batches_}, {"peak_in_flight", schedule_check_.peak_in_flight},
                   {"peak_activation_bytes", schedule_check_.peak_bytes}})
                 .dump());
  }
  if (tiers_ && root) {
    const TierConfig& tc = config_.tier;
    std::printf("keel: tiered memory: device %lld MiB (%.1f MB homed there), host %lld MiB (%.1f MB), nvme %.1f MB in %s "
                "(%s), working set %.1f MB, %s, lookahead %d\n",
                static_cast<long long>(tc.device_mib), placement_.bytes[0] / 1e6, static_cast<long long>(tc.host_mib),
                placement_.bytes[1] / 1e6, placement_.bytes[2] / 1e6, tc.nvme_dir.empty() ? "-" : tc.nvme_dir.c_str(),
                io_engine_name(tiers_->engine()), placement_.working_set_bytes / 1e6,
                tc.prefetch ? "prefetch on" : "on demand (no prefetch)", tc.lookahead);
    for (const std::string& note : placement_.notes) std::printf("keel: tiered memory: %s\n", note.c_str());
  }
  // Memory per rank, as allocated (the moments shrink with ZeRO-1/2), gathered to rank 0.
  const double moments_mb = comm_.allreduce_max(
      (store_->plane_bytes(Plane::adam_m) + store_->plane_bytes(Plane::adam_v)) / 1e6);
  if (root) {
    const int64_t own = writers_.size(0);
    // Checkpoints of a tiered run stream from the tiers: no snapshot buffers.
    const int copies = tiers_ ? 0 : config_.checkpoint.delta && config_.checkpoint.full_every > 1 ? 2 : 1;
    std::printf("keel: memory per rank: params %.1f MB, grads %.1f MB, AdamW moments %.1f MB, activations %.1f MB, "
                "checkpoint buffers %.1f MB\n",
                store_->plane_bytes(Plane::param) / 1e6, store_->plane_bytes(Plane::grad) / 1e6, moments_mb,
                model_->activation_bytes() / 1e6, copies * 3.0 * own * sizeof(float) / 1e6);
    if (resumed_) {
      std::printf("keel: resumed from %s at step %lld\n", resumed_from_.c_str(), static_cast<long long>(steps_done_));
    }
  }
  auto report_eval = [&](double loss) {
    if (root) {
      std::printf("step %6lld | val loss %.4f | val ppl %.2f\n", static_cast<long long>(steps_done_), loss,
                  std::exp(loss));
    }
    log_json(json({{"step", steps_done_}, {"val_loss", loss}, {"val_ppl", std::exp(loss)}}).dump());
  };
  // A resumed run does not evaluate again where it resumes (that loss is known, and a restart
  // should be training again as soon as it can).
  summary.val_loss_start = std::nan("");
  if (!resumed_) {
    summary.val_loss_start = evaluate(t.eval_batches);
    report_eval(summary.val_loss_start);
  }
  // Restarted by `keel launch --max-restarts`: the time from the failure being noticed to now,
  // when training resumes, is the recovery time.
  if (const char* restart = std::getenv("KEEL_RESTART"); restart != nullptr && root) {
    const char* noticed = std::getenv("KEEL_FAILURE_NOTICED_NS");
    const char* failure = std::getenv("KEEL_FAILURE");
    const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    const double seconds = noticed != nullptr ? (now_ns - std::atoll(noticed)) / 1e9 : -1.0;
    std::printf("keel: recovered from failure %s (%s) in %.2f s: training resumes at step %lld from %s\n", restart,
                failure != nullptr ? failure : "unknown", seconds, static_cast<long long>(steps_done_),
                resumed_ ? resumed_from_.c_str() : "scratch");
    log_json(json({{"event", "recovery"}, {"restart", std::atoi(restart)}, {"failure", failure ? failure : ""},
                   {"recovery_s", seconds}, {"step", steps_done_}, {"from", resumed_ ? resumed_from_ : "scratch"}})
                 .dump());
  }
  std::fflush(stdout);

  double tokens_per_s_sum = 0;
  int64_t timed = 0;
  while (steps_done_ < t.steps) {
    StepStats s = step();
    if (s.step > 1) {  // the first step pays for page faults and warm-up
      tokens_per_s_sum += s.tokens_per_s;
      timed++;
    }
    json line = {{"step", s.step}, {"loss", s.loss},   {"lr", s.lr},
                 {"grad_norm", s.grad_norm}, {"ms", s.ms}, {"tokens_per_s", s.tokens_per_s},
                 {"mfu", s.mfu}};
    line["peak_rss_mb"] = s.peak_rss_mb;
    if (s.ckpt_stall_ms > 0) line["ckpt_stall_ms"] = s.ckpt_stall_ms;
    line["moments_mb"] = moments_mb;
    if (world > 1) {
      line["ranks"] = world;
      line["sync_payload_bytes"] = s.sync.payload_bytes;
      line["sync_sent_bytes"] = s.sync.sent_bytes;
      line["sync_exposed_ms"] = s.sync.exposed_min_ms;
      line["sync_imbalance_ms"] = s.sync.imbalance_ms;
      line["sync_latency_ms"] = s.sync.latency_ms;
      line["sync_jitter"] = s.sync_jitter;
      if (sync_->compression_configured()) {
        line["sync_uncompressed_bytes"] = s.sync.uncompressed_bytes;
        line["sync_ratio"] = s.sync.sent_bytes > 0 ? s.sync.uncompressed_bytes / s.sync.sent_bytes : 1.0;
        line["sync_encode_ms"] = s.sync.encode_ms;
        line["sync_decode_ms"] = s.sync.decode_ms;
        line["sync_codec_share"] = s.ms > 0 ? (s.sync.encode_ms + s.sync.decode_ms) / s.ms : 0.0;
        json layers = json::array();
        for (const LayerSyncStats& l : s.sync.layers) {
          layers.push_back({{"layer", l.layer}, {"codec", l.codec}, {"raw_bytes", l.raw_bytes},
                            {"wire_bytes", l.wire_bytes}});
        }
        line["sync_layers"] = layers;
        accumulate_sync(s.sync);
      }
    }
    if (executor_) {
      line["pipeline_bubble"] = s.bubble;
      line["pipeline_rank_bubble"] = s.rank_bubble;
      line["pipeline_recv_wait_ms"] = s.recv_wait_ms;
      line["pipeline_activation_mb"] = s.activation_mb;
      if (config_.parallel.post_validate) line["pipeline_rolled_back"] = s.rolled_back;
    }
    if (tiers_) {
      accumulate_tiers(s.tiers);
      tier_json(s.tiers, s.ms, line);
      if (const std::string note = tiers_->take_rehome_note(); !note.empty()) {
        if (root) std::printf("keel: tiered memory: %s\n", note.c_str());
        line["tier_rehome"] = note;
      }
    }
    log_json(line.dump());
    if (root && (s.step % t.log_every == 0 || s.step == t.steps || s.step == 1)) {
      std::printf("step %6lld/%d | loss %.4f | lr %.2e | norm %6.3f | %7.1f ms | %7.0f tok/s | MFU %5.1f%%",
                  static_cast<long long>(s.step), t.steps, s.loss, s.lr, s.grad_norm, s.ms, s.tokens_per_s,
                  100 * s.mfu);
      if (world > 1) {
        std::printf(" | sync %.2f MB sent", s.sync.sent_bytes / 1e6);
        if (s.sync.compressed) {
          std::printf(" (%.1fx smaller), codec %.1f ms (%.1f%%)",
                      s.sync.sent_bytes > 0 ? s.sync.uncompressed_bytes / s.sync.sent_bytes : 1.0,
                      s.sync.encode_ms + s.sync.decode_ms,
                      s.ms > 0 ? 100 * (s.sync.encode_ms + s.sync.decode_ms) / s.ms : 0.0);
        }
        std::printf(", %.1f ms exposed, %.1f ms imbalance, latency %.1f ms +-%.0f%%", s.sync.exposed_min_ms,
                    s.sync.imbalance_ms, s.sync.latency_ms, 100 * s.sync_jitter);
      }
      if (tiers_) std::printf(" | %s", tier_progress(s.tiers, s.ms).c_str());
      if (executor_) std::printf(" | bubble %.1f%%, waits %.1f ms", 100 * s.bubble, s.recv_wait_ms);
      std::printf("\n");
      std::fflush(stdout);
    }
    if (t.eval_every > 0 && s.step % t.eval_every == 0 && s.step != t.steps) report_eval(evaluate(t.eval_batches));
  }
  print_sync_summary();
  print_tier_summary();
  summary.steps = steps_done_;
  summary.mean_tokens_per_s = timed > 0 ? tokens_per_s_sum / timed : 0;
  summary.val_loss_end = evaluate(t.eval_batches);
  report_eval(summary.val_loss_end);
  if (executor_) {
    // Periodic checkpoints and resuming are not supported with a pipeline yet (the config rejects
    // them); the final state is assembled into the checkpoint one rank would write.
    const std::string dir = save_assembled(ckpt_root_);
    if (root) std::printf("keel: val loss %.4f -> %.4f after %lld steps, %.0f tok/s mean; checkpoint %s\n",
                          summary.val_loss_start, summary.val_loss_end, static_cast<long long>(summary.steps),
                          summary.mean_tokens_per_s, dir.empty() ? "none" : dir.c_str());
    return summary;
  }
  save(ckpt_root_);
  if (root) {
    if (resumed_) {
      std::printf("keel: val loss %.4f after %lld steps (resumed from %s), %.0f tok/s mean; checkpoint %s/%s\n",
                  summary.val_loss_end, static_cast<long long>(summary.steps), resumed_from_.c_str(),
                  summary.mean_tokens_per_s, ckpt_root_.c_str(), ckpt_->name().c_str());
    } else {
      std::printf("keel: val loss %.4f -> %.4f after %lld steps, %.0f tok/s mean; checkpoint %s/%s\n",
                  summary.val_loss_start, summary.val_loss_end, static_cast<long long>(summary.steps),
                  summary.mean_tokens_per_s, ckpt_root_.c_str(), ckpt_->name().c_str());
    }
    std::fflush(stdout);
  }
  print_samples();
  return summary;
}

}  // namespace keel
