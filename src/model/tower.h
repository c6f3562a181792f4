// One encoder of a dual encoder (model/clip.h): a chain of layers whose parameters live in a chunk
// store shared with the other tower, under store layer ids first_layer() .. first_layer() +
// num_layers() - 1, mapping its input (images, or token windows) to one feature vector per sample.
// Towers keep the layer ethos of the language models: each layer's backward is B (gradient for its
// input) and then W (its weight gradients), a BackwardObserver hears of both (gradient sync starts
// a layer's buckets as its W completes), and a layer's parameters are used through leases of the
// store (tiers fetch and pin them).
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"
#include "kernels/cpu/bf16.h"
#include "model/layer.h"

namespace keel {

// The precision of an image tower's products in its forward and backward passes under
// clip.visual_quant: "bf16" both ways; "int8" forward (a ViT's) and bf16 backward; "none" the
// process's own (`process`: runtime.precision). The tower holds it from its construction and hands
// it to every kernel of its passes (its blocks' included).
inline MathMode visual_math(VisualQuant quant, MatmulPrecision process) {
  if (quant == VisualQuant::int8) return MathMode{MatmulPrecision::int8, MatmulPrecision::bf16};
  return MathMode::uniform(quant == VisualQuant::bf16 ? MatmulPrecision::bf16 : process);
}

class Tower {
 public:
  virtual ~Tower() = default;
  virtual const char* name() const = 0;
  virtual int first_layer() const = 0;
  virtual int num_layers() const = 0;
  virtual int out_dim() const = 0;  // the shared embedding's width D
  // Initialises this tower's tensors (each from its own stream of (seed, name)).
  virtual void init_weights(uint64_t seed) = 0;
  // Activations for micro-batches of up to B samples (captions of up to T tokens; image towers
  // ignore T).
  virtual void allocate(int B, int T) = 0;
  // features[B, D] (unnormalised) of the batch; valid until the next forward.
  virtual const float* forward(const ClipBatch& batch) = 0;
  // From dfeatures[B, D] (the loss's gradient for the features of the last forward), every layer's
  // B and then W, last layer first; weight gradients accumulate into the store's grad plane.
  virtual void backward(const ClipBatch& batch, const float* dfeatures, BackwardObserver* observer) = 0;
  // Multiply-add FLOPs (x2) of one sample's forward and backward passes (MFU).
  virtual double train_flops_per_sample() const = 0;
  // Activation bytes held for micro-batches of the allocated size.
  virtual int64_t activation_bytes() const = 0;
};

}  // namespace keel
