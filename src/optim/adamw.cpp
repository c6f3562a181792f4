#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/bf16.h"

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
    if (store.chunks()[ci].replica) continue;
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
  const float b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(config_.beta1, static_cast<double>(t))));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(config_.beta2, static_cast<double>(t))));
  const float eps = static_cast<float>(config_.eps), lrf = static_cast<float>(lr);
  // The chunk's bf16 copy of its parameters, where the products read one (ChunkStore::bf16_params):
  // written in the same pass as the parameters, from the values in registers.
  uint16_t* bits = store.bf16_chunk_to_write(chunk);
  // p, g, m, v (and bits) point at the chunk's first element.
  auto update = [&](float* p, float* g, float* m, float* v) {
    for (const Segment& s : c.segments) {
      const bool decay = store.tensors()[s.tensor].spec.decay;
      const float wd = decay ? static_cast<float>(config_.weight_decay) : 0.0f;
      const int64_t begin = s.offset - c.offset, end = begin + s.numel;
      auto step_element = [&](int64_t i) {
        const float gi = g[i] * grad_scale;
        g[i] = 0.0f;
        const float mi = b1 * m[i] + (1.0f - b1) * gi;
        const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float pi = p[i] - lrf * ((mi * c1) / (std::sqrt(vi * c2) + eps) + wd * p[i]);
        p[i] = pi;
        return pi;
      };
      if (bits != nullptr) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = begin; i < end; ++i) bits[i] = to_bf16(step_element(i));
      } else {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = begin; i < end; ++i) step_element(i);
      }
    }
    // Alignment padding between segments: zero parameters, zero bits (as the lazy conversion
    // writes them), so that a copy written here is the whole chunk's, like one made on use.
    if (bits != nullptr) {
      int64_t at = 0;
      for (const Segment& s : c.segments) {
        std::fill(bits + at, bits + (s.offset - c.offset), uint16_t{0});
        at = s.offset - c.offset + s.numel;
      }
      std::fill(bits + at, bits + c.numel, uint16_t{0});
    }
  };
  Residency& memory = store.residency();
  const PageRef m_page{chunk, Plane::adam_m}, v_page{chunk, Plane::adam_v};
  if (memory.updates_at_home({chunk, Plane::param})) {
    // Parameters whose home is not the compute address (bf16 state's float32 master weights,
    // store/bf16_state.h): updated where they live, which also writes the working copy.
    PageLease use = store.use_chunk(chunk, {Plane::grad}, {Plane::adam_m, Plane::adam_v});
    float* g = store.chunk_view(chunk, Plane::grad).data();
    float* m = store.chunk_view(chunk, Plane::adam_m).data();
    float* v = store.chunk_view(chunk, Plane::adam_v).data();
    memory.update_at_home({chunk, Plane::param}, [&](float* p, size_t) { update(p, g, m, v); });
    use.end();
  } else if (memory.updates_at_home(m_page) && memory.updates_at_home(v_page)) {
    // Moments that live off the compute tier (host DRAM) are updated there, in place
    // (ZeRO-Offload's CPU optimizer step): they never travel to the compute tier and back.
    PageLease use = store.use_chunk(chunk, {Plane::grad}, {Plane::param});
    float* p = store.chunk_view(chunk, Plane::param).data();
    float* g = store.chunk_view(chunk, Plane::grad).data();
    memory.update_at_home(m_page, [&](float* m, size_t) {
      memory.update_at_home(v_page, [&](float* v, size_t) { update(p, g, m, v); });
    });
    use.end();
  } else {
    PageLease use = store.use_chunk(chunk, {Plane::grad}, {Plane::param, Plane::adam_m, Plane::adam_v});
    update(store.chunk_view(chunk, Plane::param).data(), store.chunk_view(chunk, Plane::grad).data(),
           store.chunk_view(chunk, Plane::adam_m).data(), store.chunk_view(chunk, Plane::adam_v).data());
    use.end();
  }
  // The gradient was consumed (zeroed in place) under a read lease: where pages move it is
  // declared zero rather than written back.
  memory.zero({chunk, Plane::grad}, /*zeroed_in_place=*/true);
  store.bump_version(chunk);
  if (bits != nullptr) store.bf16_written(chunk);
}

void AdamW::step(ChunkStore& store, double lr, int64_t t, float grad_scale, const std::vector<int64_t>* counts) {
  const auto [first, last] = store.moment_chunks();
  for (int c = first; c < last; ++c) {
    const int layer = store.chunks()[c].layer;
    // Frozen layers keep their parameters, moments and version; their gradients are dropped.
    if (layer < config_.frozen_at(t - 1)) {
      store.zero_grad_chunk(c);
      continue;
    }
    const int64_t own_t = counts != nullptr && layer < static_cast<int>(counts->size()) ? (*counts)[layer] : t;
    if (own_t == 0) continue;  // held this step
    step_chunk(store, c, lr, own_t, grad_scale);
  }
}

}  // namespace keel
