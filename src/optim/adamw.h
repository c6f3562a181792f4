// AdamW with decoupled weight decay, stepping the chunk store chunk by chunk: each chunk's
// moments live beside its parameters, and each update bumps the chunk's version. Also the
// learning-rate schedule and global-norm clipping.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// Linear warm-up from lr/warmup to lr over `warmup_steps`, then cosine decay to lr * min_lr_ratio
// at `total_steps`. `step` counts from 0.
double learning_rate(const OptimConfig& optim, int step, int total_steps);

// Sum of squares of the gradient plane over chunks [chunk_begin, chunk_end) (-1 = to the last),
// in double, in a fixed order (the same bytes for the same gradients whatever the thread timing).
// Replica chunks (copies of tied tensors homed elsewhere) are not counted: their home counts them.
double grad_sum_squares(const ChunkStore& store, int chunk_begin = 0, int chunk_end = -1);

class AdamW {
 public:
  explicit AdamW(const OptimConfig& config) : config_(config) {}
  // One update of every chunk whose moments the store holds (all, or this rank's ZeRO shard):
  // g = grad * grad_scale (the clipping factor); m, v updated; params
  // moved by lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p) where the tensor decays.
  // `t` is the 1-based update count used for bias correction. Bumps every chunk's version and
  // leaves the gradient plane zero, ready for the next step's accumulation (one pass over the
  // gradients instead of two).
  // `counts` (optional, by layer id): each layer's own update count instead of t (0: the layer is
  // held this step: parameters, moments, gradient and version untouched).
  void step(ChunkStore& store, double lr, int64_t t, float grad_scale, const std::vector<int64_t>* counts = nullptr);
  // Updates one chunk (the unit ZeRO and tiered stores will call).
  void step_chunk(ChunkStore& store, int chunk, double lr, int64_t t, float grad_scale);

 private:
  OptimConfig config_;
};

}  // namespace keel
