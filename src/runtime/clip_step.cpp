#include "runtime/clip_step.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace keel {

FeatureGather feature_gather(Communicator& dp) {
  return {dp.rank(), dp.size(), [&dp](float* rows, int floats_per_rank) {
            const std::vector<int> counts(dp.size(), floats_per_rank);
            std::vector<int> displs(dp.size());
            for (int r = 0; r < dp.size(); ++r) displs[r] = r * floats_per_rank;
            dp.allgatherv(rows, counts, displs);
          }};
}

ClipStep::ClipStep(const Config& config, Communicator& dp, ChunkStore& store, ClipModel& model, ClipLoader& data,
                   GradSync& sync, ShardedOptimizer& optimizer)
    : config_(config), dp_(dp), store_(store), model_(model), data_(data), sync_(sync), optimizer_(optimizer) {
  model_.allocate(config.train.batch_size, config.train.seq_len);
}

double ClipStep::forward_loss(const Batch&) {
  throw Error("a dual encoder has no token windows to score (its evaluation is ClipStep::evaluate)");
}

void ClipStep::measure_and_balance(ClipStepResult& r, bool balance) {
  const bool sharded = optimizer_.norm_is_sharded();
  const auto [own_first, own_last] = sharded ? optimizer_.own_chunks()
                                             : std::pair<int, int>{0, static_cast<int>(store_.chunks().size())};
  const int image_end = model_.image().first_layer() + model_.image().num_layers();
  const int text_end = model_.text().first_layer() + model_.text().num_layers();
  auto part = [&](int layer) { return layer < image_end ? 0 : layer < text_end ? 1 : 2; };
  double sq[3] = {0, 0, 0};
  for (int c = own_first; c < own_last; ++c) {  // in chunk order: a fixed summation order
    const Chunk& chunk = store_.chunks()[c];
    if (chunk.replica) continue;
    const PageLease use = store_.use_chunk(c, {Plane::grad});
    double s = 0;
    for (float g : store_.chunk_view(c, Plane::grad)) s += static_cast<double>(g) * g;
    sq[part(chunk.layer)] += s;
  }
  if (sharded && dp_.size() > 1) dp_.allreduce_sum(sq, 3);
  r.image_norm = std::sqrt(sq[0]);
  r.text_norm = std::sqrt(sq[1]);
  r.scale_norm = std::sqrt(sq[2]);
  if (!balance || r.image_norm == 0 || r.text_norm == 0) return;
  const double mean = std::sqrt(r.image_norm * r.text_norm);
  r.image_factor = mean / r.image_norm;
  r.text_factor = mean / r.text_norm;
  for (int c = own_first; c < own_last; ++c) {
    const Chunk& chunk = store_.chunks()[c];
    const int p = part(chunk.layer);
    if (chunk.replica || p == 2) continue;
    const PageLease use = store_.use_chunk(c, {Plane::grad}, {Plane::grad});
    const float f = static_cast<float>(p == 0 ? r.image_factor : r.text_factor);
    for (float& g : store_.chunk_view(c, Plane::grad)) g *= f;
  }
}

TowerMask ClipStep::plan_step(int64_t step) {
  const ClipConfig& clip = config_.clip;
  if (clip.image_update_every == 1 && clip.text_update_every == 1) return {};
  const TowerMask trains{step % clip.image_update_every == 0, step % clip.text_update_every == 0};
  std::vector<int64_t> counts(static_cast<size_t>(model_.num_layers()), step + 1);
  std::vector<char> held(counts.size(), 0);
  auto plan = [&](Tower& tower, bool on, int every) {
    for (int l = tower.first_layer(); l < tower.first_layer() + tower.num_layers(); ++l) {
      counts[l] = on ? step / every + 1 : 0;  // its own updates so far, this one included
      held[l] = on ? 0 : 1;
    }
  };
  plan(model_.image(), trains.image, clip.image_update_every);
  plan(model_.text(), trains.text, clip.text_update_every);
  sync_.set_held(std::move(held));
  optimizer_.set_update_counts(std::move(counts));
  return trains;
}

void ClipStep::add_step_fields(double step_ms, nlohmann::json& line) {
  const double samples = static_cast<double>(config_.train.batch_size) * config_.train.grad_accum * dp_.size();
  line["samples_per_s"] = samples / (step_ms / 1e3);
  line["accuracy_i2t"] = last_.accuracy_i2t;
  line["accuracy_t2i"] = last_.accuracy_t2i;
  line["logit_scale"] = last_.logit_scale;
  line["grad_norm_image"] = last_.image_norm;
  line["grad_norm_text"] = last_.text_norm;
  if (config_.clip.image_update_every > 1 || config_.clip.text_update_every > 1) {
    line["trained"] = std::string(last_.trained.image ? "image" : "") +
                      (last_.trained.image && last_.trained.text ? "+" : "") + (last_.trained.text ? "text" : "");
  }
  if (config_.clip.grad_balance == GradBalance::norm) {
    line["grad_balance_image"] = last_.image_factor;
    line["grad_balance_text"] = last_.text_factor;
  }
}

std::string ClipStep::progress_fragment(double step_ms) const {
  const double samples = static_cast<double>(config_.train.batch_size) * config_.train.grad_accum * dp_.size();
  char text[96];
  std::snprintf(text, sizeof text, "%.1f pairs/s, in-batch acc %.2f/%.2f", samples / (step_ms / 1e3),
                last_.accuracy_i2t, last_.accuracy_t2i);
  return text;
}

ClipStepResult ClipStep::run_clip(int64_t step, double lr) {
  const TrainConfig& t = config_.train;
  const int world = dp_.size();
  ClipStepResult r;
  double loss_sum = 0;
  const ClipConfig& clip = config_.clip;
  const int patches = clip.image_tower == ImageTower::vit ? model_.spec().vit_spec().patches() : 0;
  const int keep = std::max(1, static_cast<int>(std::lround(patches * (1.0 - clip.vit_mask))));
  r.trained = plan_step(step);
  const FeatureGather gather = feature_gather(dp_);
  for (int micro = 0; micro < t.grad_accum; ++micro) {
    const int64_t first = data_.position() + static_cast<int64_t>(dp_.rank()) * t.batch_size;  // in the global order
    ClipBatch batch = data_.next();
    if (clip.vit_mask > 0 && keep < patches) {
      keep_.resize(static_cast<size_t>(batch.B) * keep);
      std::vector<int> order(patches);
      for (int b = 0; b < batch.B; ++b) {
        Rng rng(t.seed ^ 0xF11Bull ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(first + b + 1)));
        std::iota(order.begin(), order.end(), 0);
        for (int i = 0; i < keep; ++i) {  // a partial Fisher-Yates: the first `keep` of a random order
          const int j = i + static_cast<int>(rng.next_u64() % static_cast<uint64_t>(patches - i));
          std::swap(order[i], order[j]);
        }
        std::sort(order.begin(), order.begin() + keep);
        std::copy(order.begin(), order.begin() + keep, keep_.begin() + static_cast<int64_t>(b) * keep);
      }
      batch.patch_keep = keep_.data();
      batch.keep = keep;
    }
    sync_.begin(micro == t.grad_accum - 1, step);
    // (Each micro-batch's gradient is its loss's, divided over the micro-batches of the step; the
    // ranks' shares sum to it: no 1 / world here, the loss is already over the global batch.)
    const ContrastiveResult c = model_.train_micro_batch(batch, 1.0f / static_cast<float>(t.grad_accum), &sync_, &gather,
                                                         r.trained);
    loss_sum += c.loss;
    r.accuracy_i2t += c.accuracy_i2t / t.grad_accum;
    r.accuracy_t2i += c.accuracy_t2i / t.grad_accum;
  }
  sync_.finish();
  r.sync = sync_.stats();
  optimizer_.clear_frozen_grads(step);
  measure_and_balance(r, config_.clip.grad_balance == GradBalance::norm);
  r.loss = loss_sum / t.grad_accum;  // the same on every rank: each computed the global loss
  const bool sharded = optimizer_.norm_is_sharded();
  double squares = optimizer_.local_grad_squares();
  if (sharded && world > 1) squares = dp_.allreduce_sum(squares);
  r.grad_norm = std::sqrt(squares);
  r.logit_scale = std::exp(std::min<double>(model_.logit_scale(), std::log(model_.spec().logit_scale_max)));
  if (optimizer_.accept(step, r.loss, r.grad_norm)) optimizer_.step(lr, step + 1, optimizer_.clip_for(r.grad_norm));
  last_ = r;
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
