#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace keel {

double learning_rate(const OptimConfig& o, int step, int total_steps) {
  if (step < o.warmup_steps) return o.lr * (step + 1) / o.warmup_steps;
  const double min_lr = o.lr * o.min_lr_ratio;
  const int decay_steps = total_steps - o.warmup_steps;
  if (decay_steps <= 0) return o.lr;
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / decay_steps);
  return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

double grad_sum_squares(const ChunkStore& store, int chunk_begin, int chunk_end) {
  if (chunk_end < 0) chunk_end = static_cast<int>(store.chunks().size());
  double total = 0;
  for (int ci = chunk_begin; ci < chunk_end; ++ci) {
    double s = 0;
    if (!store.cached_grad_sum_squares(ci, &s)) {  // with tiers, usually known without a fetch
      const PageLease use = store.use_chunk(ci, {Plane::grad});
      s = sum_squares(store.chunk_view(ci, Plane::grad));
    }
    total += s;
  }
  return total;
}

void AdamW::step_chunk(ChunkStore& store, int chunk, double lr, int64_t t, float grad_scale) {
  const Chunk& c = store.chunks()[chunk];
  // The gradient is consumed (zeroed) here: with tiers it is declared zero afterwards rather
  // than written back.
  PageLease use = store.use_chunk(chunk, {Plane::grad}, {Plane::param, Plane::adam_m, Plane::adam_v});
  float* p = store.chunk_view(chunk, Plane::param).data() - c.offset;
  float* g = store.chunk_view(chunk, Plane::grad).data() - c.offset;
  float* m = store.chunk_view(chunk, Plane::adam_m).data() - c.offset;
  float* v = store.chunk_view(chunk, Plane::adam_v).data() - c.offset;
  const float b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(config_.beta1, static_cast<double>(t))));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(config_.beta2, static_cast<double>(t))));
  const float eps = static_cast<float>(config_.eps), lrf = static_cast<float>(lr);
  for (const Segment& s : c.segments) {
    const bool decay = store.tensors()[s.tensor].spec.decay;
    const float wd = decay ? static_cast<float>(config_.weight_decay) : 0.0f;
    const int64_t end = s.offset + s.numel;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = s.offset; i < end; ++i) {
      const float gi = g[i] * grad_scale;
      g[i] = 0.0f;
      const float mi = b1 * m[i] + (1.0f - b1) * gi;
      const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
      m[i] = mi;
      v[i] = vi;
      p[i] -= lrf * ((mi * c1) / (std::sqrt(vi * c2) + eps) + wd * p[i]);
    }
  }
  use.end();
  if (store.tiers() != nullptr) store.zero_grad_chunk(chunk);
  store.bump_version(chunk);
}

void AdamW::step(ChunkStore& store, double lr, int64_t t, float grad_scale) {
  const auto [first, last] = store.moment_chunks();
  for (int c = first; c < last; ++c) {
    // Frozen layers keep their parameters, moments and version; their gradients are dropped.
    if (store.chunks()[c].layer < config_.freeze_layers) {
      store.zero_grad_chunk(c);
      continue;
    }
    step_chunk(store, c, lr, t, grad_scale);
  }
}

}  // namespace keel
