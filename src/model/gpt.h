// GPT-2: token + position embedding, pre-LayerNorm blocks of causal self-attention and a GELU
// MLP, final LayerNorm, LM head tied to the token embedding, cross-entropy loss. Its parameters
// live in a ChunkStore; it owns only activation memory, allocated once for the largest
// micro-batch.
//
// Layer indices (also the chunk store's layer ids): 0 = embedding, 1..L = blocks, L+1 = head.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "model/layer.h"
#include "store/chunk_store.h"

namespace keel {

// Told about each layer's progress during backward (gradient sync, prefetching, pipelines).
class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  virtual void after_backward_input(int layer) = 0;
  virtual void after_backward_weight(int layer) = 0;
};

class GPT {
 public:
  // Registers every parameter tensor with `store` (which must not be finalized yet) in llm.c's
  // per-layer order. The caller finalizes the store, then calls init_weights or loads state.
  GPT(const ModelConfig& config, ChunkStore& store);
  ~GPT();

  // GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), zero
  // biases, unit norms, zero padded vocabulary rows. Each tensor draws from its own stream
  // derived from (seed, tensor name), so the result does not depend on the chunk layout.
  void init_weights(uint64_t seed);

  // Allocates activations for micro-batches of up to B x T tokens (T <= max_seq_len).
  void allocate(int B, int T);

  // Forward pass through all layers. Returns the mean loss over B*T tokens when batch.targets is
  // given (0 otherwise). With batch.grad_scale != 0 it also prepares the loss gradient.
  float forward(const Batch& batch);
  // Backward pass through all layers, last to first, accumulating into the grad plane: B then W
  // of each layer, or, with defer_weight_grads, every B first and then every W (the order a
  // zero-bubble pipeline uses; the result is the same bytes). Requires a forward of the same
  // batch with grad_scale != 0.
  // The observer, if any, hears of every layer's B and W as they complete.
  void backward(const Batch& batch, bool defer_weight_grads = false, BackwardObserver* observer = nullptr);

  // Logits [B*T, padded_vocab] of the last forward pass (valid only when it had no grad_scale).
  const float* logits() const;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  Layer& layer(int i) { return *layers_[i]; }
  const ModelConfig& config() const { return config_; }
  ChunkStore& store() { return store_; }
  // Matrix-product FLOPs of one training step (forward + backward) per token at sequence T.
  double train_flops_per_token(int T) const;
  int64_t activation_bytes() const { return activation_floats_ * static_cast<int64_t>(sizeof(float)); }

 private:
  ModelConfig config_;
  ChunkStore& store_;
  std::vector<std::unique_ptr<Layer>> layers_;
  int max_B_ = 0, max_T_ = 0;
  int64_t activation_floats_ = 0;
  std::unique_ptr<float[]> memory_;
  std::vector<float*> x_;   // x_[i]: output of layer i, [B, T, C]
  std::vector<float*> dx_;  // dx_[i]: gradient of x_[i]
};

}  // namespace keel
