// The seam between a model's backward pass and what acts on each layer as it completes (gradient
// sync, prefetching, pipelines): the model calls it (model/layer.h splits a layer's backward into
// B, the gradient for its input, and W, its weight gradients), the observers live in other folders
// (comm/grad_sync.h), so it sits below both.
#pragma once

namespace keel {

// Told about each layer's progress during backward (gradient sync, prefetching, pipelines).
class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  virtual void after_backward_input(int layer) = 0;
  virtual void after_backward_weight(int layer) = 0;
};

}  // namespace keel
